"""Where a checkpoint keeps its text encoders, and their keys in transformers' CLIP naming (torch-free).

SD1.x carries OpenAI's CLIP ViT-L/14 text model in transformers naming (``cond_stage_model.transformer.``); SD2.x
OpenCLIP ViT-H/14 in OpenCLIP naming (``cond_stage_model.model.``); SDXL CLIP ViT-L (``conditioner.embedders.0.
transformer.``) and OpenCLIP ViT-bigG/14 (``conditioner.embedders.1.model.``). A diffusers pipeline folder keeps
them as ``text_encoder/`` and ``text_encoder_2/`` with their tokenizers in ``tokenizer/`` and ``tokenizer_2/``.
OpenCLIP keys map onto transformers' ``CLIPTextModel(WithProjection)`` keys here, with what the tensor needs on the
way: ``copy``, ``transpose`` (``text_projection``: OpenCLIP multiplies ``x @ P``) or one third of the fused
attention ``in_proj`` (``q``, ``k``, ``v``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class TextEncoderLayout:
    """One text encoder of a family: ``name`` (``clip_l``, ``clip_h``, ``clip_g``), its key prefix in an LDM
    single file, its naming there (``hf`` or ``openclip``) and its folders in a diffusers pipeline."""
    name: str
    prefix: str
    naming: str
    folder: str
    tokenizer_folder: str


FAMILY_TEXT_ENCODERS = {
    "sd15": (TextEncoderLayout("clip_l", "cond_stage_model.transformer.", "hf", "text_encoder", "tokenizer"),),
    "sd2": (TextEncoderLayout("clip_h", "cond_stage_model.model.", "openclip", "text_encoder", "tokenizer"),),
    "sdxl": (TextEncoderLayout("clip_l", "conditioner.embedders.0.transformer.", "hf", "text_encoder", "tokenizer"),
             TextEncoderLayout("clip_g", "conditioner.embedders.1.model.", "openclip", "text_encoder_2",
                               "tokenizer_2")),
}
DIFFUSERS_WEIGHT_FILES = ("model.safetensors", "model.fp16.safetensors")
OPENCLIP_IGNORED = ("logit_scale", "attn_mask")          # not part of the text transformer's forward

_LAYER_RENAMES = (("ln_1.", "layer_norm1."), ("ln_2.", "layer_norm2."), ("mlp.c_fc.", "mlp.fc1."),
                  ("mlp.c_proj.", "mlp.fc2."), ("attn.out_proj.", "self_attn.out_proj."))
_RESBLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.(.+)$")


class TextEncoderKeyError(ValueError):
    """A key of a text encoder that this mapping does not know; the message names it."""


def openclip_to_hf(key: str) -> list[tuple[str, str]]:
    """``[(transformers key, transform)]`` for one OpenCLIP text-tower key (``[]`` for keys the forward ignores);
    transform is ``copy``, ``transpose`` or ``q``/``k``/``v`` (that third of a fused ``in_proj``)."""
    fixed = {"token_embedding.weight": "text_model.embeddings.token_embedding.weight",
             "positional_embedding": "text_model.embeddings.position_embedding.weight",
             "ln_final.weight": "text_model.final_layer_norm.weight",
             "ln_final.bias": "text_model.final_layer_norm.bias"}
    if key in fixed:
        return [(fixed[key], "copy")]
    if key == "text_projection":
        return [("text_projection.weight", "transpose")]
    if key in OPENCLIP_IGNORED:
        return []
    m = _RESBLOCK.match(key)
    if m is None:
        raise TextEncoderKeyError(f"{key!r} is not an OpenCLIP text-transformer key")
    layer, rest = f"text_model.encoder.layers.{m[1]}.", m[2]
    if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
        part = rest.rsplit("_", 1)[1]
        return [(f"{layer}self_attn.{p}_proj.{part}", p) for p in "qkv"]
    for old, new in _LAYER_RENAMES:
        if rest.startswith(old):
            return [(layer + new + rest[len(old):], "copy")]
    raise TextEncoderKeyError(f"{key!r} is not an OpenCLIP text-transformer key")


def hf_key(key: str) -> str:
    """A transformers CLIP text key with the ``text_model.`` level that older checkpoints leave out."""
    return key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key


def hf_layer_count(keys: Iterable[str]) -> int:
    """Number of transformer layers among transformers-named CLIP text keys."""
    found = {int(m[1]) for k in keys if (m := re.match(r"^text_model\.encoder\.layers\.(\d+)\.", k))}
    return max(found) + 1 if found else 0
