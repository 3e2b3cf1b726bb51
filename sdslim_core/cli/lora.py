"""`sdslim lora convert`: a LoRA made for the original model, rewritten (kohya format) for a slim checkpoint."""
from __future__ import annotations

import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch

from ..io.tensors import save_file_atomic
from ..ops.lora import LoraError, LoraMerger, MergeReport, parse_lora_arg, text_encoder_part
from ..ops.lora_slim import convert_modules, kohya_tensors

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclasses.dataclass
class ConvertResult:
    out: Path
    forms: dict                  # form → number of UNet modules
    text_encoder_keys: int       # copied unchanged
    tensors: int
    file_bytes: int
    dtype: str
    strength: float
    merge: MergeReport
    warnings: list

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        return d


def _usual_dtype(modules) -> torch.dtype:
    counts = collections.Counter(v.dtype for m in modules for k, v in m.tensors.items() if k != "alpha")
    return counts.most_common(1)[0][0] if counts else torch.float16


def convert_lora_for_slim(slim_path, lora, out, strength: float = 1.0, adapters=None,
                          dtype: torch.dtype | None = None) -> ConvertResult:
    """Write ``out``: ``lora`` converted into the slim space of ``slim_path`` (see :mod:`sdslim_core.ops.lora_slim`), as
    a kohya-format file with ``strength`` baked in and tensors in ``dtype`` (default: the LoRA's own).

    Low-rank modules keep their rank (``lora_up``/``lora_down``/``alpha``); LoHa/LoKr/full-diff modules on folded
    layers become exact dense slim deltas (LyCORIS full-diff ``diff``/``diff_b``, which ComfyUI and A1111 load);
    modules on layers the fold keeps and the text-encoder keys are copied. Before writing, the result is parsed
    again against the slim checkpoint's own shapes, as a shape-checking loader would. Nothing is written on error.
    """
    from ..apps.slim import check_output_path, open_slim
    out = Path(out)
    check_output_path(out, slim_path, lora, what="the converted LoRA")
    view = open_slim(slim_path, adapters)
    merger = LoraMerger([(lora, strength)], view.config, view.space.full_shapes, fold_sites=view.space.adapters)
    modules = merger.parsed[0][0]
    conversion = convert_modules(modules, view.space)
    dt = dtype or _usual_dtype(modules)
    tensors = kohya_tensors(conversion.modules, view.config, strength, dt)
    te, metadata = text_encoder_part(lora)
    clash = sorted(set(te) & set(tensors))
    if clash:
        raise LoraError(f"{lora}: text-encoder key {clash[0]} collides with a UNet key")
    try:                                         # what a shape-checking loader sees: every module fits a slim layer
        LoraMerger([(tensors, 1.0)], view.config, view.shapes)
    except LoraError as err:
        raise LoraError(f"internal error: the converted LoRA does not fit {slim_path}: {err}") from None
    counts = conversion.counts()
    meta = {k: v for k, v in metadata.items() if isinstance(v, str)}
    meta["sdslim.slim_lora"] = json.dumps({"source": Path(str(lora)).name, "slim": Path(str(slim_path)).name,
                                           "strength": strength, "forms": counts})
    save_file_atomic({**tensors, **te}, out, meta)
    name = {v: k for k, v in DTYPES.items()}.get(dt, str(dt).replace("torch.", ""))
    return ConvertResult(out, counts, len(te), len(tensors) + len(te), out.stat().st_size, name, strength,
                         merger.report, list(merger.report.warnings) + conversion.warnings)


def run(args) -> int:
    path, strength = parse_lora_arg(args.lora)
    result = convert_lora_for_slim(args.slim, path, args.out, strength, args.adapters, DTYPES.get(args.dtype))
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
    c.add_argument("--adapters", help="the adapter file, for a slim checkpoint made with --no-embed-adapters "
                                      "(checked against its recorded sha256)")
    c.add_argument("--dtype", choices=("same",) + tuple(DTYPES), default="same",
                   help="dtype of the written tensors (default: the LoRA's own)")
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    c.set_defaults(func=run)
