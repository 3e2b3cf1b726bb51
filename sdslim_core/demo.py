"""`sdslim demo`: the whole mission on the shipped tiny SD1.5-structure model, in a few minutes on a CPU.

Loads the teacher, prints its breakdown, trains adapters (fast settings), merges the shipped LoRA, folds,
runs the shipped ControlNet through the slim UNet, samples the same seeds/prompts with teacher and slim, and
writes a comparison grid, a JSON + Markdown summary and the adapter file.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPTS_SEED = 20261130          # a data stream the teacher never saw (it trained on seed 0)
FAST = dict(stage1_steps=30, stage2_steps=20, n_trajectories=4, sample_steps=8, ff_tokens=4096, res_maps=24,
            rank_grid=(0.25, 0.5, 0.75))
FULL = dict(stage1_steps=400, stage2_steps=1500, n_trajectories=24, sample_steps=16, ff_tokens=16384, res_maps=96,
            rank_grid=(0.25, 0.5, 0.75))


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


def _eps(model, x, t, ctx, control=None):
    with torch.no_grad():
        res = control(x, t, ctx) if control else {}
        return model(x, t, encoder_hidden_states=ctx, **res).sample


def _iou(images, masks, bg_colour_idx) -> float:
    """IoU of the pixels that are not the named background colour with the control mask."""
    from .tiny_data import nearest_colour
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
    from . import adapters, breakdown, fold, layout, lora, swap, tiny, tiny_data
    from .fidelity import cosine, psnr, rel_error, ssim
    from .sampling import diffusers_fn
    from .train import Calibration, TrainConfig, train_adapters
    from .unet import load_diffusers_unet
    from .vram.live import memory_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings = {}

    def lap(name, t0):
        timings[name] = round(time.perf_counter() - t0, 1)

    # 1. the teacher and its breakdown ---------------------------------------------------------------------------
    t0 = time.perf_counter()
    pipe = tiny.load_tiny_pipeline()
    cfg = pipe.checkpoint.config
    weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    ranks = adapters.ranks_for_ratio(layout.sites(shapes), ratio)
    original_rows = breakdown.count(shapes)
    slim_rows = breakdown.count(fold.slim_shapes(shapes, ranks))
    _log(breakdown.format_table(original_rows, slim_rows, f"tiny teacher ({cfg.family} structure), ratio {ratio}"))
    lap("load", t0)

    # 2. train adapters from the teacher itself -------------------------------------------------------------------
    t0 = time.perf_counter()
    batch = tiny_data.make_batch(PROMPTS_SEED, 0, n_images)
    calib_prompts = [tiny_data.make_batch(seed + 1, i, 1).captions[0] for i in range(16)]
    settings = {**(FAST if fast else FULL), **(train_overrides or {})}
    tc = TrainConfig(ratio=ratio, guidance=4.0, latent_size=pipe.latent_size, seed=seed, progress_bar=True,
                     work_dir=str(out / "train-work"), log=_log, **settings)
    adapter_path = out / "tiny_adapters.safetensors"
    result = train_adapters(pipe.unet, cfg, Calibration.from_prompts(calib_prompts, pipe.encode_prompt), tc,
                            adapter_path)
    aset = result.adapters
    lap("train", t0)

    # 3. LoRA merge, fold, ControlNet -----------------------------------------------------------------------------
    t0 = time.perf_counter()
    folded = fold.fold_state_dict(weights, aset)
    slim = swap.build_slim_module(pipe.unet, aset, folded).eval()
    merged, lora_report = lora.merge_loras(weights, [(tiny.LORA_PATH, 1.0)], cfg, fold_sites=aset)
    with_lora = {**weights, **merged}
    teacher_lora = load_diffusers_unet(with_lora, cfg).eval()
    slim_lora = swap.build_slim_module(teacher_lora, aset, fold.fold_state_dict(with_lora, aset)).eval()
    controlnet = tiny.load_tiny_controlnet()
    control = tiny.controlnet_hook(controlnet, batch.masks)
    lap("merge_fold", t0)

    # 4. same seeds, same prompts -----------------------------------------------------------------------------------
    t0 = time.perf_counter()

    def gen(model, ctrl=None):
        return pipe.generate(batch.captions, seed=seed + 7, steps=sample_steps, fn=diffusers_fn(model), control=ctrl)
    images = {"teacher": gen(pipe.unet), "slim": gen(slim), "teacher+LoRA": gen(teacher_lora),
              "slim+LoRA": gen(slim_lora), "teacher+ControlNet": gen(pipe.unet, control),
              "slim+ControlNet": gen(slim, control)}
    lap("sampling", t0)

    # 5. metrics ----------------------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(seed + 11)
    x = torch.randn(n_images, cfg.in_channels, pipe.latent_size, pipe.latent_size, generator=g)
    t = torch.linspace(50, 950, n_images).long()
    ctx = pipe.encode_prompt(batch.captions)
    e = {"t": _eps(pipe.unet, x, t, ctx), "s": _eps(slim, x, t, ctx), "tl": _eps(teacher_lora, x, t, ctx),
         "sl": _eps(slim_lora, x, t, ctx), "tc": _eps(pipe.unet, x, t, ctx, control), "sc": _eps(slim, x, t, ctx, control)}
    bg = batch.bg
    green = tiny_data.colour_index("green")
    fg_green = {k: (tiny_data.nearest_colour(v) == green).float().mean().item() for k, v in images.items()}
    n_teacher = sum(p.numel() for p in pipe.unet.parameters())
    n_slim = sum(p.numel() for p in slim.parameters())
    mem = memory_report()
    summary = {
        "model": {"family": cfg.family, "structure": "SD1.5 blocks, scaled down", "ratio": ratio,
                  "params_original": n_teacher, "params_slim": n_slim, "params_ratio": n_slim / n_teacher,
                  "weight_bytes_fp16_original": 2 * n_teacher, "weight_bytes_fp16_slim": 2 * n_slim,
                  "breakdown_original": original_rows, "breakdown_slim": slim_rows},
        "fidelity": {"eps_rel_error": rel_error(e["s"], e["t"]),
                     "image_psnr_db": psnr(images["slim"], images["teacher"]),
                     "image_ssim": ssim(images["slim"], images["teacher"])},
        "lora": {"effect_cosine_eps": cosine(e["sl"] - e["s"], e["tl"] - e["t"]),
                 "green_fraction": {k: round(fg_green[k], 4) for k in ("teacher", "teacher+LoRA", "slim",
                                                                      "slim+LoRA")},
                 "image_psnr_db_slim_vs_teacher": psnr(images["slim+LoRA"], images["teacher+LoRA"]),
                 "merge_report": lora_report.to_dict()},
        "controlnet": {"effect_cosine_eps": cosine(e["sc"] - e["s"], e["tc"] - e["t"]),
                       "mask_iou": {k: round(_iou(images[k], batch.masks, bg), 4)
                                    for k in ("teacher", "teacher+ControlNet", "slim", "slim+ControlNet")},
                       "image_psnr_db_slim_vs_teacher": psnr(images["slim+ControlNet"], images["teacher+ControlNet"])},
        "latency": _latency_ratio(pipe.unet, slim, x[:2], t[:2], ctx[:2], repeats=3 if fast else 7),
        "training": result.report.to_dict(),
        "memory": mem.to_dict(),
        "memory_text": mem.format_text(),
        "settings": {"fast": fast, "sample_steps": sample_steps, "seed": seed, "prompts": batch.captions},
        "timings_s": timings,
    }
    _grid({k: images[k] for k in ("teacher", "slim", "slim+LoRA", "slim+ControlNet")}, batch.captions,
          out / "grid.png")
    timings["total"] = round(time.perf_counter() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(summary_markdown(summary))
    _log(summary_markdown(summary))
    _log(f"wrote {out / 'grid.png'}, {out / 'summary.json'}, {out / 'summary.md'}, {adapter_path}")
    return summary


def summary_markdown(s: dict) -> str:
    m, f, lo, c, lat = s["model"], s["fidelity"], s["lora"], s["controlnet"], s["latency"]
    lines = [
        "# sdslim demo summary", "",
        f"Tiny {m['structure']} teacher, slim ratio {m['ratio']}.", "",
        "| quantity | original | slim | ratio |", "|---|---|---|---|",
        f"| UNet params | {m['params_original']:,} | {m['params_slim']:,} | {m['params_ratio']:.3f} |",
        f"| fp16 weight bytes | {m['weight_bytes_fp16_original']:,} | {m['weight_bytes_fp16_slim']:,} | "
        f"{m['params_ratio']:.3f} |",
        f"| UNet forward (CPU, batch 2) | {lat['teacher_ms']:.1f} ms | {lat['slim_ms']:.1f} ms | "
        f"×{lat['speedup']:.2f} faster |", "",
        "| fidelity (same seeds, same prompts) | value |", "|---|---|",
        f"| eps relative error, slim vs teacher | {f['eps_rel_error']:.4f} |",
        f"| image PSNR slim vs teacher | {f['image_psnr_db']:.2f} dB |",
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
        "", "Memory (this machine, after the run):", "```", s["memory_text"], "```",
        f"Timings (s): {s['timings_s']}",
    ]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    summary = run_demo(args.out, ratio=args.ratio, fast=args.fast, sample_steps=args.sample_steps, seed=args.seed)
    if args.json:
        print(json.dumps(summary, default=str))
    return 0


def register(sub):
    p = sub.add_parser("demo", help="the whole mission on the shipped tiny model (a few minutes on a CPU)")
    p.add_argument("--out", default="out/demo", help="output folder (grid.png, summary.json/.md, adapters)")
    p.add_argument("--ratio", type=float, default=0.5, help="slim width fraction")
    p.add_argument("--fast", action="store_true", help="fewer training steps (for tests)")
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.set_defaults(func=run)
