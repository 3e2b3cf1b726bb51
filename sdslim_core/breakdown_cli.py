"""`sdslim breakdown`: where a UNet's parameters are, and what a slim ratio leaves."""
from __future__ import annotations

import json
import sys

from . import adapters, breakdown, fold, layout


def canonical_shapes_for_arch(arch: str) -> tuple[dict, layout.UNetConfig]:
    """Canonical key → shape of a published architecture (meta device: no memory, no download)."""
    from .unet import canonical_shapes
    cfg = layout.config_for_arch(arch)
    return canonical_shapes(cfg), cfg


def canonical_shapes_for_file(path) -> tuple[dict, layout.UNetConfig]:
    """Canonical key → shape of a checkpoint, from its header only."""
    from .unet import open_checkpoint
    ckpt = open_checkpoint(path)
    return ckpt.weights.shapes(), ckpt.config


def run(args) -> int:
    shapes, cfg = canonical_shapes_for_arch(args.arch) if args.arch else canonical_shapes_for_file(args.ckpt)
    rows = breakdown.count(shapes, args.mode, cfg.family)
    result = {"family": cfg.family, "mode": args.mode, **rows}
    slim_rows = None
    if args.ratio is not None:
        ranks = adapters.ranks_for_ratio(layout.sites(shapes), args.ratio)
        slim_rows = breakdown.count(fold.slim_shapes(shapes, ranks), args.mode, cfg.family)
        result["slim"] = {"ratio": args.ratio, **slim_rows}
    footnote = breakdown.SEED_FOOTNOTE if args.mode == "seed" and cfg.family == "sdxl" else ""
    if footnote:
        result["footnote"] = footnote
    if args.json:
        print(json.dumps(result))
    else:
        title = f"{cfg.family} UNet parameters ({args.mode} count)"
        print(breakdown.format_table(rows, slim_rows, title), file=sys.stderr)
        if footnote:
            print("\nNote: " + footnote, file=sys.stderr)
    return 0


def register(sub):
    p = sub.add_parser("breakdown", help="parameter breakdown by component (original and slim)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--arch", choices=layout.FAMILIES, help="a published architecture (built on the meta device)")
    src.add_argument("--ckpt", help="a .safetensors checkpoint or diffusers folder (header only is read)")
    p.add_argument("--mode", choices=("exact", "seed"), default="exact",
                   help="exact: every parameter; seed: the counting rule of the published table")
    p.add_argument("--ratio", type=float, help="also count the slim UNet at this width fraction (e.g. 0.5)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)
