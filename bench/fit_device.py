"""The trainer's 8 GB check (``sdslim_core/train/device_fit.py``) at full size, without a checkpoint or a GPU:
per family and teacher placement (on the device, or offloaded: ``--offload-teacher on``), each phase's predicted
device peak, the fewest stage-2 groups that fit, or the device the run needs.

    .venv/bin/python bench/fit_device.py [--gib 8] [--ratio 0.5] [--context-gib 1.36] [--arch sd15,sdxl]

Ranks: uniform ``--ratio`` (the default recipe allocates ranks from the model's measured errors at the same
parameter count; the adapter state, which stage 2's peak depends on, differs little). Optimizer: 8-bit AdamW, as a
CUDA run with bitsandbytes uses. ``sdslim train --plan-only`` on a CUDA machine prints the same check for a real
checkpoint and its allocated ranks.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdslim_core import layout  # noqa: E402
from sdslim_core.apps.breakdown import canonical_shapes_for_arch  # noqa: E402
from sdslim_core.layout import rank_policy  # noqa: E402
from sdslim_core.train.config import TrainConfig  # noqa: E402
from sdslim_core.train.device_fit import device_fit  # noqa: E402

NATIVE_LATENT = {"sd15": 64, "sd2": 96, "sdxl": 128}


def check(arch: str, gib: float, ratio: float, context_gib: float | None, offload: bool = False) -> dict:
    """``device_fit`` for ``arch`` at uniform ``ratio``, on the fields of a training session it reads."""
    shapes, cfg = canonical_shapes_for_arch(arch)
    site_list = layout.sites(shapes)
    session = SimpleNamespace(site_list=site_list, site_order=[s.name for s in site_list], cfg=cfg, tc=TrainConfig(),
                              latent_size=NATIVE_LATENT[arch], device=torch.device("cpu"),
                              optimizer_name="adamw8bit")
    return device_fit(session, rank_policy.ranks_for_ratio(site_list, ratio), gib, context_gib, "adamw8bit",
                      offload=offload)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--context-gib", type=float, default=None)
    ap.add_argument("--arch", default="sd15,sdxl")
    args = ap.parse_args(argv)
    print("| family | latent | teacher | calibration | stage 1 | stage 2, 1 / 2 / 4 / 8 groups | verdict |")
    print("|---|---|---|---|---|---|---|")
    for arch in args.arch.split(","):
        for offload in (False, True):
            t = time.time()
            r = check(arch, args.gib, args.ratio, args.context_gib, offload)
            where = "offloaded" if offload else "on the device"
            if r.get("groups") is None and "needs_gib" not in r:
                print(f"| {arch} | | {where} | | | | {r['text']} |")
                continue
            s2 = " / ".join(f"{r['stage2_gib_by_groups'][g]:.2f}" for g in (1, 2, 4, 8))
            verdict = r["text"].split(";")[0]
            print(f"| {arch} | {NATIVE_LATENT[arch]}² | {where} | {r['calibration_gib']:.2f} | {r['stage1_gib']:.2f} "
                  f"| {s2} | {verdict} |", flush=True)
            print(f"  ({arch}, {where}: {time.time() - t:.0f} s; context {r['context_gib']:.2f} GiB)",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
