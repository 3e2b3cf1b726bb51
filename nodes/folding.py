"""Slim UNet inside ComfyUI: fold adapters into the LoRA-merged weights of a MODEL, on a new model.

The merged weight of each touched key comes from the incoming patcher's own patches
(``get_key_patches`` + ``comfy.lora.calculate_weight``), so every LoRA/LyCORIS form ComfyUI supports is
folded exactly. The result is ``model.clone()`` pointed at a new BaseModel (a copy whose UNet has the folded
layers; untouched weights share storage with the input), so every patch, model option, wrapper, callback, hook
and attachment rides along by ComfyUI's own ``clone()``; only what was tied to the old UNet is dropped, by name.
The incoming MODEL is never mutated. Replacement layers are built from the classes of the layers they replace
(``comfy.ops``), so lowvram partial loading and manual casting keep working; ResBlocks and transformer blocks
stay in place, only their inner layers change.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import inspect
import logging
import uuid

import torch

import comfy.lora
import comfy.model_management
import comfy.ops
import comfy.utils

from sdslim_core import layout
from sdslim_core.io import adapters
from sdslim_core.modules.layers import LayerError, resize_like, set_module
from sdslim_core.ops import fingerprint, fold, lora_slim, quant

from . import monitor, patches
from .errors import SlimError

PREFIX = layout.COMFY_PREFIX
COMPILE_KEY, COMPILE_KWARGS = "torch.compile", "torch_compile_kwargs"   # comfy_api.torch_helpers' wrapper key
_STORE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
log = logging.getLogger("sdslim")


@dataclasses.dataclass(frozen=True)
class SlimInfo:
    """What a slim model remembers about its origin (read by the report/breakdown nodes and the LoRA check)."""
    family: str
    adapters: str                      # source file of the adapter set
    ranks: dict                        # site -> rank
    full_shapes: dict                  # canonical key -> shape of the original (full) model
    slim_keys: frozenset               # canonical keys whose shape changed
    space: object = None               # lora_slim.SlimSpace of the folded adapters (None: LoRAs cannot be converted)
    distance: object = None            # fingerprint.Distance of the folded weights from the adapters' base, if known
    record: dict = dataclasses.field(default_factory=dict)   # the sdslim.* metadata a saved file of it carries
    source_dtype: object = None        # the dtype its weights were stored in (a file's, or seen in them); None: unknown


GGUF_INSTEAD = ("Slim the model's original .safetensors and write it as GGUF once instead: `sdslim slim --ckpt "
                "model.safetensors --adapters ADAPTERS.safetensors --format gguf --quant Q4_0 --out "
                "models/unet/model-slim-Q4_0.gguf`, then load that with Load Slim GGUF (sdslim)")


def distance_meter(aset: "adapters.AdapterSet"):
    """A :class:`~sdslim_core.ops.fingerprint.DistanceMeter` against the adapter file's base fingerprint, or None
    when the file has none."""
    try:
        return fingerprint.DistanceMeter(aset.metadata.get("sdslim.base") or {})
    except fingerprint.FingerprintError:
        return None


def report_distance(d) -> None:
    """Say in the console how far the folded weights are from the adapters' base; warn past the measured threshold."""
    if d is None:
        return
    worst = ", ".join(f"{s} {v:.0%}" for s, v in d.worst())
    if d.far:
        log.warning("sdslim: this MODEL's folded weights are %s from the adapters' base (largest: %s); past %s "
                    "base adapters keep measurably less of a fine-tune or merge than adapters refitted on it (Train "
                    "Slim Adapters with 'start from adapters')", fingerprint.percent(d.overall), worst,
                    fingerprint.WARN_TEXT)
    else:
        log.info("sdslim: folded weights %s from the adapters' base (largest: %s)", fingerprint.percent(d.overall),
                 worst)


def check_gguf(unet: torch.nn.Module) -> None:
    """Refuse a GGUF model (ComfyUI-GGUF's weights carry a quantised ``tensor_type``), saying how to stack slim with
    GGUF instead."""
    for name, w in unet.named_parameters():
        qtype = getattr(w, "tensor_type", None)
        if qtype is not None and getattr(qtype, "name", str(qtype)) not in ("F32", "F16"):
            raise SlimError(f"sdslim: weight '{PREFIX}{name}' is GGUF-quantised ({getattr(qtype, 'name', qtype)}, a "
                            "ComfyUI-GGUF model). Slim UNet folds plain weights: folding dequantised GGUF weights "
                            "and quantising the folded layers again would stack two quantisation errors, and the "
                            "K-quants most GGUF files use have no quantiser outside llama.cpp. " + GGUF_INSTEAD)


def source_dtype(weights) -> torch.dtype | None:
    """The dtype a UNet's ``weights`` were stored in, as far as they tell: the dtype its matrices are held in when it
    takes 2 bytes or less (fp16/bf16, or fp8 when loaded as such), else the 16-bit dtype they are exact in (an fp16
    file loaded as float32 on a CPU), else None (unknown)."""
    mats = [w for w in weights if w.dim() >= 2 and w.is_floating_point()]
    if not mats:
        return None
    held = collections.Counter(w.dtype for w in mats).most_common(1)[0][0]
    return held if held.itemsize <= 2 else quant.exact_dtype(mats)


def check_weights(kp: dict) -> None:
    """Refuse weights that cannot be read as plain floating-point tensors (int8, raw blocks, …)."""
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


def _keeps_dtype(dtype: torch.dtype, base) -> bool:
    """Whether a folded layer keeps its weights' dtype: plain floats, and fp8 storage (slim stacked with fp8) unless
    the model is scaled-fp8, whose per-layer scales the fold does not recompute."""
    if dtype in _STORE_DTYPES:
        return True
    return dtype in _FP8_DTYPES and getattr(getattr(base, "model_config", None), "scaled_fp8", None) is None


def _store_dtype(orig: torch.dtype, base) -> torch.dtype:
    if _keeps_dtype(orig, base):
        return orig
    return getattr(base, "manual_cast_dtype", None) or torch.float16


def _new_layer(old: torch.nn.Module, shape: tuple, dtype: torch.dtype, plain_dtype: bool,
               groups: int | None = None) -> torch.nn.Module:
    """A layer like ``old`` (same comfy.ops class when it keeps its weights' dtype) with a new weight shape, on meta;
    ``groups`` sets a GroupNorm's group count."""
    try:
        new = resize_like(old, shape, ops=None if plain_dtype else comfy.ops.manual_cast, groups=groups,
                          device="meta", dtype=dtype)
    except LayerError as err:
        raise SlimError(f"sdslim: cannot rebuild layer: {err}") from None
    if not hasattr(new, "comfy_cast_weights"):
        raise SlimError(f"sdslim: layer class {type(new).__name__} is not a comfy.ops layer")
    return new


def replace_layers(skeleton: torch.nn.Module, weights: dict, slim_keys, groups: dict, plain) -> set:
    """Give ``skeleton`` (a UNet on meta) new layers, like the ones they replace, for the weights whose shape
    changed (``slim_keys``: canonical keys of ``weights``) and for the norm2 layers whose group count ``groups``
    (path → groups) changes; ``plain(path)``: whether that layer keeps its weights' dtype (else manual-cast ops).
    Returns the replaced module paths."""
    rebuild = {k.rsplit(".", 1)[0] for k in slim_keys}
    rebuild |= {p for p, g in groups.items() if comfy.utils.get_attr(skeleton, p).num_groups != g}
    for path in sorted(rebuild):
        weight = weights[path + ".weight"]
        layer = _new_layer(comfy.utils.get_attr(skeleton, path), tuple(weight.shape), weight.dtype, plain(path),
                           groups.get(path))
        set_module(skeleton, path, layer)
    return rebuild


def _meta_base_model(base) -> torch.nn.Module:
    """Deep copy of the BaseModel whose UNet tensors are on the meta device (to be replaced), sharing its config
    and without the old UNet's lowvram weight functions or its current patcher."""
    memo = {id(base.model_config): base.model_config} if hasattr(base, "model_config") else {}
    if getattr(base, "current_patcher", None) is not None:
        memo[id(base.current_patcher)] = None
    unet = base.diffusion_model
    for t in list(unet.parameters()) + list(unet.buffers()):
        memo[id(t)] = (torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False)
                       if isinstance(t, torch.nn.Parameter) else torch.empty_like(t, device="meta"))
    for m in unet.modules():
        for attr in ("weight_function", "bias_function"):
            if attr in m.__dict__:
                memo[id(m.__dict__[attr])] = []
    return copy.deepcopy(base, memo)


def _references(obj, modules: set, depth: int = 4) -> bool:
    """True when ``obj`` (a wrapper, callback or object patch) holds one of ``modules`` (ids), looking through
    closures, partials, bound methods, containers and torch.compile's wrapper (``_orig_mod``)."""
    if isinstance(obj, torch.nn.Module):
        return id(obj) in modules or _references(getattr(obj, "_orig_mod", None), modules, depth)
    if depth == 0:
        return False
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif isinstance(obj, functools.partial):
        children = [obj.func, *obj.args, *obj.keywords.values()]
    elif inspect.ismethod(obj):
        children = [obj.__self__, obj.__func__]
    elif inspect.isfunction(obj):
        children = [c.cell_contents for c in obj.__closure__ or () if _filled(c)] + list(obj.__defaults__ or ())
    else:
        return False
    return any(_references(c, modules, depth - 1) for c in children)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _tied_path(name: str, rebuilt: set) -> bool:
    """True when the object patch ``name`` replaces the UNet or a module holding a rebuilt (slimmed) layer."""
    if name == "diffusion_model":
        return True
    if not name.startswith(PREFIX):
        return False
    path = name[len(PREFIX):]
    return any(p == path or p.startswith(path + ".") for p in rebuilt)


def _drop_ties_to_old_unet(out, old_unet, rebuilt: set) -> None:
    """Remove from the clone ``out`` what was made for the old UNet: wrappers, callbacks and object patches that
    hold its modules (e.g. torch.compile's), object/weight-wrapper patches on rebuilt layers; each is named."""
    modules = {id(m) for m in old_unet.modules()}
    for table, kind in ((out.wrappers, "wrapper"), (out.callbacks, "callback")):
        for when, per_key in table.items():
            for key, fns in per_key.items():
                held = [f for f in fns if _references(f, modules)]
                if held:
                    fns[:] = [f for f in fns if f not in held]
                    hint = (" Apply torch.compile (TorchCompileModel) after Slim UNet instead."
                            if key == COMPILE_KEY else "")
                    log.warning("sdslim: %s '%s' (%s) holds the original UNet and is dropped from the slim model.%s",
                                kind, key, when, hint)
                    if key == COMPILE_KEY:
                        out.model_options.pop(COMPILE_KWARGS, None)
    for name in list(out.object_patches):
        if _tied_path(name, rebuilt) or _references(out.object_patches[name], modules):
            log.warning("sdslim: object patch '%s' replaces (or holds) a layer of the original UNet and is dropped "
                        "from the slim model", name)
            del out.object_patches[name]
    for key in list(getattr(out, "weight_wrapper_patches", {})):
        if key.startswith(PREFIX) and key[len(PREFIX):].rsplit(".", 1)[0] in rebuilt:
            log.warning("sdslim: weight wrapper on slimmed '%s' is dropped from the slim model", key)
            del out.weight_wrapper_patches[key]


def _rebind(out, new_base) -> None:
    """Point the clone ``out`` at ``new_base``: what belonged to the old weights starts afresh (their backups, the
    cached hook weights, the size, the same-weights parent link); ComfyUI's own unpatch resets the load state."""
    out.model = new_base
    out.backup, out.object_patches_backup, out.hook_backup, out.cached_hook_patches = {}, {}, {}, {}
    out.parent = None
    out.size = 0
    out.unpatch_model(device_to=out.offload_device)
    out.model_size()


def slim_patcher(model, aset: "adapters.AdapterSet", progress=None, site_tensors=None):
    """Return a new ModelPatcher whose UNet has ``aset`` folded into ``model``'s LoRA-merged weights.

    The result is ``model.clone()`` on a new BaseModel: every patch, option, wrapper, callback, hook and
    attachment of ``model`` is kept, except what was tied to the old UNet (the folded patches, and what
    :func:`_drop_ties_to_old_unet` names); patches made for the full-size layers (hook LoRAs registered before)
    are converted into slim space, as are those added later (:mod:`.patches`). ``site_tensors(site)`` gives a
    site's adapter tensors (default ``aset.sites[site]``; a file reader keeps them out of memory: the slim model
    reads them again to convert LoRAs). ``progress(done, total)`` is called after each site. Raises SlimError /
    AdapterError with the key or site at fault. ``model`` and its BaseModel are not modified.
    """
    base = model.model
    unet = getattr(base, "diffusion_model", None)
    if unet is None:
        raise SlimError("sdslim: this MODEL has no 'diffusion_model' (not a UNet model)")
    check_gguf(unet)
    kp = model.get_key_patches(PREFIX)
    check_weights(kp)
    shapes = {k[len(PREFIX):]: tuple(v[0][0].shape) for k, v in kp.items()}
    try:
        family = layout.config_from_state_dict(shapes).family
    except layout.LayoutError as err:
        raise SlimError(f"sdslim: the MODEL is not an SD1.x/SD2.x/SDXL UNet: {err}") from None
    aset.check_model(shapes, family)

    site_tensors = site_tensors or (lambda s: aset.sites[s])
    device = torch.device(model.load_device)     # folded where ComfyUI computes patches; the adapters follow
    used: set = set()
    get, peek = merged_getter(kp, device, used), merged_getter(kp, device, set())
    meter = distance_meter(aset)
    folded: dict = {}
    sites = list(aset.sites)
    for i, site in enumerate(sites):
        comfy.model_management.throw_exception_if_processing_interrupted()
        read: dict = {}

        def get_once(key, read=read):
            if key not in read:
                read[key] = get(key)
            return read[key]
        for key, t in fold.fold_site(site, aset.kind(site), get_once, site_tensors(site)).items():
            store = _store_dtype(kp[PREFIX + key][0][0].dtype, base)
            folded[key] = t.to(device=model.offload_device, dtype=store)
        if meter is not None:
            for key in fold.site_keys(site, aset.kind(site)):
                meter.add(site, key, read[key] if key in read else peek(key))
        if progress is not None:
            progress(i + 1, len(sites))
    for key in folded:
        if key not in used and len(kp[PREFIX + key]) > 1:
            log.warning("sdslim: %d patch(es) on '%s' (norm2 of a slimmed ResBlock) cannot survive the fold and "
                        "are dropped", len(kp[PREFIX + key]) - 1, PREFIX + key)

    new_base = _meta_base_model(base)
    skeleton = new_base.diffusion_model
    slim_keys = {k for k, t in folded.items() if tuple(t.shape) != shapes[k]}
    groups = {f"{s}.{layout.RES_LAYERS['ldm']['norm2']}": aset.groups(s) for s in sites if aset.kind(s) == "res"}
    rebuild = replace_layers(skeleton, folded, slim_keys, groups,
                             lambda path: _keeps_dtype(kp[PREFIX + path + ".weight"][0][0].dtype, base))
    state = {k: folded[k] if k in folded else kp[PREFIX + k][0][0].detach().to(model.offload_device) for k in shapes}
    skeleton.load_state_dict(state, strict=True, assign=True)
    new_base.sdslim_info = SlimInfo(family=family, adapters=aset.source, ranks=aset.ranks(), full_shapes=shapes,
                                    slim_keys=frozenset(slim_keys),
                                    space=lora_slim.SlimSpace(aset, shapes, site_tensors),
                                    distance=meter.result() if meter is not None else None,
                                    source_dtype=source_dtype(v[0][0] for v in kp.values()))
    report_distance(new_base.sdslim_info.distance)

    out = model.clone()
    out.__class__ = patches.slim_class(type(model))
    _rebind(out, new_base)
    for key in folded:                      # merged into the folded weights
        out.patches.pop(PREFIX + key, None)
    _drop_ties_to_old_unet(out, unet, rebuild)
    for table in (out.hook_patches, out.hook_patches_backup or {}):
        for hook_ref, per_key in table.items():
            table[hook_ref], fitted = patches.fit_patch_lists(new_base, per_key, "a hook registered before Slim UNet")
            if table is out.hook_patches:
                patches.report("a hook registered before Slim UNet", fitted)
    out.patches_uuid = uuid.uuid4()
    monitor.install(out)
    return out
