"""Estimator vs a real GPU: the small matrix measured (study) and estimated, with the error per point.

    python bench/vram_gpu_check.py [--out out/vram_gpu_check] [--batch-sizes 1,2,4] [--steps 3]

Needs a CUDA GPU and torch (CUDA build), diffusers, peft; bitsandbytes for the AdamW8bit row
(skipped without it). SD1.5 at 768 px, settings base, adamw8bit, grad_ckpt, full_bf16, lora16:
about 3-5 minutes on an H200 (study ~2 min, estimate on the host CPUs ~2 min). Exits 2 without a GPU.

Compared per point: the estimate vs torch's allocated peak (what the estimator models: live tensor
bytes), vs torch's reserved peak (allocator segments), and vs the NVML whole-device peak (what
nvidia-smi shows: + CUDA context, cuBLAS/cuDNN workspaces).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sdslim_core.vram.settings import parse_batch_sizes, select_matrix  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/vram_gpu_check")
    ap.add_argument("--matrix", default="small")
    ap.add_argument("--batch-sizes", default="1,2,4")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("vram_gpu_check: no CUDA GPU visible to torch; nothing to compare", file=sys.stderr)
        return 2
    from sdslim_core.vram.estimate import estimate_many
    from sdslim_core.vram.live import memory_report
    from sdslim_core.vram.outputs import write_outputs
    from sdslim_core.vram.study import run_study

    entries = select_matrix(args.matrix)
    batches = parse_batch_sizes(args.batch_sizes)
    print(memory_report().format_text(), flush=True)
    t0 = time.perf_counter()
    measured = run_study(entries, batches, args.steps, log=lambda m: print(m, flush=True))
    t_study = time.perf_counter() - t0
    estimated = [r.to_dict() for r in estimate_many(entries, batches, echo_progress=True)]
    t_est = time.perf_counter() - t0 - t_study
    os.makedirs(args.out, exist_ok=True)
    write_outputs(estimated, args.out, "vram_estimate", "estimated peak VRAM (fake tensors)")
    device = torch.cuda.get_device_name()
    write_outputs(measured, args.out, "vram_study", f"measured (solid) vs estimated (dashed), {device}",
                  overlay=estimated)

    est = {(c["name"], p["batch"]): p for c in estimated for p in c["points"]}
    print(f"\n{device}; study {t_study:.0f} s, estimate {t_est:.0f} s "
          f"(estimator device mode: {estimated[0]['device_mode']})")
    print("| setting | B | estimate | allocated | err | reserved | err | device (NVML) | err | est phase | meas phase |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for c in measured:
        for note in c.get("notes", []):
            print(f"| {c['name']} | - | {note} |")
        for p in c["points"]:
            e = est.get((c["name"], p["batch"]))
            if e is None:
                continue
            rel = lambda m: (e["peak_gib"] / m - 1) if m else float("nan")  # noqa: E731
            errors.append(rel(p["peak_gib"]))
            print(f"| {c['name']} | {p['batch']} | {e['peak_gib']:.2f} | {p['peak_gib']:.2f} | {rel(p['peak_gib']):+.1%} "
                  f"| {p['reserved_gib']:.2f} | {rel(p['reserved_gib']):+.1%} | {p['nvml_peak_gib'] or float('nan'):.2f} "
                  f"| {rel(p['nvml_peak_gib']):+.1%} | {e['phase']} | {p['phase']} |")
    if errors:
        print(f"\nestimate vs torch allocated peak: mean {sum(errors) / len(errors):+.1%}, "
              f"worst {max(errors, key=abs):+.1%} over {len(errors)} points")
    with open(os.path.join(args.out, "comparison.json"), "w") as f:
        json.dump({"device": device, "measured": measured, "estimated": estimated}, f, indent=1)
    print(f"wrote {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
