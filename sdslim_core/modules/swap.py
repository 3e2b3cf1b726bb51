"""Swapping sites inside a UNet module tree (LDM-style or diffusers), never mutating the input tree.

Two forms of the same computation:
- train-time: the original layers wrapped with trainable bottleneck adapters (:func:`attach_train_adapters`,
  one site: :func:`train_site`), the adapters on the device of the layers they wrap;
- slim: fresh, smaller layers holding the folded weights (:func:`build_slim_module`).
Both are built on a structural clone that shares every untouched parameter and buffer with the input.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .. import layout
from ..io.adapters import AdapterSet
from ..ops import fold
from . import offload
from .layers import resize_like, set_module

TORCH_OPS = SimpleNamespace(Linear=nn.Linear, Conv2d=nn.Conv2d, GroupNorm=nn.GroupNorm)


# ------------------------------------------------------------------------------------------ tree navigation

def tree_naming(unet: nn.Module) -> str:
    """``ldm`` for LDM/sgm/ComfyUI UNetModel trees, ``diffusers`` for UNet2DConditionModel/ControlNet trees."""
    if hasattr(unet, "input_blocks"):
        return "ldm"
    if hasattr(unet, "down_blocks"):
        return "diffusers"
    raise layout.LayoutError(f"{type(unet).__name__} is neither an LDM UNetModel nor a diffusers UNet")


def tree_config(unet: nn.Module) -> layout.UNetConfig:
    """The :class:`UNetConfig` of a module tree, read from its parameter shapes."""
    shapes = {k: tuple(v.shape) for k, v in unet.state_dict(keep_vars=True).items()}
    canon, _, _ = layout.to_canonical(shapes)
    return layout.config_from_state_dict(canon)


def site_path(unet: nn.Module, site: str, cfg: layout.UNetConfig | None = None) -> str:
    """The module path of a canonical site inside ``unet``."""
    if tree_naming(unet) == "ldm":
        return site
    return layout.canonical_to_diffusers_key(cfg or tree_config(unet), site)


def layer_paths(unet: nn.Module, site: str, kind: str, cfg=None) -> dict[str, str]:
    """Role → module path of a site's layers (``proj``/``out`` or ``conv1``/``emb``/``norm2``/``conv2``)."""
    base = site_path(unet, site, cfg)
    names = layout.FF_LAYERS if kind == "ff" else layout.RES_LAYERS[tree_naming(unet)]
    return {role: f"{base}.{name}" for role, name in names.items()}


def clone_sharing(unet: nn.Module) -> nn.Module:
    """A structural copy of ``unet`` whose parameters and buffers are the same objects (no weight copy)."""
    memo = {id(t): t for t in list(unet.parameters()) + list(unet.buffers())}
    return copy.deepcopy(unet, memo)


# --------------------------------------------------------------------------------------- train-time modules

class SiteAdapter(nn.Module):
    """Trainable tensors of one site, in the adapter-file layout (shared by the wrappers of that site), on
    ``device`` (default: where ``tensors`` are); :func:`wrap_site` puts them on the device of the layers they wrap."""

    def __init__(self, site: str, kind: str, tensors: Mapping[str, torch.Tensor], groups: int, eps: float = 1e-5,
                 device: torch.device | str | None = None):
        super().__init__()
        self.site, self.kind = site, kind
        dtype = torch.promote_types(tensors["up"].dtype, torch.float32)

        def param(name):
            return nn.Parameter(tensors[name].detach().to(device=device, dtype=dtype, copy=True))
        if kind == "ff":
            self.down_value, self.down_gate = param("down_value"), param("down_gate")
            self.up_bias = param("up_bias") if "up_bias" in tensors else None
        else:
            self.down = param("down")
            self.norm = nn.GroupNorm(groups, self.down.shape[0], eps=eps, dtype=dtype, device=self.down.device)
            self.norm.weight, self.norm.bias = param("norm.weight"), param("norm.bias")
        self.up = param("up")

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.kind == "ff":
            names = {"down_value": self.down_value, "down_gate": self.down_gate, "up": self.up}
            if self.up_bias is not None:
                names["up_bias"] = self.up_bias
        else:
            names = {"down": self.down, "norm.weight": self.norm.weight, "norm.bias": self.norm.bias,
                     "up": self.up}
        return {k: v.detach().float().cpu().clone() for k, v in names.items()}


class FFDown(nn.Module):
    """GEGLU projection followed by the value/gate bottlenecks: [A_v(W_v x + b_v); A_g(W_g x + b_g)]."""

    def __init__(self, proj: nn.Module, adapter: SiteAdapter):
        super().__init__()
        self.proj, self.adapter = proj, adapter

    def forward(self, x):
        value, gate = self.proj(x).chunk(2, dim=-1)
        a = self.adapter
        return torch.cat([F.linear(value, a.down_value.to(value.dtype)),
                          F.linear(gate, a.down_gate.to(gate.dtype))], dim=-1)


class FFUp(nn.Module):
    """The bottleneck expansion U (with the optional intercept c) followed by the original output layer."""

    def __init__(self, out: nn.Module, adapter: SiteAdapter):
        super().__init__()
        self.out, self.adapter = out, adapter

    def forward(self, h):
        a = self.adapter
        return self.out(F.linear(h, a.up.to(h.dtype), None if a.up_bias is None else a.up_bias.to(h.dtype)))


class ResDown(nn.Module):
    """conv1 (or the time-embedding layer) followed by the channel reduction D (shared by both paths)."""

    def __init__(self, layer: nn.Module, adapter: SiteAdapter, spatial: bool):
        super().__init__()
        self.layer, self.adapter, self.spatial = layer, adapter, spatial

    def forward(self, x):
        y = self.layer(x)
        d = self.adapter.down.to(y.dtype)
        return torch.einsum("rc,bc...->br...", d, y) if self.spatial else F.linear(y, d)


class ResNorm(nn.Module):
    """The bottleneck GroupNorm (replaces norm2)."""

    def __init__(self, adapter: SiteAdapter):
        super().__init__()
        self.adapter = adapter

    def forward(self, h):
        n = self.adapter.norm
        return F.group_norm(h, n.num_groups, n.weight.to(h.dtype), n.bias.to(h.dtype), n.eps)


class ResUp(nn.Module):
    """The channel expansion U (no bias: a bias would not pass a zero-padded conv) followed by conv2."""

    def __init__(self, conv2: nn.Module, adapter: SiteAdapter):
        super().__init__()
        self.conv2, self.adapter = conv2, adapter

    def forward(self, h):
        return self.conv2(torch.einsum("cr,br...->bc...", self.adapter.up.to(h.dtype), h))


def layer_device(module: nn.Module) -> torch.device:
    """The device a layer computes on: its tensors' (the CPU for a layer without any), or the device an offloaded
    layer's tensors are copied to."""
    dev = offload.target(module)
    if dev is not None:
        return dev
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")


def wrap_site(site_module: nn.Module, site: str, kind: str, naming: str, tensors: Mapping[str, torch.Tensor],
              groups: int = 0) -> SiteAdapter:
    """Wrap the layers of ``site_module`` (a FeedForward or ResBlock, ``naming`` ``ldm`` or ``diffusers``) in place
    with the train-time adapter of ``tensors``, made on the device of the layers it wraps; returns the adapter."""
    names = layout.FF_LAYERS if kind == "ff" else layout.RES_LAYERS[naming]
    layer = site_module.get_submodule

    def put(role, new):
        set_module(site_module, names[role], new)
    if kind == "ff":
        a = SiteAdapter(site, kind, tensors, 0, device=layer_device(layer(names["proj"])))
        put("proj", FFDown(layer(names["proj"]), a))
        put("out", FFUp(layer(names["out"]), a))
        return a
    a = SiteAdapter(site, kind, tensors, groups, eps=layer(names["norm2"]).eps,
                    device=layer_device(layer(names["conv1"])))
    put("conv1", ResDown(layer(names["conv1"]), a, spatial=True))
    put("emb", ResDown(layer(names["emb"]), a, spatial=False))
    put("norm2", ResNorm(a))
    put("conv2", ResUp(layer(names["conv2"]), a))
    return a


def train_site(site_module: nn.Module, site: str, kind: str, naming: str, tensors: Mapping[str, torch.Tensor],
               groups: int = 0) -> tuple[nn.Module, SiteAdapter]:
    """One site in train-time form: a structural clone of ``site_module`` (its layers shared) wrapped by
    :func:`wrap_site`; returns (module, adapter). The same computation :func:`attach_train_adapters` inserts."""
    out = clone_sharing(site_module)
    return out, wrap_site(out, site, kind, naming, tensors, groups)


def attach_train_adapters(unet: nn.Module, adapter_set: AdapterSet) -> tuple[nn.Module, dict[str, SiteAdapter]]:
    """A clone of ``unet`` with the train-time adapters of ``adapter_set`` inserted; returns (module, adapters).

    The original layers are shared (and stay as they are); only adapter parameters are new, each on the device of
    the layers it wraps.
    """
    out = clone_sharing(unet)
    naming = tree_naming(unet)
    cfg = tree_config(unet) if naming == "diffusers" else None
    adapters = {}
    for site, tensors in adapter_set.sites.items():
        module = out.get_submodule(site_path(out, site, cfg))
        adapters[site] = wrap_site(module, site, adapter_set.kind(site), naming, tensors, adapter_set.groups(site))
    return out, adapters


# ------------------------------------------------------------------------------------------------ slim tree

def _holding(new: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """``new`` with ``weight`` and ``bias`` as its (frozen) parameters."""
    new.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        new.bias = nn.Parameter(bias, requires_grad=False)
    return new


def build_slim_module(unet: nn.Module, adapter_set: AdapterSet, folded: Mapping[str, torch.Tensor],
                      ops=TORCH_OPS) -> nn.Module:
    """A clone of ``unet`` whose sites hold the folded (slim) layers; untouched weights are shared.

    ``folded`` is :func:`sdslim_core.ops.fold.fold_state_dict`'s output (canonical keys); ``ops`` supplies
    ``Linear``/``Conv2d``/``GroupNorm`` classes (e.g. ``comfy.ops`` classes inside ComfyUI).
    """
    out = clone_sharing(unet)
    cfg = tree_config(unet) if tree_naming(unet) == "diffusers" else None
    ldm = layout.RES_LAYERS["ldm"]
    for site in adapter_set.sites:
        kind = adapter_set.kind(site)
        paths = layer_paths(out, site, kind, cfg)
        if kind == "ff":
            roles = {"proj": f"{site}.{layout.FF_LAYERS['proj']}", "out": f"{site}.{layout.FF_LAYERS['out']}"}
        else:
            roles = {r: f"{site}.{ldm[r]}" for r in ("conv1", "emb", "conv2")}
        for role, canon in roles.items():
            if canon + ".weight" not in folded:
                continue
            old = out.get_submodule(paths[role])
            w, b = folded[canon + ".weight"], folded.get(canon + ".bias")
            new = resize_like(old, w.shape, ops=ops, bias=b is not None, device=w.device, dtype=w.dtype)
            set_module(out, paths[role], _holding(new, w, b))
        if kind == "res":
            old = out.get_submodule(paths["norm2"])
            w, b = folded[f"{site}.{ldm['norm2']}.weight"], folded[f"{site}.{ldm['norm2']}.bias"]
            norm = resize_like(old, w.shape, ops=ops, groups=adapter_set.groups(site), device=w.device,
                               dtype=w.dtype)
            set_module(out, paths["norm2"], _holding(norm, w, b))
    return out


def slim_module(unet: nn.Module, adapter_set: AdapterSet, weights: Mapping[str, torch.Tensor] | None = None,
                ops=TORCH_OPS) -> nn.Module:
    """``unet`` slimmed by ``adapter_set`` in one call: canonical weights (default ``unet``'s own) folded
    (:func:`sdslim_core.ops.fold.fold_state_dict`) into :func:`build_slim_module`."""
    if weights is None:
        weights = layout.to_canonical(unet.state_dict())[0]
    return build_slim_module(unet, adapter_set, fold.fold_state_dict(weights, adapter_set), ops)


def slim_state_dict(slim_unet: nn.Module) -> dict[str, torch.Tensor]:
    """The slim module's state dict in canonical keys."""
    canon, _, _ = layout.to_canonical(slim_unet.state_dict())
    return canon
