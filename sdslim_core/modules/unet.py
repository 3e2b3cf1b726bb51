"""Runnable UNets (diffusers ``UNet2DConditionModel``) from configurations and checkpoint files."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from .. import layout
from ..io import gguf
from ..io.slim_checkpoint import read_slim
from ..io.tensors import FileFormatError, LazyStateDict
from .layers import LayerError, resize_like, set_module

@dataclasses.dataclass
class CheckpointUNet:
    """The UNet part of a file: canonical tensors (lazy), its naming/prefix, config and the file's metadata."""
    path: Path
    weights: dict            # canonical key → tensor (read lazily from disk)
    naming: str
    prefix: str
    config: layout.UNetConfig
    metadata: dict
    source: LazyStateDict

    def other_keys(self) -> list[str]:
        """Keys of the file outside the UNet (text encoder, VAE, sdslim's own tensors …)."""
        unet = set(self.weights.file_keys.values())
        return [k for k in self.source if k not in unet]


class _LazyCanonical(dict):
    """canonical key → tensor, reading each tensor from the file on first access.

    ``file_keys`` maps each canonical key to its key in the file; :meth:`shapes` reads shapes from the header.
    """

    def __init__(self, source: LazyStateDict, file_keys: dict):
        super().__init__()
        self._source, self.file_keys = source, file_keys

    def shapes(self) -> dict:
        return {k: self._source.entries[f][1] for k, f in self.file_keys.items()}

    def __getitem__(self, key):
        return self._source[self.file_keys[key]]

    def get(self, key, default=None):
        return self[key] if key in self.file_keys else default

    def __contains__(self, key):
        return key in self.file_keys

    def __iter__(self):
        return iter(self.file_keys)

    def __len__(self):
        return len(self.file_keys)

    def keys(self):
        return self.file_keys.keys()

    def items(self):
        return ((k, self[k]) for k in self.file_keys)

    def values(self):
        return (self[k] for k in self.file_keys)


def _heads_from_metadata(metadata: dict) -> dict:
    if layout.UNET_CONFIG_KEY not in metadata:
        return {}
    try:
        cfg = json.loads(metadata[layout.UNET_CONFIG_KEY])
    except (TypeError, json.JSONDecodeError):
        raise FileFormatError(f"metadata {layout.UNET_CONFIG_KEY!r} is not JSON") from None
    return {k: cfg[k] for k in ("num_heads", "num_head_channels") if k in cfg}


def open_checkpoint(path) -> CheckpointUNet:
    """Open a single-file checkpoint (LDM/ComfyUI/bare/diffusers keys) or a diffusers UNet folder, lazily."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "unet" / "diffusion_pytorch_model.safetensors", path / "diffusion_pytorch_model.safetensors"]
        found = [c for c in candidates if c.exists()]
        if not found:
            raise FileNotFoundError(f"{path}: a diffusers folder needs unet/diffusion_pytorch_model.safetensors")
        path = found[0]
    source = LazyStateDict(path)
    shapes = source.shapes()
    try:
        prefix, naming = layout.strip_prefix(shapes)
        canon_shapes, _, _ = layout.to_canonical(shapes)
    except layout.LayoutError as err:
        raise layout.LayoutError(f"{path}: {err}") from None
    if naming == "ldm":
        mapping = {k: prefix + k for k in canon_shapes}
    else:
        structure_cfg = layout.config_from_state_dict(canon_shapes)
        mapping = {k: prefix + layout.canonical_to_diffusers_key(structure_cfg, k) for k in canon_shapes}
    try:
        cfg = layout.config_from_state_dict(canon_shapes, _heads_from_metadata(source.metadata))
    except layout.LayoutError as err:
        raise layout.LayoutError(f"{path}: {err}") from None
    return CheckpointUNet(path, _LazyCanonical(source, mapping), naming, prefix, cfg, dict(source.metadata), source)


def build_diffusers_unet(cfg: layout.UNetConfig, device="cpu", dtype=torch.float32, sample_size: int = 64):
    """An (uninitialised on ``meta``) diffusers ``UNet2DConditionModel`` for ``cfg``."""
    from diffusers import UNet2DConditionModel
    with torch.device(device):
        unet = UNet2DConditionModel(**layout.diffusers_config(cfg, sample_size))
    return unet.to(dtype) if str(device) != "meta" else unet


def canonical_shapes(cfg: layout.UNetConfig) -> dict:
    """Canonical key → shape of ``cfg``'s UNet, built on the meta device (no memory, no download)."""
    unet = build_diffusers_unet(cfg, device="meta")
    return layout.to_canonical({k: tuple(v.shape) for k, v in unet.state_dict().items()})[0]


def load_diffusers_unet(weights, cfg: layout.UNetConfig, dtype=torch.float32, device="cpu",
                        norm_groups: dict | None = None):
    """A diffusers UNet holding canonical ``weights``; slim shapes are allowed (layers are resized to fit,
    with ``norm_groups`` giving the GroupNorm groups of resized Res sites, default 32 or the largest divisor)."""
    unet = build_diffusers_unet(cfg, device="meta")
    target = unet.state_dict()
    mapped = {layout.canonical_to_diffusers_key(cfg, k): weights[k] for k in weights}
    missing = sorted(set(target) - set(mapped))
    if missing:
        raise FileFormatError(f"UNet weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    groups = {layout.canonical_to_diffusers_key(cfg, f"{site}.{layout.RES_LAYERS['ldm']['norm2']}"): g
              for site, g in (norm_groups or {}).items()}
    _resize_to(unet, {k: tuple(v.shape) for k, v in mapped.items()}, groups)
    unet.load_state_dict({k: v.to(dtype) for k, v in mapped.items()}, strict=True, assign=True)
    return unet.to(device)


def _resize_to(unet, shapes: dict, groups: dict):
    """Replace Linear/Conv2d/GroupNorm modules whose stored weights have other (slim) shapes."""
    for name, module in list(unet.named_modules()):
        w = shapes.get(f"{name}.weight")
        if w is None or not hasattr(module, "weight") or tuple(module.weight.shape) == w:
            continue
        try:
            new = resize_like(module, w, ops=nn, groups=groups.get(name), device="meta",
                              dtype=torch.get_default_dtype())
        except LayerError as err:
            raise FileFormatError(f"{name}: {err}") from None
        set_module(unet, name, new)


def load_slim_unet(path, dtype: torch.dtype | None = None, device="cpu"):
    """A diffusers ``UNet2DConditionModel`` holding a slim checkpoint: (unet, full-size cfg, sdslim metadata).

    ``dtype`` defaults to the file's UNet dtype.
    """
    lazy, mapping, _, _, cfg, meta = read_slim(path)
    weights = {k: lazy[f] for k, f in mapping.items()}
    dtype = dtype or next(iter(weights.values())).dtype
    unet = load_diffusers_unet(weights, cfg, dtype=dtype, device=device, norm_groups=meta.get("sdslim.norm_groups"))
    return unet.eval(), cfg, meta


def load_gguf_unet(path, dtype: torch.dtype = torch.float32, device="cpu"):
    """A diffusers ``UNet2DConditionModel`` holding a GGUF UNet (slim or full size) as the gguf package dequantises
    it: (unet, full-size cfg, sdslim metadata)."""
    weights, cfg, meta = gguf.read_unet(path)
    unet = load_diffusers_unet(weights, cfg, dtype=dtype, device=device, norm_groups=meta.get("sdslim.norm_groups"))
    return unet.eval(), cfg, meta


def apply_slim_state_dict(ldm_unet: nn.Module, path) -> dict:
    """Resize the site layers of an LDM ``UNetModel`` (in place) to a slim checkpoint's shapes and load it.

    Every UNet tensor of the file is loaded (strict: the model must be the full-size original of the file's
    architecture or an earlier slim load of it); layers keep their class, dtype and device. Returns the sdslim
    metadata.
    """
    lazy, mapping, _, _, cfg, meta = read_slim(path)
    if not hasattr(ldm_unet, "input_blocks"):
        raise FileFormatError(f"{type(ldm_unet).__name__} is not an LDM UNetModel (no input_blocks)")
    own = dict(ldm_unet.state_dict())
    missing = sorted(set(own) - set(mapping))
    extra = sorted(set(mapping) - set(own))
    if missing or extra:
        raise FileFormatError(f"{path}: does not match this UNet: missing {missing[:3]}, unexpected {extra[:3]} "
                              "(another architecture?)")
    groups = meta.get("sdslim.norm_groups") or {}
    norm2 = layout.RES_LAYERS["ldm"]["norm2"]
    shapes = {k: tuple(lazy.entries[f][1]) for k, f in mapping.items()}
    for name, module in list(ldm_unet.named_modules()):
        w = shapes.get(f"{name}.weight")
        if w is None or not hasattr(module, "weight") or tuple(module.weight.shape) == w:
            continue
        site = name[:-len(norm2) - 1] if name.endswith("." + norm2) else None
        try:
            new = resize_like(module, w, groups=groups.get(site) if site else None)
        except LayerError as err:
            raise FileFormatError(str(err)) from None
        set_module(ldm_unet, name, new)
    own = ldm_unet.state_dict()
    with torch.no_grad():
        for k, f in mapping.items():
            own[k].copy_(lazy[f].to(own[k].dtype))
    return meta
