"""`sdslim demo`: the whole mission on the shipped tiny SD1.5-structure model, in a few minutes on a CPU.

Loads the teacher, trains adapters (ranks allocated where measured error falls fastest, at the parameter count of
uniform ``--ratio``), merges the shipped LoRA, folds, runs the shipped ControlNet through the slim UNet, samples the
same seeds/prompts with teacher and slim, measures the fidelity ladder's columns for the slim model and for what
users pick instead (fp8 storage, GGUF Q4_0, slim + fp8; :mod:`sdslim_core.apps.fidelity`), and writes a comparison grid,
a JSON + Markdown summary and the adapter file.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from . import fidelity
from .slim import slim_checkpoint
from .. import optional, tiny
from ..io.sizes import file_size
from ..modules import swap
from ..ops import breakdown, fold, lora, quant
from ..ops.sampling import diffusers_fn
from ..tiny import data as tiny_data
from ..tiny.data import nearest_colour
from ..train import Calibration, TrainConfig, train_adapters
from ..vram.live import memory_report

PROMPTS_SEED = 20261130          # a data stream the teacher never saw (it trained on seed 0)
FAST = dict(stage1_steps=30, stage2_steps=20, n_trajectories=4, sample_steps=8, ff_tokens=4096, res_maps=24,
            rank_grid=(0.25, 0.5, 0.75))
FULL = dict(stage1_steps=250, stage2_steps=700, n_trajectories=24, sample_steps=16, ff_tokens=16384, res_maps=96,
            rank_grid=(0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875))
ALTERNATIVES = ("fp8", "q4_0", "slim+fp8")


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _latency_ratio(teacher, slim, x, t, ctx, repeats: int) -> dict:
    """Median forward time of teacher and slim, interleaved in one run."""
    times = {"teacher": [], "slim": []}
    with torch.inference_mode():
        teacher(x, t, encoder_hidden_states=ctx)
        slim(x, t, encoder_hidden_states=ctx)
        for _ in range(repeats):
            for name, m in (("teacher", teacher), ("slim", slim)):
                t0 = time.perf_counter()
                m(x, t, encoder_hidden_states=ctx)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"teacher_ms": med["teacher"] * 1e3, "slim_ms": med["slim"] * 1e3, "speedup": med["teacher"] / med["slim"]}


def _iou(images, masks, bg_colour_idx) -> float:
    """IoU of the pixels that are not the named background colour with the control mask."""
    fg = (nearest_colour(images) != bg_colour_idx[:, None, None]).float()
    m = masks[:, 0]
    return ((fg * m).sum() / ((fg + m) > 0).float().sum().clamp(min=1)).item()


def _grid(rows: dict, captions: list, path: Path, scale: int = 4):
    """Rows of images (B,3,H,W) with row labels and column captions, saved as PNG."""
    from PIL import Image, ImageDraw
    size = next(iter(rows.values())).shape[-1] * scale
    label_w, head_h = 110, 28
    canvas = Image.new("RGB", (label_w + size * len(captions), head_h + size * len(rows)), "white")
    draw = ImageDraw.Draw(canvas)
    for j, cap in enumerate(captions):
        words = cap.replace("a ", "", 1).split(" on ")
        draw.text((label_w + j * size + 3, 2), words[0], fill="black")
        draw.text((label_w + j * size + 3, 14), "on " + words[-1] if len(words) > 1 else "", fill="black")
    for i, (name, imgs) in enumerate(rows.items()):
        draw.text((4, head_h + i * size + size // 2 - 6), name, fill="black")
        for j, img in enumerate(imgs):
            arr = (img.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype("uint8")
            tile = Image.fromarray(arr).resize((size, size), Image.NEAREST)
            canvas.paste(tile, (label_w + j * size, head_h + i * size))
    canvas.save(path)


def run_demo(out_dir, ratio: float = 0.5, fast: bool = False, n_images: int = 6, sample_steps: int = 20,
             seed: int = 0, train_overrides: dict | None = None) -> dict:
    """Run the demo; returns the summary dict (also written to ``out_dir``).

    ``train_overrides`` replaces :class:`TrainConfig` fields of the FAST/FULL presets (the test suite uses it).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # the 3M-parameter model is overhead-bound: more threads only contend
    try:
        return _run_demo(out, ratio, fast, n_images, sample_steps, seed, train_overrides)
    finally:
        torch.set_num_threads(threads)


def _run_demo(out: Path, ratio, fast, n_images, sample_steps, seed, train_overrides) -> dict:
    started = time.perf_counter()
    timings = {}

    def lap(name, t0):
        timings[name] = round(time.perf_counter() - t0, 1)

    # 1. the teacher ----------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    pipe = tiny.load_tiny_pipeline()
    cfg = pipe.checkpoint.config
    weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    lap("load", t0)

    # 2. train adapters from the teacher itself -------------------------------------------------------------------
    t0, cpu0 = time.perf_counter(), time.process_time()
    batch = tiny_data.make_batch(PROMPTS_SEED, 0, n_images)
    calib_prompts = [tiny_data.make_batch(seed + 1, i, 1).captions[0] for i in range(16)]
    settings = {**(FAST if fast else FULL), **(train_overrides or {})}
    work = out / "train-work"               # kept after an interruption or error: a rerun continues from it
    tc = TrainConfig(ratio=ratio, guidance=4.0, latent_size=pipe.latent_size, seed=seed, progress_bar=True,
                     work_dir=str(work), log=_log, **settings)
    adapter_path = out / "tiny_adapters.safetensors"
    result = train_adapters(pipe.unet, cfg, Calibration.from_prompts(calib_prompts, pipe.encode_prompt), tc,
                            adapter_path, resume="auto")
    aset = result.adapters
    timings["train_cpu"] = round(time.process_time() - cpu0, 1)
    lap("train", t0)
    original_rows = breakdown.count(shapes)
    slim_rows = breakdown.count(fold.slim_shapes(shapes, aset.ranks()))
    _log(breakdown.format_table(original_rows, slim_rows, f"tiny teacher ({cfg.family} structure), the parameters "
                                                          f"of uniform ratio {ratio}, allocated"))

    # 3. LoRA merge, fold, ControlNet -----------------------------------------------------------------------------
    t0 = time.perf_counter()
    merged, lora_report = lora.merge_loras(weights, [(tiny.LORA_PATH, 1.0)], cfg, fold_sites=aset)
    cands = fidelity.Candidates(cfg, weights, merged)
    slim = swap.slim_module(pipe.unet, aset, weights).eval()
    teacher_lora = cands.unet({**weights, **merged})
    slim_lora = swap.slim_module(teacher_lora, aset, {**weights, **merged}).eval()
    control = tiny.controlnet_hook(tiny.load_tiny_controlnet(), batch.masks)
    lap("merge_fold", t0)

    # 4. same seeds, same prompts: the fidelity engine --------------------------------------------------------------
    t0 = time.perf_counter()
    probe = fidelity.Probe(fn_of=diffusers_fn, context=pipe.encode_prompt(batch.captions),
                           uncond=pipe.encode_prompt([""] * n_images), noise=pipe.noise(n_images, seed + 7),
                           schedule=pipe.schedule, steps=sample_steps, guidance=4.0, decode=pipe.decode,
                           control=control)
    ref = fidelity.reference(probe, pipe.unet, teacher_lora)
    fid = fidelity.compare(probe, ref, slim, slim_lora)
    flop_args = ref.inputs[0]
    teacher_flops = fidelity.forward_flops(diffusers_fn(pipe.unet), *flop_args)
    n_teacher = sum(p.numel() for p in pipe.unet.parameters())
    alternatives = []
    for what in ALTERNATIVES:
        why = optional.missing("gguf", f"the demo's GGUF {what.upper()} row") if what in quant.GGUF_METHODS else None
        if why:
            _log(f"{why}; skipping that row")
            continue
        model, model_lora, w = cands.slim(aset, "fp8") if what == "slim+fp8" else cands.quantised(what)
        r = fidelity.compare(probe, ref, model, model_lora)
        alternatives.append({"row": what, "unet_bytes": quant.storage_bytes(w, "fp8" if what == "slim+fp8" else what),
                             "flops_ratio": fidelity.forward_flops(diffusers_fn(model), *flop_args) / teacher_flops,
                             **{k: r.get(k) for k in ("image_psnr_db", "image_ssim", "eps_rel_error",
                                                      "lora_effect_cosine", "controlnet_effect_cosine")}})

    def gen(model, ctrl=None):
        return pipe.generate(batch.captions, seed=seed + 7, steps=sample_steps, fn=diffusers_fn(model), control=ctrl)
    images = {"teacher": ref.images, "slim": fid["images"], "teacher+LoRA": gen(teacher_lora),
              "slim+LoRA": gen(slim_lora), "teacher+ControlNet": gen(pipe.unet, control),
              "slim+ControlNet": gen(slim, control)}
    lap("sampling", t0)

    # 5. the files a user gets: sizes on disk, by part ----------------------------------------------------------------
    files = _write_files(out, adapter_path)

    # 6. summary ----------------------------------------------------------------------------------------------------
    bg = batch.bg
    green = tiny_data.colour_index("green")
    fg_green = {k: (tiny_data.nearest_colour(v) == green).float().mean().item() for k, v in images.items()}
    n_slim = sum(p.numel() for p in slim.parameters())
    mem = memory_report()
    summary = {
        "model": {"family": cfg.family, "structure": "SD1.5 blocks, scaled down", "ratio": ratio,
                  "params_original": n_teacher, "params_slim": n_slim, "params_ratio": n_slim / n_teacher,
                  "unet_file_bytes_original": files[0]["unet"], "unet_file_bytes_slim": files[1]["unet"],
                  "flops_ratio": fidelity.forward_flops(diffusers_fn(slim), *flop_args) / teacher_flops,
                  "ranks": aset.ranks(), "breakdown_original": original_rows, "breakdown_slim": slim_rows},
        "fidelity": {"eps_rel_error": fid["eps_rel_error"], "guided_eps_rel_error": fid["guided_eps_rel_error"],
                     "latent_psnr_db": fid["latent_psnr_db"], "image_psnr_db": fid["image_psnr_db"],
                     "image_psnr_db_median": fid["image_psnr_db_median"],
                     "image_ssim": fid["image_ssim"]},
        "lora": {"effect_cosine_eps": fid["lora_effect_cosine"],
                 "green_fraction": {k: round(fg_green[k], 4) for k in ("teacher", "teacher+LoRA", "slim",
                                                                      "slim+LoRA")},
                 "image_psnr_db_slim_vs_teacher": fidelity.psnr(images["slim+LoRA"], images["teacher+LoRA"], 1.0),
                 "merge_report": lora_report.to_dict()},
        "controlnet": {"effect_cosine_eps": fid["controlnet_effect_cosine"],
                       "mask_iou": {k: round(_iou(images[k], batch.masks, bg), 4)
                                    for k in ("teacher", "teacher+ControlNet", "slim", "slim+ControlNet")},
                       "image_psnr_db_slim_vs_teacher": fidelity.psnr(images["slim+ControlNet"],
                                                                      images["teacher+ControlNet"], 1.0)},
        "alternatives": alternatives,
        "files": files,
        "latency": _latency_ratio(pipe.unet, slim, *flop_args,
                                  repeats=3 if fast else 7),
        "training": dict(result.report.to_dict(), work_dir=""),        # removed once the demo has succeeded
        "memory": mem.to_dict(),
        "memory_text": mem.format_text(),
        "settings": {"fast": fast, "sample_steps": sample_steps, "seed": seed, "prompts": batch.captions},
        "timings_s": timings,
    }
    _grid({k: images[k] for k in ("teacher", "slim", "slim+LoRA", "slim+ControlNet")}, batch.captions,
          out / "grid.png")
    timings["total"] = round(time.perf_counter() - started, 1)
    (out / "summary.json").write_text(json.dumps(fidelity.jsonable(summary), indent=2, default=str))
    (out / "summary.md").write_text(summary_markdown(summary))
    _log(summary_markdown(summary))
    _log(f"wrote {out / 'grid.png'}, {out / 'summary.json'}, {out / 'summary.md'}, {adapter_path}")
    shutil.rmtree(work, ignore_errors=True)           # the demo succeeded: nothing to resume
    return summary


def _write_files(out: Path, adapter_path: Path) -> list[dict]:
    """Write what ``sdslim slim`` makes of the tiny teacher with the demo's adapters (the default slim checkpoint,
    and GGUF Q4_0 slim and plain when the gguf package is there) and return every file's size by part, the source
    first; the embedded-adapters variant's size is the default's plus what ``--embed-adapters`` would add. They are
    the demo's own files in its own folder, rewritten on every run."""
    rows = [{"file": tiny.DEFAULT_PATH.name, **file_size(tiny.DEFAULT_PATH).to_dict()}]
    res = slim_checkpoint(tiny.DEFAULT_PATH, adapter_path, out / "tiny_slim.safetensors", overwrite=True)
    rows.append({"file": res.out.name, **res.file.to_dict()})
    rows.append({"file": res.out.name + " with --embed-adapters (not written)",
                 **{**res.file.to_dict(), "total": res.file.total + res.embed_bytes, "adapters": res.embed_bytes}})
    why = optional.missing("gguf", "the demo's GGUF files")
    if why:
        _log(f"{why}; skipping them")
        return rows
    for aset_path, name in ((adapter_path, "tiny_slim-Q4_0.gguf"), (None, "tiny-Q4_0.gguf")):
        res = slim_checkpoint(tiny.DEFAULT_PATH, aset_path, out / name, quant="Q4_0", overwrite=True)
        rows.append({"file": name, **res.file.to_dict()})
    return rows


def summary_markdown(s: dict) -> str:
    m, f, lo, c, lat = s["model"], s["fidelity"], s["lora"], s["controlnet"], s["latency"]
    lines = [
        "# sdslim demo summary", "",
        f"Tiny {m['structure']} teacher; slim at the parameter count of uniform ratio {m['ratio']}, ranks allocated "
        f"per site by measured error.", "",
        "| quantity | original | slim | ratio |", "|---|---|---|---|",
        f"| UNet params | {m['params_original']:,} | {m['params_slim']:,} | {m['params_ratio']:.3f} |",
        f"| UNet bytes in the file (fp16) | {m['unet_file_bytes_original']:,} | {m['unet_file_bytes_slim']:,} | "
        f"{m['unet_file_bytes_slim'] / m['unet_file_bytes_original']:.3f} |",
        f"| UNet forward FLOPs | | | ×{m['flops_ratio']:.3f} |",
        f"| UNet forward (CPU, CFG batch) | {lat['teacher_ms']:.1f} ms | {lat['slim_ms']:.1f} ms | "
        f"×{lat['speedup']:.2f} faster |", "",
        "| fidelity (same seeds, same prompts) | value |", "|---|---|",
        f"| eps relative error, slim vs teacher | {f['eps_rel_error']:.4f} |",
        f"| CFG-guided eps relative error | {f['guided_eps_rel_error']:.4f} |",
        f"| image PSNR slim vs teacher (all images / median image) | {f['image_psnr_db']:.2f} / "
        f"{f['image_psnr_db_median']:.2f} dB |",
        f"| image SSIM slim vs teacher | {f['image_ssim']:.4f} |",
        f"| LoRA-effect cosine (eps) | {lo['effect_cosine_eps']:.4f} |",
        f"| green pixels teacher → teacher+LoRA | {lo['green_fraction']['teacher']:.3f} → "
        f"{lo['green_fraction']['teacher+LoRA']:.3f} |",
        f"| green pixels slim → slim+LoRA | {lo['green_fraction']['slim']:.3f} → "
        f"{lo['green_fraction']['slim+LoRA']:.3f} |",
        f"| ControlNet-effect cosine (eps) | {c['effect_cosine_eps']:.4f} |",
        f"| mask IoU teacher → teacher+ControlNet | {c['mask_iou']['teacher']:.3f} → "
        f"{c['mask_iou']['teacher+ControlNet']:.3f} |",
        f"| mask IoU slim → slim+ControlNet | {c['mask_iou']['slim']:.3f} → {c['mask_iou']['slim+ControlNet']:.3f} |",
        "", "What users pick instead, same teacher, seeds and prompts:", "",
        "| row | UNet bytes (in its file) | FLOPs × | image PSNR dB | SSIM | LoRA cos | ControlNet cos |",
        "|---|---|---|---|---|---|---|",
        f"| slim (this run) | {m['unet_file_bytes_slim']:,} | {m['flops_ratio']:.3f} | {f['image_psnr_db']:.2f} | "
        f"{f['image_ssim']:.4f} | {lo['effect_cosine_eps']:.4f} | {c['effect_cosine_eps']:.4f} |",
        *[f"| {a['row']} | {a['unet_bytes']:,} | {a['flops_ratio']:.3f} | {a['image_psnr_db']:.2f} | "
          f"{a['image_ssim']:.4f} | {a['lora_effect_cosine']:.4f} | {a['controlnet_effect_cosine']:.4f} |"
          for a in s["alternatives"]],
        "", "The files (written by `sdslim slim`; bytes on disk, by part):", "",
        "| file | bytes | UNet | adapters | text encoders | VAE |", "|---|---|---|---|---|---|",
        *[f"| {r['file']} | {r['total']:,} | {r['unet']:,} | {r['adapters']:,} | {r['text_encoders']:,} | "
          f"{r['vae']:,} |" for r in s["files"]],
        "", "Memory (this machine, after the run):", "```", s["memory_text"], "```",
        f"Timings (s): {s['timings_s']}",
    ]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    summary = run_demo(args.out, ratio=args.ratio, fast=args.fast, sample_steps=args.sample_steps, seed=args.seed,
                       train_overrides={"adapter_dtype": args.adapter_dtype})
    if args.json:
        print(json.dumps(summary, default=str))
    return 0
