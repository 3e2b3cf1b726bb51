"""`sdslim breakdown`: where a UNet's parameters are, and what a slim ratio leaves."""
from __future__ import annotations

import json
import sys

from .. import layout
from ..apps.breakdown import breakdown_result
from ..ops import breakdown


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
