"""`sdslim lora convert`: a LoRA made for the original model, rewritten as a kohya-format file for a slim checkpoint
(exact in slim space; unmodified LoRA loaders apply it)."""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import torch

from .. import devices
from ..io.lora_files import LoraError, MergeReport, text_encoder_part
from ..io.tensors import save_file_atomic
from ..ops.lora import LoraMerger, follow
from ..ops.lora_slim import convert_modules, kohya_tensors
from .slim import check_output_path, open_slim

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
                          dtype: torch.dtype | None = None, device: str = "cpu",
                          overwrite: bool = False) -> ConvertResult:
    """Write ``out``: ``lora`` converted into the slim space of ``slim_path`` (see :mod:`sdslim_core.ops.lora_slim`), as
    a kohya-format file with ``strength`` baked in and tensors in ``dtype`` (default: the LoRA's own).

    Low-rank modules keep their rank (``lora_up``/``lora_down``/``alpha``); LoHa/LoKr/full-diff modules on folded
    layers become exact dense slim deltas (LyCORIS full-diff ``diff``/``diff_b``, which ComfyUI and A1111 load);
    modules on layers the fold keeps and the text-encoder keys are copied. Before writing, the result is parsed
    again against the slim checkpoint's own shapes, as a shape-checking loader would. Nothing is written on error;
    an existing ``out`` is replaced only with ``overwrite`` (else ``OutputExists``, before any work and at write time).
    ``device``: where the conversion computes (the adapters follow the LoRA's tensors there).
    """
    out = Path(out)
    check_output_path(out, slim_path, lora, what="the converted LoRA", overwrite=overwrite)
    view = open_slim(slim_path, adapters)
    merger = LoraMerger([(lora, strength)], view.config, view.space.full_shapes, fold_sites=view.space.adapters)
    dev = devices.resolve(device)
    modules = [follow(m, dev) for m in merger.parsed[0][0]]
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
    save_file_atomic({**tensors, **te}, out, meta, overwrite=overwrite)
    name = {v: k for k, v in DTYPES.items()}.get(dt, str(dt).replace("torch.", ""))
    return ConvertResult(out, counts, len(te), len(tensors) + len(te), out.stat().st_size, name, strength,
                         merger.report, list(merger.report.warnings) + conversion.warnings)
