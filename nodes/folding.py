"""Slim UNet inside ComfyUI: fold adapters into the LoRA-merged weights of a MODEL, on a new model.

The merged weight of each touched key comes from the incoming patcher's own patches
(``get_key_patches`` + ``comfy.lora.calculate_weight``), so every LoRA/LyCORIS form ComfyUI supports is
folded exactly. The result is a new BaseModel and a new ModelPatcher; untouched weights are shared (new
Parameter objects over the same storage) with their patches carried over, and the incoming MODEL is never
mutated. Replacement layers are built from the classes of the layers they replace (``comfy.ops``), so lowvram
partial loading and manual casting keep working; ResBlocks and transformer blocks stay in place, only their
inner layers change.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import uuid

import torch

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.utils

from sdslim_core import adapters, fold, layout

from . import monitor

PREFIX = "diffusion_model."
_STORE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
log = logging.getLogger("sdslim")


class SlimError(ValueError):
    """The MODEL or the adapter file cannot be slimmed; the message says which key and why."""


@dataclasses.dataclass(frozen=True)
class SlimInfo:
    """What a slim model remembers about its origin (read by the report/breakdown nodes and the LoRA check)."""
    family: str
    adapters: str                      # source file of the adapter set
    ranks: dict                        # site -> rank
    full_shapes: dict                  # canonical key -> shape of the original (full) model
    slim_keys: frozenset               # canonical keys whose shape changed


def check_weights(kp: dict) -> None:
    """Refuse weights that cannot be read as plain floating-point tensors (GGUF-quantised, int8, …)."""
    for key, entry in kp.items():
        w = entry[0][0]
        if type(w) not in (torch.Tensor, torch.nn.Parameter) or not torch.is_floating_point(w):
            kind = type(w).__name__ if type(w) not in (torch.Tensor, torch.nn.Parameter) else str(w.dtype)
            raise SlimError(f"sdslim: weight '{key}' is a {kind} (quantised, e.g. GGUF); Slim UNet folds plain "
                            "fp32/fp16/bf16/fp8 weights only: load the model from its .safetensors/.ckpt file instead")


def merged_getter(kp: dict, device: torch.device, used: set):
    """``get(canonical_key)`` → weight with the patcher's patches merged, in float32 (float64 for float64 weights);
    None if the key is absent."""
    def get(ckey: str):
        key = PREFIX + ckey
        if key not in kp:
            return None
        (w, convert), patches = kp[key][0], kp[key][1:]
        used.add(ckey)
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        t = comfy.model_management.cast_to_device(w, device, dtype, copy=True)
        t = convert(t, inplace=True)
        if patches:
            t = comfy.lora.calculate_weight(patches, t, key, intermediate_dtype=dtype)
        return t
    return get


def _store_dtype(orig: torch.dtype, base) -> torch.dtype:
    if orig in _STORE_DTYPES:
        return orig
    return getattr(base, "manual_cast_dtype", None) or torch.float16


def _new_layer(old: torch.nn.Module, shape: tuple, dtype: torch.dtype, plain_dtype: bool,
               groups: int | None = None) -> torch.nn.Module:
    """A layer like ``old`` (same comfy.ops class when its weights are plain) with a new weight shape, on meta;
    ``groups`` sets a GroupNorm's group count."""
    ops = comfy.ops.disable_weight_init if plain_dtype else comfy.ops.manual_cast
    has_bias = getattr(old, "bias", None) is not None
    if isinstance(old, torch.nn.GroupNorm):
        cls = type(old) if plain_dtype else ops.GroupNorm
        new = cls(groups or old.num_groups, shape[0], eps=old.eps, affine=old.affine, device="meta", dtype=dtype)
    elif isinstance(old, torch.nn.Linear):
        cls = type(old) if plain_dtype else ops.Linear
        new = cls(shape[1], shape[0], bias=has_bias, device="meta", dtype=dtype)
    elif isinstance(old, torch.nn.Conv2d):
        cls = type(old) if plain_dtype else ops.Conv2d
        new = cls(shape[1], shape[0], old.kernel_size, stride=old.stride, padding=old.padding,
                  dilation=old.dilation, groups=old.groups, bias=has_bias, padding_mode=old.padding_mode,
                  device="meta", dtype=dtype)
    else:
        raise SlimError(f"sdslim: cannot rebuild layer of type {type(old).__name__} (expected Linear/Conv2d/GroupNorm)")
    if not hasattr(new, "comfy_cast_weights"):
        raise SlimError(f"sdslim: layer class {type(new).__name__} is not a comfy.ops layer")
    return new


def _meta_skeleton(unet: torch.nn.Module) -> torch.nn.Module:
    """Deep copy of the module tree with every tensor on the meta device and lowvram state wiped."""
    memo = {}
    for t in list(unet.parameters()) + list(unet.buffers()):
        memo[id(t)] = (torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False)
                       if isinstance(t, torch.nn.Parameter) else torch.empty_like(t, device="meta"))
    for m in unet.modules():
        for attr in ("weight_function", "bias_function"):
            if attr in m.__dict__:
                memo[id(m.__dict__[attr])] = []
    skeleton = copy.deepcopy(unet, memo)
    for m in skeleton.modules():
        comfy.model_patcher.wipe_lowvram_weight(m)
        if hasattr(m, "comfy_patched_weights"):
            del m.comfy_patched_weights
    return skeleton


def _new_base_model(base, skeleton):
    """A new BaseModel sharing nothing mutable with ``base``; its UNet is ``skeleton``."""
    new = copy.copy(base)
    for attr in ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks"):
        if attr in base.__dict__:
            new.__dict__[attr] = type(base.__dict__[attr])(base.__dict__[attr])
    for name, module in base.named_children():
        if name != "diffusion_model":
            setattr(new, name, copy.deepcopy(module))
    new.diffusion_model = skeleton
    new.model_loaded_weight_memory = 0
    new.lowvram_patch_counter = 0
    new.model_lowvram = False
    new.current_weight_patches_uuid = None
    if hasattr(base, "current_patcher"):
        new.current_patcher = None
    return new


def _carry_patcher_state(src, dst, dropped_keys: set):
    """Copy model options, wrappers, callbacks, attachments, object/hook patches from ``src`` to ``dst``."""
    dst.model_options = comfy.model_patcher.create_model_options_clone(src.model_options)
    dst.force_cast_weights = getattr(src, "force_cast_weights", False)
    if hasattr(src, "weight_wrapper_patches"):
        dst.weight_wrapper_patches = dict(src.weight_wrapper_patches)
    dst.object_patches = {}
    for name, obj in src.object_patches.items():
        path = name[len(PREFIX):] if name.startswith(PREFIX) else None
        if path is not None and any(k.startswith(path + ".") for k in dropped_keys):
            log.warning("sdslim: object patch '%s' replaces a slimmed layer and is not carried over", name)
            continue
        dst.object_patches[name] = obj
    dst.attachments = {k: (a.on_model_patcher_clone() if hasattr(a, "on_model_patcher_clone") else a)
                       for k, a in getattr(src, "attachments", {}).items()}
    dst.additional_models = {k: [m.clone() for m in ms] for k, ms in getattr(src, "additional_models", {}).items()}
    dst.callbacks = {k: {k1: list(c1) for k1, c1 in c.items()} for k, c in src.callbacks.items()}
    dst.wrappers = {k: {k1: list(w1) for k1, w1 in w.items()} for k, w in src.wrappers.items()}
    if hasattr(src, "injections"):
        dst.injections = {k: list(i) for k, i in src.injections.items()}
    if getattr(src, "hook_patches", None):
        carried = {}
        for hook_ref, per_key in src.hook_patches.items():
            keep = {}
            for key, patches in per_key.items():
                if key.startswith(PREFIX) and key[len(PREFIX):] in dropped_keys:
                    log.warning("sdslim: hook weight patch on slimmed key '%s' cannot apply and is dropped", key)
                else:
                    keep[key] = list(patches)
            carried[hook_ref] = keep
        dst.hook_patches = carried
    if hasattr(src, "hook_mode"):
        dst.hook_mode = src.hook_mode


def slim_patcher(model, aset: "adapters.AdapterSet", progress=None):
    """Return a new ModelPatcher whose UNet has ``aset`` folded into ``model``'s LoRA-merged weights.

    ``progress(done, total)`` is called after each site. Raises SlimError / AdapterError with the key or site
    at fault. ``model`` and its BaseModel are not modified.
    """
    base = model.model
    unet = getattr(base, "diffusion_model", None)
    if unet is None:
        raise SlimError("sdslim: this MODEL has no 'diffusion_model' (not a UNet model)")
    kp = model.get_key_patches(PREFIX)
    check_weights(kp)
    shapes = {k[len(PREFIX):]: tuple(v[0][0].shape) for k, v in kp.items()}
    try:
        family = layout.config_from_state_dict(shapes).family
    except layout.LayoutError as err:
        raise SlimError(f"sdslim: the MODEL is not an SD1.x/SD2.x/SDXL UNet: {err}") from None
    aset.check_model(shapes, family)

    device = model.load_device if getattr(model.load_device, "type", "cpu") == "cuda" else torch.device("cpu")
    used: set = set()
    get = merged_getter(kp, device, used)
    folded: dict = {}
    sites = list(aset.sites)
    for i, site in enumerate(sites):
        comfy.model_management.throw_exception_if_processing_interrupted()
        for key, t in fold.fold_site(site, aset.kind(site), get, aset.sites[site]).items():
            store = _store_dtype(kp[PREFIX + key][0][0].dtype, base)
            folded[key] = t.to(device=model.offload_device, dtype=store)
        if progress is not None:
            progress(i + 1, len(sites))
    for key in folded:
        if key not in used and len(kp[PREFIX + key]) > 1:
            log.warning("sdslim: %d patch(es) on '%s' (norm2 of a slimmed ResBlock) cannot survive the fold and "
                        "are dropped", len(kp[PREFIX + key]) - 1, PREFIX + key)

    skeleton = _meta_skeleton(unet)
    slim_keys = {k for k, t in folded.items() if tuple(t.shape) != shapes[k]}
    groups = {f"{s}.{layout.RES_LAYERS['ldm']['norm2']}": aset.groups(s) for s in sites if aset.kind(s) == "res"}
    rebuild = {k.rsplit(".", 1)[0] for k in slim_keys}
    rebuild |= {p for p, g in groups.items() if comfy.utils.get_attr(skeleton, p).num_groups != g}
    for path in sorted(rebuild):
        weight = folded[path + ".weight"]
        plain = kp[PREFIX + path + ".weight"][0][0].dtype in _STORE_DTYPES
        layer = _new_layer(comfy.utils.get_attr(skeleton, path), tuple(weight.shape), weight.dtype, plain,
                           groups.get(path))
        comfy.utils.set_attr(skeleton, path, layer)

    state = {}
    for ckey in shapes:
        if ckey in folded:
            state[ckey] = folded[ckey]
        else:
            state[ckey] = kp[PREFIX + ckey][0][0].detach().to(model.offload_device)
    skeleton.load_state_dict(state, strict=True, assign=True)

    new_base = _new_base_model(base, skeleton)
    new_base.sdslim_info = SlimInfo(family=family, adapters=aset.source, ranks=aset.ranks(), full_shapes=shapes,
                                    slim_keys=frozenset(slim_keys))
    out = comfy.model_patcher.ModelPatcher(new_base, load_device=model.load_device,
                                           offload_device=model.offload_device)
    _carry_patcher_state(model, out, set(folded))
    for ckey in shapes:
        if ckey not in folded and len(kp[PREFIX + ckey]) > 1:
            out.patches[PREFIX + ckey] = list(kp[PREFIX + ckey][1:])
    out.patches_uuid = uuid.uuid4()
    monitor.install(out)
    return out
