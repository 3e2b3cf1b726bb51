"""Derivative models of a shipped tiny teacher: full UNet fine-tunes on shifted data, and a 50/50 merge of two.

    python tools/make_derivatives.py --teacher tiny [--out out/derivatives] [--threads 1]

Each fine-tune trains every UNet weight of the teacher (VAE and text encoder frozen) with the teacher's own loss
(``tiny_common.diffusion_loss``: eps prediction, min-SNR 5, offset noise 0.5, 10 % empty captions) on one of
``tiny.data.SHIFTS`` (same captions, shifted style), at a constant learning rate after a short warm-up; the ladder
of :data:`LADDER` learning rates and step counts moves the weights a few % to tens of % (relative Frobenius
change, measured in float64 and written next to the files). ``merge`` is the 50/50 average of two fine-tunes on
different shifts. Files go to ``--out``/<teacher>/<name>.safetensors in the teacher's own layout (its VAE, text
encoder and metadata; the UNet replaced, fp16), plus ``derivatives.json``. Deterministic for a given thread count.
"""
import argparse
import copy
import json
import time
from pathlib import Path

from tiny_common import command_line, diffusion_loss, drop_captions, setup

import torch

from sdslim_core import layout, tiny
from sdslim_core.io.tensors import load_file, save_file_atomic
from sdslim_core.ops import fingerprint, sampling
from sdslim_core.tiny import data as tiny_data

UNET_PREFIX = "model.diffusion_model."
# name → (shift, learning rate, steps); "merge" averages the two fine-tunes named in MERGE
LADDER = {"pastel-1": ("pastel", 2e-4, 100), "pastel-2": ("pastel", 5e-4, 100), "pastel-3": ("pastel", 1e-3, 100),
          "pastel-4": ("pastel", 2e-3, 150), "pastel-5": ("pastel", 3e-3, 200), "stripes-3": ("stripes", 1e-3, 100)}
MERGE = ("pastel-3", "stripes-3")


def fine_tune(pipe, shift: str, lr: float, steps: int, batch: int = 16, seed: int = 0, warmup: int = 10) -> dict:
    """``pipe``'s UNet fine-tuned on ``shift`` data; returns its canonical float32 weights (``pipe`` unchanged)."""
    cfg = pipe.checkpoint.config
    unet = copy.deepcopy(pipe.unet).train().requires_grad_(True)
    opt = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.01)
    fn, schedule = sampling.diffusers_fn(unet), pipe.schedule
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        b = tiny_data.make_batch(seed + 100, step, batch, shift)
        x0 = pipe.encode(b.images)
        context = pipe.encode_prompt(drop_captions(b.captions, 0.1, g))
        loss = diffusion_loss(fn, x0, context, schedule, g, min_snr=5.0, offset_noise=0.5)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
    return {layout.diffusers_to_canonical_key(cfg, k): v.detach().float().clone()
            for k, v in unet.state_dict().items()}


def merge(a: dict, b: dict) -> dict:
    """The 50/50 weight average of two models with the same keys."""
    return {k: (a[k].double() + b[k].double()).mul(0.5).float() for k in a}


def write(teacher_path: Path, unet: dict, out: Path, info: dict) -> Path:
    """The teacher's file with its UNet replaced by canonical ``unet`` (fp16) and ``info`` in its metadata."""
    tensors, meta = load_file(teacher_path)
    missing = sorted(k for k in tensors if k.startswith(UNET_PREFIX) and k[len(UNET_PREFIX):] not in unet)
    if missing:
        raise KeyError(f"{teacher_path}: the derivative has no weights for {missing[:3]}")
    tensors.update({UNET_PREFIX + k: v.to(torch.float16).contiguous() for k, v in unet.items()})
    return save_file_atomic(tensors, out, {**meta, "sdslim.tiny.derivative": json.dumps(info)})


def unet_weights(path) -> dict:
    """Canonical float32 UNet weights of a tiny checkpoint file, as stored (fp16 → float32)."""
    tensors, _ = load_file(path)
    return {k[len(UNET_PREFIX):]: v.float() for k, v in tensors.items() if k.startswith(UNET_PREFIX)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", default="tiny", choices=sorted(tiny.TEACHERS))
    p.add_argument("--out", default="out/derivatives")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default="", help="comma-separated LADDER names (default: all, and the merge)")
    args = p.parse_args()
    setup(args.seed, args.threads)
    src = tiny.TEACHERS[args.teacher].model
    pipe = tiny.load_tiny_pipeline(src)
    base = unet_weights(src)
    folder = Path(args.out) / args.teacher
    folder.mkdir(parents=True, exist_ok=True)
    record_path = folder / "derivatives.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    command = command_line("make_derivatives.py", args)
    names = [n for n in args.only.split(",") if n] or list(LADDER)
    for name in names:
        shift, lr, steps = LADDER[name]
        t0 = time.time()
        weights = fine_tune(pipe, shift, lr, steps, args.batch, args.seed)
        info = {"base": src.name, "shift": shift, "lr": lr, "steps": steps, "batch": args.batch, "command": command}
        path = write(src, weights, folder / f"{name}.safetensors", info)
        stored = unet_weights(path)
        record[name] = {**info, "file": str(path), "seconds": round(time.time() - t0),
                        "relative_change": fingerprint.exact_distance(base, stored)}
        print(f"{name}: {record[name]['relative_change']:.2%} weight change in {record[name]['seconds']} s", flush=True)
        record_path.write_text(json.dumps(record, indent=1) + "\n")
    if not args.only and all((folder / f"{n}.safetensors").exists() for n in MERGE):
        merged = merge(*(unet_weights(folder / f"{n}.safetensors") for n in MERGE))
        info = {"base": src.name, "merge": list(MERGE), "weights": [0.5, 0.5], "command": command}
        path = write(src, merged, folder / "merge.safetensors", info)
        change = fingerprint.exact_distance(base, unet_weights(path))
        record["merge"] = {**info, "file": str(path), "relative_change": change}
        print(f"merge: {record['merge']['relative_change']:.2%} weight change", flush=True)
        record_path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
