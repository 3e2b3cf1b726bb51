"""`sdslim breakdown`: where a UNet's parameters are, and what a slim ratio leaves."""
from __future__ import annotations

import json
import sys

from .. import layout
from ..layout import rank_policy
from ..ops import breakdown, fold


def canonical_shapes_for_arch(arch: str) -> tuple[dict, layout.UNetConfig]:
    """Canonical key → shape of a published architecture (meta device: no memory, no download)."""
    from ..modules.unet import canonical_shapes
    cfg = layout.config_for_arch(arch)
    return canonical_shapes(cfg), cfg


def canonical_shapes_for_file(path) -> tuple[dict, layout.UNetConfig]:
    """Canonical key → shape of a checkpoint, from its header only."""
    from ..modules.unet import open_checkpoint
    ckpt = open_checkpoint(path)
    return ckpt.weights.shapes(), ckpt.config


def breakdown_result(arch: str | None = None, ckpt=None, mode: str = "exact", ratio: float | None = None) -> dict:
    """What ``sdslim breakdown --json`` prints: rows of ``arch`` or of the checkpoint ``ckpt``, and the slim rows
    under ``"slim"`` when ``ratio`` is given (``"footnote"`` for the SDXL seed table)."""
    shapes, cfg = canonical_shapes_for_arch(arch) if arch else canonical_shapes_for_file(ckpt)
    result = {"family": cfg.family, "mode": mode, **breakdown.count(shapes, mode, cfg.family)}
    if ratio is not None:
        ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), ratio)
        result["slim"] = {"ratio": ratio, **breakdown.count(fold.slim_shapes(shapes, ranks), mode, cfg.family)}
    if mode == "seed" and cfg.family == "sdxl":
        result["footnote"] = breakdown.SEED_FOOTNOTE
    return result


def run(args) -> int:
    result = breakdown_result(args.arch, args.ckpt, args.mode, args.ratio)
    if args.json:
        print(json.dumps(result))
    else:
        title = f"{result['family']} UNet parameters ({args.mode} count)"
        print(breakdown.format_table(result, result.get("slim"), title), file=sys.stderr)
        if "footnote" in result:
            print("\nNote: " + result["footnote"], file=sys.stderr)
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
