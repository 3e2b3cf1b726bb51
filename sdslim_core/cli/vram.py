"""``sdslim vram report | estimate | study``: parsers and handlers (heavy imports inside handlers)."""
import json
import os
import sys

from . import error_text
from ..vram.settings import (ARCHS, ATTENTIONS, DEFAULT_BATCH_SIZES, LORA_KINDS, OPTIMIZERS, PRECISIONS, Settings,
                             parse_batch_sizes, select_matrix, settings_from_ckpt, with_overrides)

DEFAULT_RESOLUTION = {"sd15": 768, "sd2": 768, "sdxl": 1024}


def register(subparsers):
    vram = subparsers.add_parser("vram", help="where VRAM goes: live report, no-GPU estimate, GPU study")
    sub = vram.add_subparsers(dest="vram_command", required=True)

    rep = sub.add_parser("report", help="memory of the GPU (or CPU/MPS) as seen from this process")
    rep.add_argument("--device", default=None, help="cuda, cuda:1, mps or cpu (default: the best available)")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=cmd_report)

    est = sub.add_parser("estimate", help="peak VRAM of a training/sampling step, predicted without a GPU")
    _add_setting_args(est)
    est.add_argument("--batch-sizes", default="1,2,4,8")
    est.add_argument("--sampling", action="store_true", help="inference (one UNet evaluation) instead of training")
    est.add_argument("--slim-ratio", type=float, default=0.0, help="estimate the slim UNet at this ratio too "
                     "(not with a slim --ckpt: its own ranks are estimated)")
    est.add_argument("--matrix", default=None, help="run the study matrix instead: all|finetune|lora|small|NAME,...")
    est.add_argument("--out", default=None, help="write JSON/CSV/PNG/fit table into this folder")
    est.add_argument("--timeout", type=float, default=None, help="seconds before the worker is stopped")
    est.add_argument("--context-gib", type=float, default=None,
                     help="your GPU's CUDA context for the device peak: GiB nvidia-smi shows beyond torch's reserved "
                          "memory (default: the H200 figure in docs/vram.md)")
    est.add_argument("--json", action="store_true")
    est.set_defaults(func=cmd_estimate)

    st = sub.add_parser("study", help="measure the matrix on this machine's GPU (exit code 2 without one)")
    st.add_argument("--matrix", default="all", help="all|finetune|lora|small|NAME,... (default all)")
    st.add_argument("--arch", choices=ARCHS, default=None)
    st.add_argument("--resolution", type=int, default=None)
    st.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    st.add_argument("--steps", type=int, default=20)
    st.add_argument("--device", default="cuda")
    st.add_argument("--out", default="out/vram_study")
    st.add_argument("--overlay", default=None, help="an estimate JSON (estimate --out) to draw dashed")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_study)


def _add_setting_args(p):
    p.add_argument("--arch", choices=ARCHS, default="sd15")
    p.add_argument("--ckpt", default=None, help="the UNet of this file (header only): an original or slim "
                   ".safetensors, a diffusers folder, a slim or plain .gguf (quantised tensors kept so when sampling)")
    p.add_argument("--resolution", type=int, default=None, help="image size in px (default 768; SDXL 1024)")
    p.add_argument("--precision", choices=PRECISIONS, default="amp-bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--lora-kind", choices=LORA_KINDS, default="lora")
    te = p.add_mutually_exclusive_group()
    te.add_argument("--offload-te-vae", dest="resident_te_vae", action="store_false",
                    help="VAE and text encoder(s) off the GPU (default)")
    te.add_argument("--resident-te-vae", dest="resident_te_vae", action="store_true")
    p.set_defaults(resident_te_vae=False)


def settings_from_args(args) -> Settings:
    kw = dict(arch=args.arch, resolution=args.resolution or DEFAULT_RESOLUTION[args.arch],
              precision=args.precision, optimizer=args.optimizer, grad_ckpt=args.grad_ckpt,
              attention=args.attention, lora_rank=args.lora_rank, lora_kind=args.lora_kind,
              resident_te_vae=args.resident_te_vae, sampling=args.sampling, slim_ratio=args.slim_ratio)
    if args.ckpt:
        if not os.path.exists(args.ckpt):
            raise FileNotFoundError(args.ckpt)
        return settings_from_ckpt(args.ckpt, **kw)
    return Settings(**kw)


def _emit(obj, text, as_json):
    if as_json:
        print(json.dumps(obj))
    else:
        print(text)


def cmd_report(args) -> int:
    from ..vram.live import memory_report
    rep = memory_report(args.device)
    _emit(rep.to_dict(), rep.format_text(), args.json)
    return 0


def cmd_estimate(args) -> int:
    import subprocess
    try:
        return _estimate(args)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(error_text("vram estimate", err), file=sys.stderr)
        return 1


def estimate_results(args, **worker_kw) -> list:
    """The curves ``sdslim vram estimate`` computes for parsed ``args`` (``worker_kw``: see ``run_worker``)."""
    from ..vram import estimate
    batches = parse_batch_sizes(args.batch_sizes)
    if args.matrix:
        entries = with_overrides(select_matrix(args.matrix), args.arch, args.resolution)
        return estimate.estimate_many(entries, batches, getattr(args, "context_gib", None), **worker_kw)
    if args.sampling:
        return estimate.estimate_sampling(settings_from_args(args), batches, getattr(args, "context_gib", None),
                                          **worker_kw)
    return [estimate.estimate(settings_from_args(args), batches, getattr(args, "context_gib", None), **worker_kw)]


def results_json(args, results) -> dict:
    """The object ``sdslim vram estimate --json`` prints for ``results`` of ``estimate_results(args)``."""
    if args.matrix:
        return {"curves": [r.to_dict() for r in results]}
    obj = results[-1].to_dict()
    if args.sampling and len(results) > 1:
        obj["original"] = results[0].to_dict()
    return obj


def _estimate(args) -> int:
    results = estimate_results(args, timeout=args.timeout, echo_progress=not args.json)
    obj = results_json(args, results)
    for w in sorted({w for r in results for w in r.warnings}):
        print(f"warning: {w}", file=sys.stderr)
    if args.out:
        from ..vram.outputs import write_outputs
        paths = write_outputs([r.to_dict() for r in results], args.out, "vram_estimate",
                              f"estimated peak VRAM ({results[0].settings.label()})")
        print(f"wrote {', '.join(paths.values())}", file=sys.stderr)
    _emit(obj, "\n".join(r.format_text() for r in results), args.json)
    return 0


def cmd_study(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("sdslim vram study: no CUDA GPU is visible to torch; the study measures a real GPU. "
              "Use `sdslim vram estimate` for a prediction without one.", file=sys.stderr)
        return 2
    from ..vram.outputs import write_outputs
    from ..vram.study import run_study
    entries = with_overrides(select_matrix(args.matrix), args.arch, args.resolution)
    curves = run_study(entries, parse_batch_sizes(args.batch_sizes), args.steps, args.device,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    overlay = []
    if args.overlay:
        with open(args.overlay) as f:
            overlay = json.load(f)
    name = torch.cuda.get_device_name(args.device)
    paths = write_outputs(curves, args.out, "vram_study", f"measured peak VRAM (torch allocated) on {name}",
                          overlay=overlay)
    print(f"wrote {', '.join(paths.values())}", file=sys.stderr)
    with open(paths["table"]) as f:
        _emit({"device": name, "curves": curves}, f.read(), args.json)
    return 0
