"""`sdslim adapters`: which adapter file a slim file needs, how far a checkpoint is from an adapter file's base,
and a base fingerprint for an adapter file that has none."""
from __future__ import annotations

import json
import sys

from ..io.adapters import DEFAULT_FILE_DTYPE, FILE_DTYPES
from ..ops.fingerprint import WARN_DISTANCE


def add_dtype_argument(parser):
    """``--adapter-dtype``: the storage dtype of the adapter file a command writes."""
    parser.add_argument("--adapter-dtype", choices=tuple(FILE_DTYPES), default=DEFAULT_FILE_DTYPE,
                        help=f"storage dtype of the adapter file (default {DEFAULT_FILE_DTYPE}: half the bytes of "
                             "fp32, the same slim model to a cosine of 1.0000000; every reader computes in fp32)")


def _find(args) -> int:
    from ..apps.adapter_files import find_for_slim
    path = find_for_slim(args.slim, args.folder)
    print(json.dumps({"slim": args.slim, "adapters": str(path)}) if args.json else path)
    return 0


def _distance(args) -> int:
    from ..apps.adapter_files import checkpoint_distance
    d = checkpoint_distance(args.ckpt, args.adapters, args.device)
    if args.json:
        print(json.dumps(d.to_dict()))
        return 0
    print(f"{args.ckpt}: {d.overall:.1%} from the base of {args.adapters} over the {d.compared} tensors its "
          f"{len(d.sites)} sites fold", file=sys.stderr)
    for site, v in d.worst(len(d.sites)):
        print(f"  {site:<55} {v:7.2%}", file=sys.stderr)
    if d.overall > WARN_DISTANCE:
        print(f"past {WARN_DISTANCE:.0%}: base adapters keep measurably less of this checkpoint than adapters "
              f"refitted on it (`sdslim train --ckpt {args.ckpt} --from {args.adapters}`)", file=sys.stderr)
    return 0


def _fingerprint(args) -> int:
    from ..apps.adapter_files import add_fingerprint
    out = add_fingerprint(args.adapters, args.ckpt, args.out, overwrite=args.overwrite,
                          dtype=FILE_DTYPES[args.adapter_dtype])
    print(json.dumps({"out": str(out)}) if args.json else f"wrote {out}: {args.adapters} with the base fingerprint "
          f"of {args.ckpt} (tensors as {args.adapter_dtype})", file=sys.stdout if args.json else sys.stderr)
    return 0


def register(sub):
    p = sub.add_parser("adapters", help="adapter files: find one by hash, distance from its base, fingerprint")
    cmds = p.add_subparsers(dest="adapters_command", required=True)
    c = cmds.add_parser("find", help="the adapter file a slim file was folded with (found by its sha256)",
                        description="Print the adapter file a slim .safetensors/.gguf file records, found by its "
                                    "sha256 in FOLDERs, then $SDSLIM_ADAPTER_PATH, the config file's adapter_paths "
                                    "and the slim file's folder (the slim file itself if it embeds its adapters).")
    c.add_argument("slim", help="a slim .safetensors or .gguf file")
    c.add_argument("--folder", action="append", default=[], help="a folder to search first (repeatable)")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.set_defaults(func=_find)
    c = cmds.add_parser("distance", help="how far a checkpoint is from the base an adapter file was trained on",
                        description="Compare a checkpoint (a fine-tune or merge, say) with the base fingerprint an "
                                    "adapter file carries, per site and overall (relative weight change of what "
                                    "the fold reads); nothing is written.")
    c.add_argument("--ckpt", required=True, help="the checkpoint to slim")
    c.add_argument("--adapters", required=True, help="the adapter file")
    c.add_argument("--device", default="cpu", help="where the sketches are computed (e.g. cuda); default cpu")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.set_defaults(func=_distance)
    c = cmds.add_parser("fingerprint", help="add the base fingerprint of its base checkpoint to an adapter file",
                        description="Write a copy of an adapter file with the base fingerprint of the checkpoint it "
                                    "was trained on (adapter files from sdslim train have one already). The copy "
                                    "has a new sha256; slim files made with the old file keep finding the old one. "
                                    "Its tensors are stored as --adapter-dtype (an older fp32 file comes out at "
                                    "half the size).")
    c.add_argument("adapters", help="the adapter file")
    c.add_argument("--ckpt", required=True, help="the base checkpoint the adapters were trained on")
    c.add_argument("--out", required=True, help="the new adapter file (.safetensors)")
    add_dtype_argument(c)
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists (default: refuse)")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.set_defaults(func=_fingerprint)
