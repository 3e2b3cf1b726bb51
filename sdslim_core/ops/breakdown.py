"""Parameter breakdown of an SD UNet by component (ResNet, Transformer, Downsample, Upsample, Other).

``exact`` counts every parameter. ``seed`` reproduces the published table of the slimming plan
(``shared/seeds/002``): for SD1.x/SD2.x all parameters per class except FeedForward (weights only); for SDXL
Linear/Conv weights only.
"""
from __future__ import annotations

import math
import re
from typing import Mapping

ROWS = ("resnet", "transformer", "downsample", "upsample", "other")
_TRANSFORMER = re.compile(r"^(input_blocks\.\d+|middle_block|output_blocks\.\d+)\.\d+\.(norm|proj_in|proj_out|"
                          r"transformer_blocks)\.")
_RESNET = re.compile(r"\.(in_layers|out_layers|emb_layers|skip_connection)\.")
_DOWN = re.compile(r"^input_blocks\.\d+\.0\.op\.")
_UP = re.compile(r"^output_blocks\.\d+\.\d+\.conv\.")
_FF = re.compile(r"\.ff\.net\.")

SEED_FOOTNOTE = ("The published SDXL table cannot be reproduced by any counting rule: its Transformer row is "
                 "6×1280² = 9,830,400 below the weights-only count (one 1280×1280 projection missing in each "
                 "1280-wide transformer), and its Downsample row (19,353,600) is SD1.5's number, SDXL having only "
                 "two downsamplers (4,608,000). The rows above are the real counts under the table's rule.")


def classify_key(key: str) -> tuple[str, bool]:
    """(row, is_feedforward) of a canonical UNet key."""
    if _TRANSFORMER.match(key):
        return "transformer", bool(_FF.search(key))
    if _RESNET.search(key):
        return "resnet", False
    if _DOWN.match(key):
        return "downsample", False
    if _UP.match(key):
        return "upsample", False
    return "other", False


def count(shapes: Mapping[str, tuple], mode: str = "exact", family: str = "sd15") -> dict[str, int]:
    """Row → parameter count (plus ``total`` and ``feedforward``) of canonical key → shape."""
    if mode not in ("exact", "seed"):
        raise ValueError(f"mode must be 'exact' or 'seed', got {mode!r}")
    weights_only = mode == "seed" and family == "sdxl"
    rows = dict.fromkeys(ROWS + ("feedforward",), 0)
    for key, shape in shapes.items():
        n = math.prod(shape)
        row, is_ff = classify_key(key)
        if is_ff and (mode == "exact" or key.endswith(".weight")):
            rows["feedforward"] += n
        if weights_only and len(shape) < 2:
            continue
        rows[row] += n
    rows["total"] = sum(rows[r] for r in ROWS) if mode == "exact" else sum(rows[r] for r in ROWS[:4])
    return rows


def table_rows(original: Mapping[str, int], slim: Mapping[str, int] | None = None) -> list[tuple]:
    """(label, params, share of the total, slim params or None, slim/original ratio or None) per table row."""
    total = original["total"] or 1
    out = []
    for row in ROWS + ("total", "feedforward"):
        name = "(FeedForward)" if row == "feedforward" else row.capitalize() if row != "resnet" else "ResNet"
        ratio = None
        if slim:
            ratio = slim[row] / original[row] if original[row] else 1.0
        out.append((name, original[row], original[row] / total, slim[row] if slim else None, ratio))
    return out


def format_table(original: Mapping[str, int], slim: Mapping[str, int] | None = None, title: str = "") -> str:
    """A plain-text table with shares of the total (and the slim column with its ratio, when given)."""
    head = f"{'component':<14}{'params':>16}{'share':>8}"
    if slim:
        head += f"{'slim':>16}{'ratio':>8}"
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for name, n, share, n_slim, ratio in table_rows(original, slim):
        line = f"{name:<14}{n:>16,}{100 * share:>7.1f}%"
        if slim:
            line += f"{n_slim:>16,}{ratio:>7.2f}x"
        lines.append(line)
    return "\n".join(lines)
