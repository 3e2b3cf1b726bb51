"""`sdslim slim`: LoRAs merged into the full weights and adapters folded into a slim checkpoint; or LoRAs applied,
in slim space, to a checkpoint that is already slim."""
from __future__ import annotations

import json
import sys

from ..io.files import format_bytes
from ..io.gguf import QUANT_TYPES, WRITE_TYPES
from ..io.lora_files import parse_lora_arg
from ..ops import fingerprint

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
    """The human-readable lines ``sdslim slim`` prints for a :class:`~sdslim_core.apps.slim.SlimResult`: every
    size is the written file's, by part."""
    lines = [result.merge.summary()] if loras and not result.lora_forms else []
    written = f"wrote {'GGUF ' + result.gguf_type + ' ' if result.gguf_type else ''}{result.out}: " \
              f"{result.file.text()} in {result.seconds:.1f} s"
    if result.lora_forms:
        forms = ", ".join(f"{n} {f}" for f, n in sorted(result.lora_forms.items()))
        lines.append(f"{result.family}: applied in slim space, no re-fold ({forms} LoRA modules)")
    elif not result.sites:
        lines.append(f"{result.family}: the full-size UNet as GGUF {result.gguf_type}" + (", LoRAs merged" if loras else ""))
    else:
        lines.append(f"{result.family}: folded {result.sites} sites; UNet {result.unet_params_before / 1e6:.1f}M -> "
                     f"{result.unet_params_after / 1e6:.1f}M parameters "
                     f"({result.unet_params_after / result.unet_params_before:.2f}x)")
    lines.append(written)
    src = result.source
    if src is not None and not result.lora_forms:
        lines.append(f"source {src.path}: {src.text()}; {result.file.ratio_text(src)}")
    if result.sites and result.adapter_bytes:
        lines.append(f"embedded adapters: {format_bytes(result.adapter_bytes)} "
                     f"({result.adapter_bytes / result.file.total:.0%} of the file), so LoRAs can be applied to it "
                     "later without the adapter file")
    elif result.sites and result.adapters_sha256 and not result.lora_forms:
        lines.append(f"adapters not embedded: loading and sampling need no adapter file; a LoRA applied to this file "
                     f"later finds it by its sha256 ({result.adapters_sha256[:12]}…) in the adapter folders "
                     f"(--embed-adapters would add {format_bytes(result.embed_bytes)})")
    if result.distance is not None:
        d = result.distance
        worst = ", ".join(f"{s} {v:.1%}" for s, v in d.worst())
        overall = f"{fingerprint.percent(d.overall)} of the folded weights (largest: {worst})" if d.overall else \
            "0 (the adapters' own base model)"
        lines.append(f"distance from the adapters' base: {overall}")
    lines += [f"note: {n}" for n in result.notes] + [f"warning: {w}" for w in result.warnings]
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
                             embed_adapters=args.embed_adapters, weight_dtype=weight_dtype, quant=quant,
                             overwrite=args.overwrite)
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
                                   "copied through; the adapter file recorded by its sha256). Given a slim "
                                   "checkpoint, apply the LoRAs to it in slim space instead (exact, no re-fold; the "
                                   "adapter file is found by its sha256, or embedded). The input is never "
                                   "modified.")
    p.add_argument("--ckpt", required=True, help="LDM/ComfyUI single-file .safetensors or a diffusers UNet folder; "
                                                 "or a slim checkpoint")
    p.add_argument("--adapters", help="sdslim adapter file (.safetensors); needed to fold. For a slim --ckpt, "
                                      "optional: a file (checked against the sha256 the checkpoint records) or a "
                                      "folder to search first; by default the adapter file is found by its sha256 in "
                                      "$SDSLIM_ADAPTER_PATH, the config file's adapter_paths and the slim file's "
                                      "folder")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="LoRA/LyCORIS/peft file (repeatable; strength default 1.0): merged before folding, or "
                        "applied in slim space to a slim --ckpt")
    p.add_argument("--out", required=True, help="output .safetensors (must differ from --ckpt)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (default: refuse)")
    p.add_argument("--select", type=float, default=1.0,
                   help="fraction of adapter sites to fold, lowest recorded error first (default 1.0: all)")
    embed = p.add_mutually_exclusive_group()
    embed.add_argument("--embed-adapters", action="store_true",
                       help="also store the folded sites' adapter tensors in the file (fp16; fp8 with --weight-dtype "
                            "fp8_e4m3fn; Q8_0 in GGUF), for one-file distribution: LoRAs applied to it later then "
                            "need no adapter file (default: only the adapter file's name and sha256 are recorded, "
                            "and a later LoRA finds that file by its sha256)")
    embed.add_argument("--no-embed-adapters", action="store_false", dest="embed_adapters",
                       help="the default: record the adapter file's sha256 only")
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
    p.set_defaults(func=run, embed_adapters=False)
