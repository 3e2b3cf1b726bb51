"""`sdslim demo`: the whole mission on the shipped tiny model (:mod:`sdslim_core.apps.demo`)."""
from __future__ import annotations

from .adapters import add_dtype_argument


def _run(args) -> int:
    from ..apps.demo import run
    return run(args)


def register(sub):
    p = sub.add_parser("demo", help="the whole mission on the shipped tiny model (a few minutes on a CPU)")
    p.add_argument("--out", default="out/demo", help="output folder (grid.png, summary.json/.md, adapters)")
    p.add_argument("--ratio", type=float, default=0.5, help="slim width fraction")
    p.add_argument("--fast", action="store_true", help="fewer training steps (for tests)")
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    add_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.set_defaults(func=_run)
