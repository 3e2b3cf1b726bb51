"""The GPU suite's VRAM figures from its ``results.json`` (matplotlib; run where the results came back to):

    python bench/gpu_plots.py out/gpu_suite/results.json [--out DIR]

- ``seed_device.png``: the seed study's curves as the device showed them (NVML, solid, one panel per group as the
  seed drew them: fine-tune, LoRA, SDXL), the predicted device peak (the estimate's allocator reserve + the measured
  context) dashed beside each;
- ``seed_allocated.png``: the same curves in torch's allocated bytes, with the estimate's live bytes dashed;
- ``device_error.png``: predicted vs measured device peak of every point (training and sampling), with ±10 %.

Each PNG is written next to ``results.json`` unless ``--out`` says where. The seed's constant / slope / order
conclusions, measured and estimated, are in the suite's ``results.md`` (``gpu_report``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_report import context_gib, vram_rows  # noqa: E402
from sdslim_core.vram.plots import figure_curves  # noqa: E402

GROUPS = {"finetune": "fine-tune (SD1.5, 768 px unless said)", "lora": "LoRA (SD1.5)", "sdxl": "SDXL, 1024 px"}


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
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="the suite's results.json")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: next to results.json)")
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    written = plot_all(results, Path(args.out) if args.out else Path(args.results).parent)
    print("\n".join(str(p) for p in written) or "nothing to plot (no seed_study points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
