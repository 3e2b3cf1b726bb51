"""A checkpoint's own CLIP text encoders as transformers ``CLIPTextModel(WithProjection)`` modules (no hub).

The structure is read from the weights' shapes; what shapes do not say is stated here: 64-wide attention heads,
LayerNorm eps 1e-5, 77 positions, EOS 49407 (the pooled token is the first EOS, as in ComfyUI), and per encoder its
activation (OpenAI CLIP-L ``quick_gelu``, OpenCLIP H/bigG ``gelu``), its padding token (CLIP-L pads with EOS,
OpenCLIP with id 0, as ComfyUI's and A1111's tokenizers do) and the hidden state the family's UNet was trained on:

- SD1.x: CLIP-L's last layer after the final LayerNorm;
- SD2.x: OpenCLIP-H's penultimate layer, final LayerNorm applied;
- SDXL: CLIP-L's and OpenCLIP-bigG's penultimate layers without it (concatenated to 2048 wide), and bigG's pooled
  output through its text projection.

``clip_skip=N`` selects the N-th layer from the end instead (ComfyUI's *CLIP Set Last Layer* at −N).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .. import optional
from ..io.tensors import FileFormatError, LazyStateDict
from ..layout import text_encoders as keys

HEAD_DIM = 64
BOS, EOS = 49406, 49407
LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class EncoderRole:
    """How a family uses one encoder: activation, padding token, hidden layer (−1 last), final norm, pooled."""
    activation: str
    pad: int
    layer: int
    final_norm: bool
    pooled: bool = False


ROLES = {
    ("sd15", "clip_l"): EncoderRole("quick_gelu", EOS, -1, True),
    ("sd2", "clip_h"): EncoderRole("gelu", 0, -2, True),
    ("sdxl", "clip_l"): EncoderRole("quick_gelu", EOS, -2, False),
    ("sdxl", "clip_g"): EncoderRole("gelu", 0, -2, False, pooled=True),
}


class TextEncoderMissing(FileFormatError):
    """The checkpoint carries no (complete) text encoder; the message names the keys looked for."""


@dataclasses.dataclass
class TextEncoder:
    """One loaded encoder: its layout entry, its role in the family and the transformers module (float32)."""
    layout: keys.TextEncoderLayout
    role: EncoderRole
    model: torch.nn.Module

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor, clip_skip: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [B, 77, D] of the role's layer, pooled [B, P] or None) for token ids [B, 77]."""
        device = next(self.model.parameters()).device
        out = self.model(input_ids=ids.to(device), output_hidden_states=True)
        h = out.hidden_states[-clip_skip if clip_skip else self.role.layer]
        if self.role.final_norm:
            h = getattr(self.model, "text_model", self.model).final_layer_norm(h)
        pooled = out.text_embeds if self.role.pooled else None
        return h.float(), None if pooled is None else pooled.float()


def _source(path: Path, entry: keys.TextEncoderLayout) -> tuple[LazyStateDict, str, str]:
    """(tensor source, key prefix, naming) of one encoder in a single file or a diffusers pipeline folder."""
    if path.is_dir():
        for name in keys.DIFFUSERS_WEIGHT_FILES:
            f = path / entry.folder / name
            if f.is_file():
                return LazyStateDict(f), "", "hf"
        raise TextEncoderMissing(f"{path}: no {entry.folder}/{keys.DIFFUSERS_WEIGHT_FILES[0]} (the {entry.name} "
                                 "text encoder of a diffusers pipeline folder)")
    return LazyStateDict(path), entry.prefix, entry.naming


def read_weights(path, entry: keys.TextEncoderLayout) -> dict[str, torch.Tensor]:
    """One encoder's weights in transformers naming, float32 (OpenCLIP's fused attention split, its projection
    transposed)."""
    path = Path(path)
    source, prefix, naming = _source(path, entry)
    own = [k for k in source if k.startswith(prefix)]
    if not own:
        raise TextEncoderMissing(f"{path}: no {entry.name} text encoder (no keys under {prefix!r}); pass "
                                 "--embeddings FILE with conditioning made by your UI instead")
    out = {}
    for k in own:
        name = k[len(prefix):]
        if naming == "hf":
            if not name.endswith("position_ids"):
                out[keys.hf_key(name)] = source[k].float()
            continue
        try:
            targets = keys.openclip_to_hf(name)
        except keys.TextEncoderKeyError as err:
            raise FileFormatError(f"{path}: {err}") from None
        for target, how in targets:
            t = source[k].float()
            if how == "transpose":
                t = t.t().contiguous()
            elif how in "qkv":
                t = t.chunk(3, dim=0)["qkv".index(how)].contiguous()
            out[target] = t
    return out


def _config(weights: dict, role: EncoderRole, path, name: str):
    transformers = optional.require("transformers", "encoding prompts with the checkpoint's text encoders")
    try:
        tok = weights["text_model.embeddings.token_embedding.weight"]
        pos = weights["text_model.embeddings.position_embedding.weight"]
        fc1 = weights["text_model.encoder.layers.0.mlp.fc1.weight"]
    except KeyError as err:
        raise TextEncoderMissing(f"{path}: the {name} text encoder is incomplete (no {err.args[0]})") from None
    proj = weights.get("text_projection.weight")
    hidden = tok.shape[1]
    return transformers.CLIPTextConfig(
        vocab_size=tok.shape[0], hidden_size=hidden, intermediate_size=fc1.shape[0],
        projection_dim=proj.shape[0] if proj is not None else hidden,
        num_hidden_layers=keys.hf_layer_count(weights), num_attention_heads=max(1, hidden // HEAD_DIM),
        max_position_embeddings=pos.shape[0], hidden_act=role.activation, layer_norm_eps=LAYER_NORM_EPS,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=role.pad)


def build(weights: dict, role: EncoderRole, path="<weights>", name="clip") -> torch.nn.Module:
    """The transformers module holding ``weights`` (``CLIPTextModelWithProjection`` when the role is pooled)."""
    transformers = optional.require("transformers", "encoding prompts with the checkpoint's text encoders")
    config = _config(weights, role, path, name)
    cls = transformers.CLIPTextModelWithProjection if role.pooled else transformers.CLIPTextModel
    if role.pooled and "text_projection.weight" not in weights:
        raise TextEncoderMissing(f"{path}: the {name} text encoder has no text projection (needed for SDXL's "
                                 "pooled output)")
    if not role.pooled:
        weights = {k: v for k, v in weights.items() if not k.startswith("text_projection.")}
    with torch.device("meta"):
        model = cls(config)
    if not any(k.startswith("text_model.") for k in model.state_dict()):   # transformers 5's CLIPTextModel
        weights = {k[len("text_model."):]: v for k, v in weights.items()}
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as err:
        raise FileFormatError(f"{path}: the {name} text encoder does not load: {str(err)[:400]}") from None
    for module in model.modules():       # non-persistent buffers stay on meta under assign=True
        for buf_name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                if buf_name != "position_ids":
                    raise FileFormatError(f"{path}: {name}: buffer {buf_name} has no value")
                module._buffers[buf_name] = torch.arange(buf.shape[-1]).expand(buf.shape).clone()
    return model.eval().requires_grad_(False)


def load(path, family: str, name: str, device="cpu") -> TextEncoder:
    """Encoder ``name`` of a ``family`` checkpoint (single file or diffusers pipeline folder), on ``device``."""
    entry = next((e for e in keys.FAMILY_TEXT_ENCODERS[family] if e.name == name), None)
    if entry is None:
        raise ValueError(f"{family} has no {name} text encoder")
    role = ROLES[(family, name)]
    return TextEncoder(entry, role, build(read_weights(path, entry), role, path, name).to(device))
