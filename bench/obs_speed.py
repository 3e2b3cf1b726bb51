"""Seconds of the OBS removal order (the ``obs`` init's greedy backward selection) at the real FeedForward widths.

    .venv/bin/python bench/obs_speed.py [--widths 1280,2560,5120] [--before TREE] [--before-widths 1280,2560]
        [--threads 2]

For each width m (SD1.5/SDXL FeedForwards: 1280, 2560, 5120 hidden units; group 1), a correlated random
activation covariance and next-layer Gram of that size, float64 on the CPU, as the init computes them. With
``--before TREE`` (another source tree, e.g. ``git worktree add /tmp/before <rev>``) that tree's ``obs_order`` runs
on the same matrices in the same process, interleaved, and the two orders are compared unit by unit.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sdslim_core.train.init import obs_order  # noqa: E402


def tree_obs_order(tree: Path):
    """``obs_order`` of another source tree, imported under its own package name."""
    spec = importlib.util.spec_from_file_location("before_sdslim_core", tree / "sdslim_core" / "__init__.py",
                                                  submodule_search_locations=[str(tree / "sdslim_core")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["before_sdslim_core"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("before_sdslim_core.train.init").obs_order


def matrices(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation covariance, W_oᵀW_o) of an m-unit FeedForward: correlated units, a 4× narrower output layer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m + 256, m, generator=g) @ (torch.eye(m) + torch.randn(m, m, generator=g) / m ** 0.5)
    w = torch.randn(m // 4, m, generator=g)
    return (x.T @ x / x.shape[0]).double(), (w.T @ w).double()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="1280,2560,5120")
    p.add_argument("--before", default=None, help="another source tree whose obs_order to time alongside")
    p.add_argument("--before-widths", default="1280,2560", help="the widths to time --before at (it is slower)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    before = tree_obs_order(Path(args.before).resolve()) if args.before else None
    before_widths = {int(w) for w in args.before_widths.split(",") if w}
    print(f"threads {args.threads}, torch {torch.__version__}")
    print("| FF width m | this tree | before | speed-up | same order |\n|---|---|---|---|---|")
    for m in [int(w) for w in args.widths.split(",") if w]:
        cov, gram = matrices(m)
        t0 = time.perf_counter()
        order = obs_order(cov, gram)
        now = time.perf_counter() - t0
        cells = [f"{now:.1f} s", "–", "–", "–"]
        if before is not None and m in before_widths:
            t0 = time.perf_counter()
            old = before(cov, gram)
            then = time.perf_counter() - t0
            same = float((old == order).double().mean())
            cells[1:] = [f"{then:.1f} s", f"×{then / now:.1f}", f"{same:.1%}"]
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
