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
    """``curves``: dicts with name, baseline, settings, points (none for a skipped setting; its ``notes`` say
    why). Returns the written paths. The PNG comes last: without matplotlib the other files are there."""
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
    measured = [c for c in curves if c["points"]]
    notes = [f"- **{c['name']}**: {kink_note(fit_curve(c['points']))}" for c in measured
             if not c.get("settings", {}).get("sampling")]
    notes += [f"- **{c['name']}**: {'; '.join(c.get('notes') or ['no points'])}" for c in curves if not c["points"]]
    with open(paths["table"], "w") as f:
        f.write(f"# {title}\n\n{fit_table(measured)}\n\n" + "\n".join(notes) + "\n")
    plot_curves(curves, paths["png"], title, overlay=overlay)
    return paths
