"""`sdslim slim`: LoRAs merged into the full weights and adapters folded into a slim checkpoint; or LoRAs applied,
in slim space, to a checkpoint that is already slim."""
from __future__ import annotations

import json
import sys

from ..io.gguf import QUANT_TYPES, WRITE_TYPES
from ..io.lora_files import parse_lora_arg

FORMATS = ("safetensors", "gguf")
WEIGHT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8_e4m3fn": "float8_e4m3fn"}


def _progress(enabled: bool):
    """The fold's progress on stderr (``progress(i, n, site)``): a bar on a terminal, plain lines in a log."""
    if not enabled:
        return None
    from ..train.progress import Bar
    bar = Bar(None, "folding", unit="site")          # its size comes with the first site

    def show(i, n, site):
        bar.total = n
        bar.set_postfix({"site": site})
        bar.update(i - bar.n)
        if i == n:
            bar.close()
    return show


def summary_text(result, loras) -> str:
    """The human-readable lines ``sdslim slim`` prints for a :class:`~sdslim_core.apps.slim.SlimResult`."""
    mib = 2 ** 20
    lines = [result.merge.summary()] if loras and not result.lora_forms else \
        [f"warning: {w}" for w in result.warnings]
    if result.gguf_type and not loras and not result.unet_params_after < result.unet_params_before \
            and not result.sites:
        lines.append(f"{result.family}: wrote the full-size UNet as GGUF {result.gguf_type}: {result.out} "
                     f"({result.file_bytes / mib:.1f} MiB) in {result.seconds:.1f} s")
        return "\n".join(line for line in lines if line)
    if result.lora_forms:
        forms = ", ".join(f"{n} {f}" for f, n in sorted(result.lora_forms.items()))
        lines.append(f"{result.family}: applied in slim space, no re-fold ({forms} LoRA modules); wrote {result.out} "
                     f"({result.file_bytes / mib:.1f} MiB) in {result.seconds:.1f} s")
        return "\n".join(line for line in lines if line)
    stored = f"GGUF {result.gguf_type} " if result.gguf_type else ""
    lines.append(f"{result.family}: folded {result.sites} sites; UNet {result.unet_params_before / 1e6:.1f}M -> "
                 f"{result.unet_params_after / 1e6:.1f}M parameters ({result.to_dict()['ratio']:.2f}x); wrote "
                 f"{stored}{result.out} ({result.file_bytes / mib:.1f} MiB) in {result.seconds:.1f} s")
    if result.adapter_bytes:
        lines.append(f"embedded adapters: {result.adapter_bytes / mib:.1f} MiB "
                     f"(+{result.adapter_bytes / (result.file_bytes - result.adapter_bytes):.0%} over the file "
                     "without them), so LoRAs can be applied to it later without the adapter file; "
                     "--no-embed-adapters stores only the adapter file's sha256")
    return "\n".join(line for line in lines if line)


def run(args) -> int:
    from ..apps.slim import slim_checkpoint
    loras = [parse_lora_arg(x) for x in args.lora]
    import torch
    weight_dtype = getattr(torch, WEIGHT_DTYPES[args.weight_dtype]) if args.weight_dtype else None
    fmt = args.format or ("gguf" if str(args.out).lower().endswith(".gguf") else "safetensors")
    if args.quant and fmt != "gguf":
        raise ValueError(f"--quant {args.quant} is a GGUF type; add --format gguf (and a .gguf --out)")
    quant = (args.quant or "Q8_0") if fmt == "gguf" else None
    result = slim_checkpoint(args.ckpt, args.adapters, args.out, loras, select=args.select, device=args.device,
                             progress=_progress(not args.json),
                             embed_adapters=not args.no_embed_adapters, weight_dtype=weight_dtype, quant=quant)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(summary_text(result, loras), file=sys.stderr)
    return 0


def register(sub):
    p = sub.add_parser("slim", help="fold adapters into a slim checkpoint (LoRAs merged first), or apply LoRAs to a "
                                    "slim checkpoint",
                       description="Merge LoRAs into the full UNet weights, fold the sdslim adapters and write a "
                                   "slim .safetensors checkpoint (same key names, slim shapes; text encoder and VAE "
                                   "copied through; the adapters embedded under sdslim.adapters.). Given a slim "
                                   "checkpoint, apply the LoRAs to it in slim space instead (exact, no re-fold, no "
                                   "adapter file needed when they are embedded). The input is never modified.")
    p.add_argument("--ckpt", required=True, help="LDM/ComfyUI single-file .safetensors or a diffusers UNet folder; "
                                                 "or a slim checkpoint")
    p.add_argument("--adapters", help="sdslim adapter file (.safetensors); needed to fold, optional for a slim "
                                      "--ckpt (then checked against the sha256 the checkpoint records)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="LoRA/LyCORIS/peft file (repeatable; strength default 1.0): merged before folding, or "
                        "applied in slim space to a slim --ckpt")
    p.add_argument("--out", required=True, help="output .safetensors (must differ from --ckpt)")
    p.add_argument("--select", type=float, default=1.0,
                   help="fraction of adapter sites to fold, lowest recorded error first (default 1.0: all)")
    p.add_argument("--no-embed-adapters", action="store_true",
                   help="do not store the adapter tensors in the slim checkpoint (smaller file; applying LoRAs to it "
                        "later then needs --adapters)")
    p.add_argument("--weight-dtype", choices=sorted(WEIGHT_DTYPES),
                   help="store the UNet's weights (2-D and larger) in this dtype, each rounded once from the fold; "
                        "fp8_e4m3fn stacks fp8 storage on the slim UNet (default: keep the input's dtypes)")
    p.add_argument("--format", choices=FORMATS,
                   help="safetensors (a slim checkpoint: UNet, text encoder, VAE) or gguf (the UNet only, as "
                        "ComfyUI-GGUF loads it; load a slim one with Load Slim GGUF); default: from --out's suffix")
    p.add_argument("--quant", choices=WRITE_TYPES,
                   help=f"GGUF type of the UNet's large tensors ({', '.join(QUANT_TYPES)}: the gguf package's "
                        "quantisers, one pass from the float32 fold; F16: unquantised, for llama.cpp's patched "
                        "llama-quantize, which makes the K-quants); default Q8_0. Without --adapters the full-size "
                        "UNet is written (LoRAs merged)")
    p.add_argument("--device", default="cpu", help="device for the fold arithmetic (e.g. cuda); default cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)
