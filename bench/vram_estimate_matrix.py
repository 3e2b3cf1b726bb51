"""The seed's training-VRAM matrix on fake tensors vs the prototype's numbers and the seed's analytics.

    .venv/bin/python bench/vram_estimate_matrix.py [--out out/vram_estimate_matrix] [--plot docs/img/vram_estimate_sd15.png]

SD1.5, 768 px, B = 1, 2, 4, 8 (plus grad_ckpt at B = 10, 12, 16). Prints, per point, this estimator
vs the prototype (shared/reference/vram_estimator/results.jsonl, copied below) with ratio and diff,
then the seed's analytic checks. Needs no GPU.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sdslim_core.vram.estimate import estimate, estimate_matrix  # noqa: E402
from sdslim_core.vram.outputs import write_outputs  # noqa: E402
from sdslim_core.vram.settings import MATRIX  # noqa: E402

# prototype peak GiB (results.jsonl; its xformers rows use the sd-scripts layout, LoRA rows "nocast")
PROTOTYPE = {
    "base": ("amp_sdpa", {1: 16.0100, 2: 16.5083, 4: 21.8468, 8: 32.5239}),
    "xformers": ("amp_xformers", {1: 16.0100, 2: 16.5083, 4: 21.8468, 8: 32.5240}),
    "resident_te_vae": ("amp_xformers_resident_vae_te", {1: 16.3950, 2: 16.8933, 4: 22.2319, 8: 32.9090}),
    "adamw8bit": ("amp_xformers_adamw8bit", {1: 9.0635, 2: 11.7328, 4: 17.0713, 8: 27.7484}),
    "adamw_fused": ("amp_xformers_adamw_fused", {1: 13.8394, 2: 16.5086, 4: 21.8472, 8: 32.5243}),
    "fp32": ("fp32_xformers", {1: 16.0100, 2: 17.5632, 4: 25.5183, 8: 41.4287}),
    "full_bf16": ("full_bf16_xformers", {1: 8.0052, 2: 10.1418, 4: 15.4797, 8: 26.1558}),
    "grad_ckpt": ("amp_xformers_gc", {1: 16.0100, 2: 16.0100, 4: 16.0100, 8: 16.0100}),
    "res512": ("amp_xformers_res64", {1: 16.0100, 2: 16.0100, 4: 16.0100, 8: 20.6772}),
    "res1024": ("amp_xformers_res128", {1: 16.0100, 2: 20.6547, 4: 30.1395, 8: 49.1094}),
    "lora16": ("lora16_nocast", {1: 4.3534, 2: 7.0175, 4: 12.3456, 8: 23.0020}),
    "lora16_fa": ("lora16_fa_nocast", {1: 3.9059, 2: 6.1447, 4: 10.6224, 8: 19.5777}),
    "lora16_gc": ("lora16_gc_nocast", {1: 2.3268, 2: 2.9749, 4: 4.2711, 8: 6.8635}),
    "locon16": ("locon16_nocast", {1: 4.6855, 2: 7.5516, 4: 13.2839, 8: 24.7485}),
    "loha16": ("loha16_nocast", {1: 5.6174, 2: 8.9950, 4: 15.7683, 8: 29.3225}),
    "lora64": ("lora64_nocast", {1: 4.6710, 2: 7.3895, 4: 12.8264, 8: 23.7005}),
    "lora128": ("lora128_nocast", {1: 5.0944, 2: 7.8854, 4: 13.4675, 8: 24.6318}),
}
PROTOTYPE_GC_LARGE = {12: 16.9478, 16: 19.2940}  # amp_xformers_gc_b16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/vram_estimate_matrix")
    ap.add_argument("--plot", default=None, help="also save the plot here (docs/img/vram_estimate_sd15.png)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = estimate_matrix("all", (1, 2, 4, 8), echo_progress=True)
    gc_large = estimate(MATRIX["grad_ckpt"][0], (10, 12, 16), echo_progress=True)
    elapsed = time.perf_counter() - t0
    by = {r.name: r for r in results}

    print("\n| setting | prototype row | B | estimate GiB | prototype GiB | ratio | diff GiB | phase |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in results:
        proto_name, proto = PROTOTYPE.get(r.name, ("-", {}))
        for p in r.points:
            ref = proto.get(p["batch"])
            if ref is None:
                print(f"| {r.name} | - | {p['batch']} | {p['peak_gib']:.3f} | - | - | - | {p['phase']} |")
                continue
            worst = max(worst, abs(p["peak_gib"] / ref - 1))
            print(f"| {r.name} | {proto_name} | {p['batch']} | {p['peak_gib']:.3f} | {ref:.3f} | "
                  f"{p['peak_gib'] / ref:.4f} | {p['peak_gib'] - ref:+.3f} | {p['phase']} |")
    for p in gc_large.points:
        ref = PROTOTYPE_GC_LARGE.get(p["batch"])
        extra = f"{ref:.3f} | {p['peak_gib'] / ref:.4f} | {p['peak_gib'] - ref:+.3f}" if ref else "- | - | -"
        print(f"| grad_ckpt | amp_xformers_gc_b16 | {p['batch']} | {p['peak_gib']:.3f} | {extra} | {p['phase']} |")
    print(f"\nworst |ratio - 1| vs prototype: {worst:.2%}")

    peak = {name: {p["batch"]: p["peak_gib"] for p in r.points} for name, r in by.items()}
    saving8 = ", ".join(f"{peak['base'][b] - peak['adamw8bit'][b]:.2f}" for b in (2, 4, 8))
    print("\nseed analytics (SD1.5, 768 px):")
    print(f"  AdamW8bit saving, linear regime (B=2, 4, 8): {saving8} GiB (seed: 2*3.23 - 2*3.23/4 = 4.845, "
          f"with 3.23 in 1e9-byte GB and no absmax); at B=1: {peak['base'][1] - peak['adamw8bit'][1]:.2f} GiB "
          f"(the foreach temporary goes too)")
    print(f"  LoRA r16 saving at B=1: {peak['base'][1] - peak['lora16'][1]:.2f} GiB (seed: about 11.5-12)")
    line = gc_large.fit
    flat_to = (by["grad_ckpt"].fit.plateau_gib - line.intercept_gib) / line.slope_gib
    large = ", ".join(f"B={p['batch']} {p['peak_gib']:.2f}" for p in gc_large.points)
    print(f"  grad_ckpt: flat at {by['grad_ckpt'].fit.plateau_gib:.2f} GiB up to B = {flat_to:.1f} "
          f"(line {line.intercept_gib:.2f} + {line.slope_gib:.3f}*B; {large})")
    print(f"\n{len(results)} settings x 4 points + 3 points in {elapsed:.0f} s "
          f"({elapsed / (4 * len(results) + 3):.1f} s per point incl. worker start)")
    print("\n" + "\n".join(f"{r.name}: {r.classification}" for r in results if r.classification))

    curves = [r.to_dict() for r in results]
    paths = write_outputs(curves, args.out, "vram_estimate", "estimated peak VRAM, SD1.5 768 px (fake tensors)")
    print(f"\nwrote {', '.join(paths.values())}")
    if args.plot:
        from sdslim_core.vram.plots import plot_curves
        for c in curves:
            c["group"] = {"finetune": "full fine-tune (AMP bf16, AdamW, sdpa)",
                          "lora": "LoRA / LyCORIS (rank 16 unless named)"}[MATRIX[c["name"]][1]]
        plot_curves(curves, args.plot, "Estimated training peak VRAM, SD1.5 UNet, 768 px (no GPU used)")
        print(f"wrote {args.plot} ({os.path.getsize(args.plot) // 1024} KB)")


if __name__ == "__main__":
    main()
