"""Fidelity of the slim tiny teacher at several ratios: params, latency ratio, same-seed PSNR, LoRA cosine.

    .venv/bin/python bench/fidelity.py [--ratios 0.75,0.5,0.25] [--fast] [--out out/bench-fidelity]

Each ratio runs the full demo recipe (train → merge LoRA → fold → sample the same seeds/prompts as the
teacher), so the numbers are exactly what `sdslim demo --ratio R` reports.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from sdslim_core.demo import run_demo


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", default="0.75,0.5,0.25")
    ap.add_argument("--fast", action="store_true")
    ap.add_argument("--out", default="out/bench-fidelity")
    args = ap.parse_args()
    rows = []
    for ratio in (float(r) for r in args.ratios.split(",")):
        s = run_demo(Path(args.out) / f"ratio-{ratio}", ratio=ratio, fast=args.fast)
        rows.append((ratio, s))
    print("\n| ratio | params | × | latency × | eps rel err | image PSNR dB | SSIM | LoRA cos | ControlNet cos |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ratio, s in rows:
        m, f = s["model"], s["fidelity"]
        print(f"| {ratio} | {m['params_slim']:,} | {m['params_ratio']:.3f} | {s['latency']['speedup']:.2f} | "
              f"{f['eps_rel_error']:.4f} | {f['image_psnr_db']:.2f} | {f['image_ssim']:.4f} | "
              f"{s['lora']['effect_cosine_eps']:.4f} | {s['controlnet']['effect_cosine_eps']:.4f} |")


if __name__ == "__main__":
    main()
