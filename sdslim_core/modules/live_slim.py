"""Slimming a live LDM UNet in place, and giving the original layers back (hosts like AUTOMATIC1111).

A host that owns its module tree (other code holds references to the UNet and its blocks) cannot replace the
whole UNet. :class:`LiveSlim` swaps only the layers a fold changes (GEGLU ``proj``/``out``, ResBlock
``conv1``/``emb``/``norm2``/``conv2``) for fresh slim layers built by :func:`swap.build_slim_module`, keeps the
originals (optionally on the CPU) and puts the very same objects back on :meth:`LiveSlim.restore`. The fold reads
each layer's weights through the host's ``read(layer)`` (e.g. its unmerged weights), or after the host's
``merge(layer)`` (so lazily merged LoRA weights are what gets folded) and then its ``unmerge(layer)`` where the host
keeps its layers unmerged (a LoRA added in the forward). LoRAs can instead be put on the installed slim layers in
slim space (:meth:`LiveSlim.apply_loras`): their deltas are converted (:mod:`sdslim_core.ops.lora_slim`) and added to
the folded weights, kept pristine on the CPU meanwhile, so a LoRA or strength change costs no fold. Folded layers
are cached by a host-chosen key, always pristine. Loading a state dict into the UNet restores first (a load into
slim shapes would fail) and drops the cache (the folds were made from the old weights).
Pure torch: no webui import.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable, Hashable

import torch
from torch import nn

from . import swap
from .. import layout
from ..io.adapters import AdapterSet
from ..ops import fingerprint, fold
from ..ops.fingerprint import Distance
from ..ops.lora import apply_deltas, module_parts
from ..ops.lora_slim import SlimSpace
from .layers import LayerError, resize_like


class SwapError(RuntimeError):
    """Slimming failed; the UNet was left with its original layers. The message says why."""


@dataclass
class SwapReport:
    """What one :meth:`LiveSlim.apply` did."""
    sites: int
    layers: int
    bytes_before: int      # parameter bytes of the replaced original layers
    bytes_after: int       # parameter bytes of the slim layers
    cached: bool           # the folded layers came from the cache (no fold was computed)
    seconds: float
    distance: Distance | None = None   # of the folded weights from the adapters' base (None: no base fingerprint)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after


@dataclass
class LoraReport:
    """What one :meth:`LiveSlim.apply_loras` did."""
    modules: int           # LoRA modules on the slim layers
    tensors: int           # slim weights and biases they change
    forms: dict            # form (low-rank / dense / dropped) → modules
    cached: bool           # these deltas were on the layers already (nothing computed)
    seconds: float


def param_bytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition(".")
    return parent, name


def _meta_like(layer: nn.Module) -> nn.Module:
    """A weightless stand-in with the hyper-parameters :func:`swap.build_slim_module` reads (no host attributes,
    so cloning it copies neither LoRA backups nor hooks)."""
    try:
        return resize_like(layer, ops=nn, device="meta", dtype=torch.get_default_dtype())
    except LayerError as err:
        raise SwapError(str(err)) from None


def _skeleton(layers: dict[str, nn.Module]) -> nn.Module:
    """An LDM-shaped tree holding weightless copies of ``layers`` at their paths."""
    root = nn.Module()
    root.add_module("input_blocks", nn.Module())  # marks the tree as LDM-named for swap.tree_naming
    for path, layer in layers.items():
        node = root
        *parents, name = path.split(".")
        for part in parents:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        node.add_module(name, _meta_like(layer))
    return root


def _read(layer: nn.Module, path: str, merge, unmerge, read) -> dict[str, torch.Tensor]:
    """``layer``'s own parameters by full name: ``read(layer)`` when given; else after ``merge(layer)``, copies and
    then ``unmerge(layer)``, if given."""
    if read is not None:
        return {f"{path}.{n}": t for n, t in read(layer).items()}
    try:
        if merge is not None:
            merge(layer)
        return {f"{path}.{n}": t.detach().clone() if unmerge is not None else t.detach()
                for n, t in layer.named_parameters(recurse=False)}
    finally:
        if unmerge is not None:
            unmerge(layer)


class LiveSlim:
    """Slim layers installed into one live LDM UNet (``input_blocks``/``middle_block``/``output_blocks``)."""

    def __init__(self, unet: nn.Module, max_cached: int = 2):
        if swap.tree_naming(unet) != "ldm":
            raise SwapError(f"{type(unet).__name__}: only LDM/sgm UNetModel trees can be slimmed in place")
        self.unet = unet
        self.max_cached = max_cached
        self.key: Hashable | None = None             # key of the installed slim layers, None when original
        self.report: SwapReport | None = None        # report of the installed slim layers
        self._originals: dict[str, nn.Module] = {}    # path -> original layer object, while slim
        self._offload = False
        self._cache: OrderedDict[Hashable, tuple[dict[str, nn.Module], SwapReport, SlimSpace]] = OrderedDict()
        self.space: SlimSpace | None = None           # the installed fold's maps (LoRAs in slim space)
        self.lora_key: Hashable | None = None         # key of the LoRA deltas on the slim layers, None when pristine
        self.lora_report: LoraReport | None = None
        self._pristine: dict[tuple[str, str], torch.Tensor] = {}   # (path, param) → folded value, on the CPU
        if hasattr(unet, "register_load_state_dict_pre_hook"):      # public from torch 2.5
            self._hook = unet.register_load_state_dict_pre_hook(self._before_load)
        else:                                                        # torch 2.1 (webui 1.10's default)
            self._hook = unet._register_load_state_dict_pre_hook(self._before_load, with_module=True)

    # ----------------------------------------------------------------------------------------- queries
    @property
    def installed(self) -> bool:
        return self.key is not None

    @property
    def offloaded(self) -> bool:
        """The replaced original layers are on the CPU."""
        return self.installed and self._offload

    @property
    def replaced(self) -> list[str]:
        """Module paths that hold slim layers now."""
        return list(self._originals)

    def original(self, path: str) -> nn.Module:
        """The original layer at ``path``, also while a slim layer is installed there."""
        return self._originals[path] if path in self._originals else self.unet.get_submodule(path)

    def layer_paths(self, adapter_set: AdapterSet) -> dict[str, str]:
        """Module path → role of every layer the fold of ``adapter_set`` reads or replaces."""
        out = {}
        for site in adapter_set.sites:
            for role, path in swap.layer_paths(self.unet, site, adapter_set.kind(site)).items():
                out[path] = role
        return out

    def check(self, adapter_set: AdapterSet):
        """Raise :class:`~sdslim_core.io.adapters.AdapterError` unless the adapters fit this UNet."""
        shapes = {k: tuple(v.shape) for k, v in self.unet.state_dict(keep_vars=True).items()}
        canon, _, _ = layout.to_canonical(shapes)
        adapter_set.check_model(canon, layout.config_from_state_dict(canon).family)

    # ------------------------------------------------------------------------------------------ actions
    def apply(self, key: Hashable, adapter_set: AdapterSet, merge: Callable[[nn.Module], None] | None = None,
              offload: bool = False, compute_device: torch.device | str | None = None,
              unmerge: Callable[[nn.Module], None] | None = None,
              read: Callable[[nn.Module], dict] | None = None) -> SwapReport:
        """Install the slim layers for ``key`` (folding ``adapter_set`` unless cached); no-op if installed.

        ``read(layer)`` gives each original layer's weights to fold ({param name: tensor}, e.g. the host's
        unmerged ones); without it, ``merge(layer)`` is called on each original layer before its weights are read
        (the host's lazy LoRA merge) and ``unmerge(layer)`` right after they are read (copied), also when reading
        fails, to put the layer back as the host keeps it. ``offload`` moves the replaced originals to the CPU
        while slim. ``compute_device`` is where the fold runs (default: where each layer lives). On any error the
        original layers are back in place and :class:`SwapError` says why. A changed ``offload`` re-installs the
        cached layers. The report says ``cached`` whenever no fold was computed (installed already, or from the
        cache). The installed layers carry no LoRA delta until :meth:`apply_loras`.
        """
        if self.key == key and self._offload == offload:
            self.report = replace(self.report, cached=True, seconds=0.0)
            return self.report
        self.restore()
        t0 = time.perf_counter()
        try:
            cached = self._cache.pop(key, None)
            if cached is None:
                layers, report, space = self._fold(adapter_set, merge, unmerge, compute_device, read)
            else:
                layers, report, space = cached
                report = replace(report, cached=True)
            self._install(layers, offload)
        except Exception as err:
            self.restore()
            if isinstance(err, SwapError):
                raise
            if isinstance(err, (ValueError, OSError)):     # a file or input that cannot be used: its message says why
                raise SwapError(str(err)) from err
            raise SwapError(f"{type(err).__name__}: {err}") from err
        report.seconds = time.perf_counter() - t0
        self.key, self.report, self.space = key, report, space
        self._cache[key] = (layers, report, space)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return report

    def apply_loras(self, key: Hashable, modules, compute_device: torch.device | str | None = None) -> LoraReport:
        """Give the installed slim layers the LoRA deltas of ``modules`` [(module made for the original layers,
        weight strength, bias strength)], converted into slim space: W' = fold(W) + Σ s·ΔW' in float32 or wider
        (the exact fold(W + Σ s·ΔW)); no-op when ``key`` is on them already, and an empty list gives back the
        pristine folded values. ``compute_device``: where the sums run (default: where each layer lives). Modules
        on norm2 are dropped (the fold replaces it); DoRA on a folded layer raises LoraError (fold it in instead)
        before anything changes. The originals are not touched."""
        if not self.installed:
            raise SwapError("no slim layers are installed")
        if self.lora_key == key:
            self.lora_report = replace(self.lora_report, cached=True, seconds=0.0)
            return self.lora_report
        t0 = time.perf_counter()
        modules = list(modules)
        forms: dict[str, int] = {}
        for mod, _, _ in modules:                           # refusals first: nothing changes on an error
            form = self.space.form(mod)
            forms[form] = forms.get(form, 0) + 1
        plan: dict[tuple[str, str], list] = {}
        for mod, weight_strength, bias_strength in modules:
            for part in module_parts(mod):
                strength = weight_strength if part == "weight" else bias_strength
                for dest, new in self.space.convert_part(mod, part).items():
                    plan.setdefault((new.target, dest), []).append((new, strength, dest))
        self._reset_loras()
        with torch.no_grad():
            for (path, name), entries in plan.items():
                param = getattr(self.unet.get_submodule(path), name)
                if param is None:
                    raise SwapError(f"{path} has no {name} for a LoRA delta to go to")
                dev = torch.device(compute_device) if compute_device is not None else param.device
                pristine = self._pristine.setdefault((path, name), param.detach().to("cpu", copy=True))
                param.copy_(apply_deltas(pristine.to(dev), entries, out_dtype=param.dtype))   # the LoRAs follow
        self.lora_key = key
        self.lora_report = LoraReport(len(modules), len(plan), forms, False, time.perf_counter() - t0)
        return self.lora_report

    def restore(self):
        """Put the original layer objects back (on the device the slim layers were on); no-op if original."""
        self._reset_loras()
        for path, orig in self._originals.items():
            parent, name = _split(path)
            owner = self.unet.get_submodule(parent)
            current = owner._modules[name]
            orig.to(_device(current))
            owner._modules[name] = orig
            if self._offload:
                current.to("cpu")
        self._originals.clear()
        self.key, self.report, self.space = None, None, None

    def _reset_loras(self):
        """The pristine folded values back on the slim layers (they are cached that way)."""
        with torch.no_grad():
            for (path, name), value in self._pristine.items():
                getattr(self.unet.get_submodule(path), name).copy_(value)
        self._pristine.clear()
        self.lora_key, self.lora_report = None, None

    def close(self):
        """Restore, drop the cache and detach from the UNet."""
        self.restore()
        self._cache.clear()
        self._hook.remove()

    # ---------------------------------------------------------------------------------------- internals
    def _fold(self, adapter_set: AdapterSet, merge, unmerge, compute_device, read):
        self.check(adapter_set)
        paths = self.layer_paths(adapter_set)
        originals = {p: self.unet.get_submodule(p) for p in paths}
        folded, full_shapes = {}, {}
        try:
            meter = fingerprint.DistanceMeter(adapter_set.metadata.get("sdslim.base") or {})
        except fingerprint.FingerprintError:
            meter = None
        with torch.no_grad():
            for site in adapter_set.sites:     # one site at a time: only its weights visit compute_device
                weights = {}
                for path, layer in originals.items():
                    if path.startswith(site + "."):
                        weights.update(_read(layer, path, merge, unmerge, read))
                full_shapes.update({k: tuple(v.shape) for k, v in weights.items()})
                for k, v in weights.items() if meter is not None else ():
                    meter.add(site, k, v)
                home = next(iter(weights.values())).device
                dev = torch.device(compute_device) if compute_device is not None else home
                out = fold.fold_state_dict({k: v.to(dev) for k, v in weights.items()}, adapter_set, sites=[site])
                folded.update({k: v.to(home) for k, v in out.items()})
        norms = [m for p, m in originals.items() if paths[p] == "norm2"]
        norm_cls = type(norms[0]) if norms else nn.GroupNorm
        ops = SimpleNamespace(Linear=nn.Linear, Conv2d=nn.Conv2d, GroupNorm=norm_cls)
        skeleton = _skeleton(originals)
        slim = swap.build_slim_module(skeleton, adapter_set, folded, ops=ops)
        layers = {}
        for path in originals:
            new = slim.get_submodule(path)
            if new.weight.device.type != "meta":   # meta: a layer the fold reads but does not replace
                layers[path] = new
        before = sum(param_bytes(originals[p]) for p in layers)
        after = sum(param_bytes(m) for m in layers.values())
        space = SlimSpace(adapter_set, full_shapes)
        return layers, SwapReport(len(adapter_set.sites), len(layers), before, after, False, 0.0,
                                  meter.result() if meter is not None else None), space

    def _install(self, layers: dict[str, nn.Module], offload: bool):
        self._offload = offload
        for path, new in layers.items():
            parent, name = _split(path)
            owner = self.unet.get_submodule(parent)
            orig = owner._modules[name]
            if isinstance(orig, nn.Conv2d):     # tiling (circular padding) may have changed since the fold
                new.padding_mode = orig.padding_mode
            new.to(_device(orig))
            self._originals[path] = orig
            owner._modules[name] = new
            if offload:
                orig.to("cpu")

    def _before_load(self, *args, **kwargs):
        """load_state_dict pre-hook: the host is loading new weights; give it the original shapes."""
        self.restore()
        self._cache.clear()
