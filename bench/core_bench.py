"""Params, fp16 weight bytes and CPU latency of the slim UNet vs the original, measured side by side.

    .venv/bin/python bench/core_bench.py [--repeats 5] [--threads 2] [--counts-only]

Counts and forward FLOPs come from the real SD1.5/SDXL layouts (meta device), uniform ratios. Latency: one SD1.5-layout UNet forward
(random weights, fp32, 64×64 latent, batch 1, 77 context tokens), original and slim interleaved in the same
run, median of the repeats.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sdslim_core import layout
from sdslim_core.apps.breakdown import canonical_shapes_for_arch
from sdslim_core.io import adapters
from sdslim_core.layout import rank_policy
from sdslim_core.modules import swap
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.ops import breakdown, fold

RATIOS = (0.75, 0.5, 0.25)


def meta_flops_ratio(arch: str, ratio: float) -> float:
    """Forward FLOPs of the uniform-``ratio`` slim UNet over the original's (real layout on the meta device; SD1.5
    at a 64×64 latent, SDXL at 128×128, 77 context tokens; matmuls and convolutions as torch counts them)."""
    from sdslim_core.apps import fidelity
    cfg = layout.config_for_arch(arch)
    unet = build_diffusers_unet(cfg, device="meta").eval()
    weights = layout.to_canonical(unet.state_dict())[0]
    side = 64 if arch == "sd15" else 128
    with torch.device("meta"):
        x, t, ctx = torch.empty(1, 4, side, side), torch.tensor([500.0]), torch.empty(1, 77, cfg.context_dim)
        kw = {"added_cond_kwargs": {"text_embeds": torch.empty(1, cfg.adm_in_channels - 6 * 256),
                                    "time_ids": torch.empty(1, 6)}} if cfg.adm_in_channels else {}
        aset = adapters.AdapterSet.shaped_like({k: tuple(v.shape) for k, v in weights.items()}, cfg.family, ratio)
    slim = swap.slim_module(unet, aset, weights)
    return (fidelity.forward_flops(slim, x, t, encoder_hidden_states=ctx, **kw) /
            fidelity.forward_flops(unet, x, t, encoder_hidden_states=ctx, **kw))


def count_table():
    print(f"{'arch':<6}{'ratio':>6}{'params':>16}{'slim params':>16}{'x':>7}{'fp16 GiB':>10}{'slim GiB':>10}"
          f"{'FLOPs x':>9}")
    for arch in ("sd15", "sdxl"):
        shapes, _ = canonical_shapes_for_arch(arch)
        orig = breakdown.count(shapes)["total"]
        for ratio in RATIOS:
            ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), ratio)
            slim = breakdown.count(fold.slim_shapes(shapes, ranks))["total"]
            print(f"{arch:<6}{ratio:>6}{orig:>16,}{slim:>16,}{slim / orig:>7.3f}{orig * 2 / 2**30:>10.3f}"
                  f"{slim * 2 / 2**30:>10.3f}{meta_flops_ratio(arch, ratio):>9.3f}")


def cpu_timer(fn) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_times(models: dict, call, repeats: int, warmup: int = 1, timer=cpu_timer) -> dict:
    """{name: [seconds per call]}: ``warmup`` untimed calls of each model, then ``repeats`` rounds calling every
    model once per round (interleaved: each sees the same machine state), timed by ``timer(fn)``."""
    for m in models.values():
        for _ in range(warmup):
            call(m)
    times = {k: [] for k in models}
    for _ in range(repeats):
        for name, m in models.items():
            times[name].append(timer(lambda: call(m)))
    return times


def latency(repeats: int):
    cfg = layout.config_for_arch("sd15")
    torch.manual_seed(0)
    unet = build_diffusers_unet(cfg).eval()
    weights = layout.to_canonical(unet.state_dict())[0]
    models = {"original": unet}
    for ratio in RATIOS:
        ranks = rank_policy.ranks_for_ratio(layout.sites(weights), ratio)
        aset = adapters.AdapterSet.init_select(weights, ranks, "sd15")
        models[f"slim {ratio}"] = swap.slim_module(unet, aset, weights).eval()
    x, t, ctx = torch.randn(1, 4, 64, 64), torch.tensor([500]), torch.randn(1, 77, 768)
    with torch.inference_mode():
        times = interleaved_times(models, lambda m: m(x, t, encoder_hidden_states=ctx), repeats)
    base = statistics.median(times["original"])
    print(f"\nSD1.5 UNet forward, 64x64 latent, batch 1, fp32, {torch.get_num_threads()} threads, "
          f"median of {repeats}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<12}{med * 1000:>9.0f} ms   speed-up x{base / med:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--counts-only", action="store_true", help="the params/bytes/FLOPs table, no latency run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    count_table()
    if not args.counts_only:
        latency(args.repeats)


if __name__ == "__main__":
    main()
