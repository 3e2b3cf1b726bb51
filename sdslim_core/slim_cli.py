"""`sdslim slim`: LoRAs merged into the full weights, adapters folded, a slim checkpoint written."""
from __future__ import annotations

import json
import sys

from .lora import parse_lora_arg


def _progress(enabled: bool):
    if not enabled:
        return None

    def show(i, n, site):
        print(f"\rfolding {i}/{n} {site:<60}", end="" if i < n else "\n", file=sys.stderr, flush=True)
    return show


def summary_text(result, loras) -> str:
    """The human-readable lines ``sdslim slim`` prints for a :class:`~sdslim_core.slim.SlimResult`."""
    lines = [result.merge.summary()] if loras else [f"warning: {w}" for w in result.warnings]
    lines.append(f"{result.family}: folded {result.sites} sites; UNet {result.unet_params_before / 1e6:.1f}M -> "
                 f"{result.unet_params_after / 1e6:.1f}M parameters ({result.to_dict()['ratio']:.2f}x); wrote "
                 f"{result.out} ({result.file_bytes / 2 ** 20:.1f} MiB) in {result.seconds:.1f} s")
    return "\n".join(line for line in lines if line)


def run(args) -> int:
    from .slim import slim_checkpoint
    loras = [parse_lora_arg(x) for x in args.lora]
    result = slim_checkpoint(args.ckpt, args.adapters, args.out, loras, select=args.select, device=args.device,
                             progress=_progress(not args.json and sys.stderr.isatty()))
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(summary_text(result, loras), file=sys.stderr)
    return 0


def register(sub):
    p = sub.add_parser("slim", help="merge LoRAs, fold adapters and write a slim checkpoint",
                       description="Merge LoRAs into the full UNet weights, fold the sdslim adapters and write a "
                                   "slim .safetensors checkpoint (same key names, slim shapes; text encoder and VAE "
                                   "copied through). The input is never modified.")
    p.add_argument("--ckpt", required=True, help="LDM/ComfyUI single-file .safetensors or a diffusers UNet folder")
    p.add_argument("--adapters", required=True, help="sdslim adapter file (.safetensors)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="LoRA/LyCORIS/peft file merged before folding (repeatable; strength default 1.0)")
    p.add_argument("--out", required=True, help="output .safetensors (must differ from --ckpt)")
    p.add_argument("--select", type=float, default=1.0,
                   help="fraction of adapter sites to fold, lowest recorded error first (default 1.0: all)")
    p.add_argument("--device", default="cpu", help="device for the fold arithmetic (e.g. cuda); default cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)
