"""`sdslim lora convert`: a LoRA made for the original model, rewritten (kohya format) for a slim checkpoint."""
from __future__ import annotations

import json
import sys

from ..apps.lora_convert import DTYPES, convert_lora_for_slim
from ..io.lora_files import parse_lora_arg


def run(args) -> int:
    path, strength = parse_lora_arg(args.lora)
    result = convert_lora_for_slim(args.slim, path, args.out, strength, args.adapters, DTYPES.get(args.dtype),
                                   args.device, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    for w in dict.fromkeys(result.warnings):
        print(f"warning: {w}", file=sys.stderr)
    f = result.forms
    print(f"wrote {result.out} ({result.file_bytes / 2 ** 20:.1f} MiB, {result.dtype}, strength {strength:g} baked in): "
          f"{f['low-rank']} modules low-rank at their own rank (lora_up/lora_down/alpha), {f['dense']} dense "
          f"(exact slim-size deltas as full-diff .diff/.diff_b), {f['unchanged']} unchanged (layers the fold keeps), "
          f"{f['dropped']} dropped (norm2); {result.text_encoder_keys} text-encoder keys copied unchanged",
          file=sys.stderr)
    return 0


def register(sub):
    p = sub.add_parser("lora", help="LoRA files for slim checkpoints")
    cmds = p.add_subparsers(dest="lora_command", required=True)
    c = cmds.add_parser("convert", help="rewrite a LoRA for a slim checkpoint (kohya format)",
                        description="Convert a LoRA/LyCORIS/peft file made for the original model into a kohya-format "
                                    "LoRA for a slim checkpoint's UNet, exactly: ComfyUI's and A1111's own LoRA "
                                    "loaders then apply it to the slim model like to the original. Low-rank modules "
                                    "keep their rank; LoHa/LoKr/full diffs on folded layers become dense full-diff "
                                    "deltas; DoRA on folded layers is refused (merge it before slimming).")
    c.add_argument("--slim", required=True, help="the slim checkpoint (.safetensors made by `sdslim slim`)")
    c.add_argument("--lora", required=True, metavar="PATH[:STRENGTH]",
                   help="the LoRA for the original model; a strength other than 1 is baked into the file")
    c.add_argument("--out", required=True, help="output .safetensors")
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists (default: refuse)")
    c.add_argument("--adapters", help="the adapter file, for a slim checkpoint made with --no-embed-adapters "
                                      "(checked against its recorded sha256)")
    c.add_argument("--dtype", choices=("same",) + tuple(DTYPES), default="same",
                   help="dtype of the written tensors (default: the LoRA's own)")
    c.add_argument("--device", default="cpu", help="where the conversion computes (e.g. cuda); default cpu")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.set_defaults(func=run)
