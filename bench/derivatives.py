"""Derivatives: a base model's adapters folded into its fine-tunes and merges, next to adapters trained on each.

    python tools/make_derivatives.py --teacher tiny; python tools/make_derivatives.py --teacher wide
    .venv/bin/python bench/derivatives.py [--teachers tiny:half,0.716;wide:half] [--derivatives out/derivatives]
        [--refit pastel-4,pastel-5,merge] [--out out/bench-derivatives] [--reuse]

For each teacher and target slim parameter ratio (``half`` = SD1.5's ratio at uniform width ½), the base adapters
are trained on the teacher with the training-free recipe (``bench/fidelity.py``'s ``init``, ranks allocated at
the ratio's parameters); for each derivative written by ``tools/make_derivatives.py`` the same code path trains
adapters on the derivative itself. Both are folded into the derivative and compared with the derivative (its own
same-seed images with the teacher's LoRA and ControlNet: ``bench/fidelity.py``'s probe): image PSNR, LoRA-effect
cosine, ControlNet-effect cosine. Distances: the exact relative weight change of the whole UNet and of the weights
the folds read (float64), and the base adapters' fingerprint estimate (``ops/fingerprint.py``, overall and the
largest site). ``--refit`` derivatives also get a ``--from`` refit (``sdslim train --ckpt DERIVATIVE --from BASE``:
``train.recipes.settings("full", start_from=True)``) and a full run on the derivative (the demo's budget), with
their training CPU time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from fidelity import Teacher, sd15_half, uniform_ratio_for  # noqa: E402

from sdslim_core.apps import fidelity  # noqa: E402
from sdslim_core.io.adapters import AdapterSet  # noqa: E402
from sdslim_core.ops import fingerprint  # noqa: E402
from sdslim_core.train import recipes  # noqa: E402

KEEP = ("image_psnr_db", "image_ssim", "lora_effect_cosine", "controlnet_effect_cosine", "cpu_s")


def distances(base: Teacher, deriv: Teacher, aset: AdapterSet) -> dict:
    """Exact relative change (whole UNet, fold-read weights) and the fingerprint's estimate of the latter."""
    meter = fingerprint.DistanceMeter(aset.metadata["sdslim.base"])
    keys = []
    for site in aset.sites:
        for key in fingerprint.site_keys(site, aset.kind(site)):
            if key in deriv.weights:
                meter.add(site, key, deriv.weights[key])
                keys.append(key)
    d = meter.result()
    return {"unet": fingerprint.exact_distance(base.weights, deriv.weights),
            "folded": fingerprint.exact_distance(base.weights, deriv.weights, keys),
            "fingerprint": d.overall, "worst_site": d.worst(1)[0]}


def scores(t: Teacher, label: str, aset: AdapterSet, cpu_s) -> dict:
    m, ml, w = t.candidates.slim(aset)
    r = t.row(label, m, ml, w, None, cpu_s)
    return {k: r.get(k) for k in KEEP}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teachers", default="tiny:half,0.716;wide:half",
                    help="teacher:targets;… (targets: slim parameter ratios, `half` = SD1.5's at width ½)")
    ap.add_argument("--derivatives", default="out/derivatives")
    ap.add_argument("--refit", default="", help="derivatives that also get the --from refit and a full run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="reuse finished trainings in --out's work dirs")
    ap.add_argument("--out", default="out/bench-derivatives")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    refit = [r for r in args.refit.split(",") if r]
    results = {}
    for spec in args.teachers.split(";"):
        name, targets = spec.split(":")
        base = Teacher(name, reuse=args.reuse)
        base_lora = base.candidates.unet({**base.weights, **base.candidates.lora_delta})
        record = json.loads((Path(args.derivatives) / name / "derivatives.json").read_text())
        derivs = {d: Teacher(name, reuse=args.reuse, model=Path(info["file"])) for d, info in record.items()}
        for target in [sd15_half() if x == "half" else float(x) for x in targets.split(",")]:
            ratio = uniform_ratio_for(base.shapes, target)
            tag = f"{name}@{target:.3f}"
            work = out / "work" / tag
            base_aset, base_cpu = base.train(ratio, "params", "init", work / "base")
            base_file = work / "base" / "adapters.safetensors"
            base_aset = AdapterSet.load(base_file)
            rows = {}
            for d, t in derivs.items():
                r = {"derivative": d, "recipe": record[d].get("shift") or "merge " + "+".join(record[d]["merge"]),
                     **distances(base, t, base_aset)}
                teacher_cmp = fidelity.compare(t.probe, t.ref, base.pipe.unet, base_lora)
                r["base_unslimmed"] = {k: teacher_cmp.get(k) for k in KEEP}
                r["transfer"] = scores(t, f"{d}: base adapters", base_aset, base_cpu)
                own, cpu = t.train(ratio, "params", "init", work / d / "init")
                r["own"] = scores(t, f"{d}: own adapters", own, cpu)
                if d in refit:
                    aset, cpu = t.train(ratio, "params", "init", work / d / "refit", start_from=str(base_file),
                                        **recipes.settings("full", start_from=True))
                    r["refit"] = scores(t, f"{d}: refit --from", aset, cpu)
                    aset, cpu = t.train(ratio, "params", "demo", work / d / "full")
                    r["full"] = scores(t, f"{d}: own adapters, full", aset, cpu)
                rows[d] = r
                print(tag, json.dumps(fidelity.jsonable(r)), flush=True)
            results[tag] = {"ratio": target, "base_cpu_s": base_cpu, "rows": rows}
            (out / "results.json").write_text(json.dumps(fidelity.jsonable(results), indent=1))
            (out / "results.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    def f(v, spec=".1f"):
        return "–" if v is None else format(v, spec)
    parts = []
    for tag, res in results.items():
        parts.append(f"### {tag.replace('@', ' teacher, slim ')}x params\n\n"
                     "| derivative | data | UNet Δ | folded Δ | fingerprint (largest site) | base unslimmed dB | "
                     "base adapters dB / LoRA / CN | own adapters dB / LoRA / CN | own − base dB |\n"
                     "|---|---|---|---|---|---|---|---|---|")
        for r in res["rows"].values():
            tr, own = r["transfer"], r["own"]
            site, sd = r["worst_site"]
            parts.append(
                f"| {r['derivative']} | {r['recipe']} | {r['unet']:.1%} | {r['folded']:.1%} | "
                f"{r['fingerprint']:.1%} ({sd:.0%}) | {f(r['base_unslimmed']['image_psnr_db'])} | "
                f"{f(tr['image_psnr_db'])} / {f(tr['lora_effect_cosine'], '.3f')} / "
                f"{f(tr['controlnet_effect_cosine'], '.3f')} | {f(own['image_psnr_db'])} / "
                f"{f(own['lora_effect_cosine'], '.3f')} / {f(own['controlnet_effect_cosine'], '.3f')} | "
                f"{own['image_psnr_db'] - tr['image_psnr_db']:+.1f} |")
        refits = [r for r in res["rows"].values() if "refit" in r]
        if refits:
            parts.append("\n| derivative | fingerprint | base adapters dB | own training-free dB (CPU-min) | "
                         "refit --from dB / LoRA / CN | refit CPU-min | full run dB / LoRA / CN | full CPU-min |\n"
                         "|---|---|---|---|---|---|---|---|")
            for r in refits:
                rf, full, own = r["refit"], r["full"], r["own"]
                parts.append(
                    f"| {r['derivative']} | {r['fingerprint']:.1%} | {f(r['transfer']['image_psnr_db'])} | "
                    f"{f(own['image_psnr_db'])} ({own['cpu_s'] / 60:.1f}) | "
                    f"{f(rf['image_psnr_db'])} / {f(rf['lora_effect_cosine'], '.3f')} / "
                    f"{f(rf['controlnet_effect_cosine'], '.3f')} | {rf['cpu_s'] / 60:.1f} | "
                    f"{f(full['image_psnr_db'])} / {f(full['lora_effect_cosine'], '.3f')} / "
                    f"{f(full['controlnet_effect_cosine'], '.3f')} | {full['cpu_s'] / 60:.1f} |")
        parts.append("")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
