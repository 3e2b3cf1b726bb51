"""Writes a set of curves (estimate or study) as JSON, CSV, a PNG plot and a markdown fit table.

Both ``sdslim vram estimate --out`` and ``sdslim vram study --out`` use it, so their files overlay.
"""
import csv
import json
import os

from .fit import fit_curve, fit_table, kink_note
from .plots import plot_curves
from .settings import MATRIX


def curve_group(name: str) -> str:
    return MATRIX[name][1] if name in MATRIX else "custom"


def write_outputs(curves, out_dir, stem, title, overlay=()):
    """``curves``: dicts with name, baseline, settings, points. Returns the written paths."""
    os.makedirs(out_dir, exist_ok=True)
    for c in curves:
        c.setdefault("group", curve_group(c["name"]))
    paths = {k: os.path.join(out_dir, f"{stem}.{ext}") for k, ext in
             (("json", "json"), ("csv", "csv"), ("png", "png"), ("table", "md"))}
    with open(paths["json"], "w") as f:
        json.dump(curves, f, indent=1)
    scalar_keys = []
    for c in curves:
        for p in c["points"]:
            scalar_keys += [k for k, v in p.items() if not isinstance(v, dict) and k not in scalar_keys]
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["name", "group"] + scalar_keys)
        for c in curves:
            for p in c["points"]:
                writer.writerow([c["name"], c["group"]] + [p.get(k, "") for k in scalar_keys])
    plot_curves(curves, paths["png"], title, overlay=overlay)
    notes = [f"- **{c['name']}**: {kink_note(fit_curve(c['points']))}" for c in curves
             if not c.get("settings", {}).get("sampling")]
    with open(paths["table"], "w") as f:
        f.write(f"# {title}\n\n{fit_table(curves)}\n\n" + "\n".join(notes) + "\n")
    return paths
