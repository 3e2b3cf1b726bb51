"""The GPU suite's VRAM figures from its ``results.json`` (matplotlib; run where the results came back to):

    python bench/gpu_plots.py out/gpu_suite/results.json [--out DIR] [--estimate]

- ``seed_device.png``: the seed study's curves as the device showed them (NVML, solid, one panel per group as the
  seed drew them: fine-tune, LoRA, SDXL), the predicted device peak (the estimate's allocator reserve + the measured
  context) dashed beside each;
- ``seed_allocated.png``: the same curves in torch's allocated bytes, with the estimate's live bytes dashed;
- ``device_error.png``: predicted vs measured device peak of every point (training and sampling), with ±10 %.

- ``vram.md``: every measured point beside its estimate (allocated, reserve, device) and the seed's constant /
  slope / order conclusions, measured and estimated (``gpu_report.vram_section``, as in the suite's ``results.md``).

Each file is written next to ``results.json`` unless ``--out`` says where. ``--estimate`` runs today's estimator
here (CPU, fake tensors) for every measured curve instead of reading the run's own ``vram_estimate`` part: for a
run made before the estimator changed, e.g. the first one (``../shared/data/gpu-h200-2026-12-04``, whose older
names :func:`current_names` reads).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_report import context_gib, vram_rows, vram_section  # noqa: E402
from sdslim_core.vram.plots import figure_curves  # noqa: E402

GROUPS = {"finetune": "fine-tune (SD1.5, 768 px unless said)", "lora": "LoRA (SD1.5)", "sdxl": "SDXL, 1024 px"}


def current_names(results: dict) -> dict:
    """``results`` in today's names: the first run (commit 4a1e45b) called the seed study ``vram_study``, kept no
    panel group per curve, and read NVML by polling during each point (``nvml_peak_gib``), which there equals the
    reserve + context that today's end-of-point reading (``nvml_end_gib``) gives."""
    parts = results["parts"]
    if "seed_study" not in parts and "vram_study" in parts:
        from gpu_vram import seed_group
        parts["seed_study"] = parts.pop("vram_study")
        for c in (parts["seed_study"].get("result") or {}).get("curves", []):
            c.setdefault("group", seed_group(c["name"]))
            for p in c["points"]:
                p.setdefault("nvml_end_gib", p.get("nvml_peak_gib"))
    return results


def estimate_here(results: dict) -> dict:
    """``results`` with its ``vram_estimate`` part replaced by this checkout's estimator, run here for every
    measured curve's settings at its measured batch sizes (one worker process, no GPU needed)."""
    from sdslim_core.vram.estimate import run_worker
    from sdslim_core.vram.settings import Settings
    measured = (results["parts"].get("seed_study", {}).get("result") or {}).get("curves", [])
    jobs = [(c["name"], Settings.from_dict(c["settings"]), [p["batch"] for p in c["points"]]) for c in measured]
    raws = run_worker(jobs, echo_progress=True) if jobs else []
    results["parts"]["vram_estimate"] = {"status": "ok", "result": {
        "curves": [r for r in raws if "error" not in r],
        "errors": {r["name"]: r["error"] for r in raws if "error" in r},
        "gpu": "estimated afterwards by bench/gpu_plots.py --estimate (this checkout's estimator, on a CPU)",
        "device_mode": next((r.get("device_mode") for r in raws if "error" not in r), None)}}
    return results


def _curves(results: dict, key: str) -> list:
    """The measured curves with ``peak_gib`` = the point's ``key`` (nvml_end_gib or peak_gib)."""
    out = []
    for c in (results["parts"].get("seed_study", {}).get("result") or {}).get("curves", []):
        pts = [dict(batch=p["batch"], peak_gib=p.get(key)) for p in c["points"] if p.get(key) is not None]
        if pts:
            out.append({"name": c["name"], "group": GROUPS.get(c.get("group"), c.get("group", "")), "points": pts})
    return out


def _estimates(results: dict, device: bool) -> list:
    context, _ = context_gib(results)
    out = []
    for c in (results["parts"].get("vram_estimate", {}).get("result") or {}).get("curves", []):
        if c["name"].startswith("sampling "):
            continue
        out.append({"name": c["name"], "points": [
            dict(batch=p["batch"], peak_gib=p["reserved_gib"] + context if device else p["peak_gib"])
            for p in c["points"]]})
    return out


def plot_all(results: dict, out_dir: Path) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    gpu = (results["parts"].get("environment", {}).get("result") or {}).get("gpu") or {}
    where = gpu.get("name", "dry run")
    for stem, key, device, label in (("seed_device", "nvml_end_gib", True, "device peak, NVML (GiB)"),
                                     ("seed_allocated", "peak_gib", False, "torch allocated peak (GiB)")):
        curves = _curves(results, key)
        if not curves:
            continue
        fig = figure_curves(curves, f"the seed's study on {where}: measured (solid) vs estimated (dashed)",
                            overlay=_estimates(results, device), ylabel=label)
        fig.savefig(out_dir / f"{stem}.png", dpi=90)
        written.append(out_dir / f"{stem}.png")
    rows = [r for r in vram_rows(results) if r["device"] is not None and r["predicted_device"] is not None]
    if rows:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(5.5, 5.0))
        ax = fig.subplots()
        ax.scatter([r["device"] for r in rows], [r["predicted_device"] for r in rows], s=12, label="training points")
        top = max(max(r["device"], r["predicted_device"]) for r in rows) * 1.05
        ax.plot([0, top], [0, top], "k-", lw=0.8)
        ax.plot([0, top], [0, top * 1.1], "k:", lw=0.8, label="±10 %")
        ax.plot([0, top], [0, top * 0.9], "k:", lw=0.8)
        ax.set_xlabel("measured device peak (NVML, GiB)")
        ax.set_ylabel("predicted device peak (GiB)")
        ax.set_title(f"sdslim vram estimate vs {where}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "device_error.png", dpi=90)
        written.append(out_dir / "device_error.png")
    section = vram_section(results)
    if section:
        (out_dir / "vram.md").write_text("\n".join(section).rstrip() + "\n")
        written.append(out_dir / "vram.md")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="the suite's results.json")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: next to results.json)")
    ap.add_argument("--estimate", action="store_true",
                    help="estimate every measured point with this checkout's estimator here, instead of the run's own")
    args = ap.parse_args(argv)
    results = current_names(json.loads(Path(args.results).read_text()))
    if args.estimate:
        results = estimate_here(results)
    written = plot_all(results, Path(args.out) if args.out else Path(args.results).parent)
    print("\n".join(str(p) for p in written) or "nothing to plot (no seed_study points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
