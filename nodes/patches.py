"""Weight patches on a slim model: LoRAs made for the full-size model converted into slim space, and the
ModelPatcher behaviour that does it as they are added.

A LoRA (or hook LoRA, or any weight patch) added *after* Slim UNet was made for the full-size layers. On the layers
the fold changed, the slim model's patcher (:func:`slim_class`) converts each patch once, when it is added, with
the core (:class:`sdslim_core.ops.lora_slim.SlimSpace`), and hands ComfyUI ordinary patches: a LoRA/LoCon stays a
``LoRAAdapter`` of the same rank, LoHa/LoKr/full diffs become a dense ``("diff", …)`` of the slim size, and a
``net.2`` delta under an FF intercept also gets its bias patch. The strength stays ComfyUI's, and a LoRA added again
with the same tensors (a strength change, a hook registered at every sampling) reuses its conversion, so neither
folds nor converts. DoRA and the other forms that need the full-size weight are refused with the core's message;
what cannot be converted otherwise (norm2 deltas, model merges) is dropped with one message per LoRA/hook.
:func:`fit_to_slim` decides what one patch becomes.
"""
from __future__ import annotations

import collections
import logging
import math
import weakref

import torch

from sdslim_core import layout
from sdslim_core.hosts.comfyui import NEEDS_BASE, core_module, made_for_numel, patch_tensors
from sdslim_core.io.lora_files import LoraError, LoraModule
from sdslim_core.ops.lora import module_scale, norm2_lost
from sdslim_core.ops.lora_slim import DROPPED

PREFIX = layout.COMFY_PREFIX
log = logging.getLogger("sdslim")
_reported_hooks = weakref.WeakSet()
_CONVERSIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # SlimSpace → recent conversions
_CACHED = 1024                                                    # conversions kept per slim model (~10 LoRAs)


# ---------------------------------------------------------------------------------- core module → ComfyUI patch

def host_value(mod: LoraModule, part: str, dtype: torch.dtype):
    """A converted module as the ComfyUI patch for its ``part``: a ``LoRAAdapter`` (ComfyUI's alpha/rank is the
    module's scale) or ``("diff", (tensor,))``, tensors in ``dtype``."""
    t = mod.tensors
    if mod.kind == "lora":
        from comfy.weight_adapter import LoRAAdapter
        mid = t["mid"].to(dtype) if "mid" in t else None
        alpha = module_scale(mod) * t["down"].shape[0]
        return LoRAAdapter(set(), (t["up"].to(dtype), t["down"].to(dtype), alpha, mid, None, None))
    return ("diff", (t["diff" if part == "weight" else "diff_b"].to(dtype),))


def _dtype_of(mod: LoraModule) -> torch.dtype:
    return next(v.dtype for k, v in mod.tensors.items() if k != "alpha")


# ------------------------------------------------------------------------------------------ the decision

class Fitted:
    """What the patches of one LoRA/hook become on a slim model: ``pairs`` [(patch key, value)] to add (a key may
    come twice: a LoRA's own bias patch and an intercept's shift), keys ``dropped`` (no conversion), norm2 ``lost``."""

    def __init__(self):
        self.pairs, self.dropped, self.lost = [], [], []


def fit_to_slim(info, k, value, shape: tuple, source: str, out: Fitted) -> None:
    """Record in ``out`` what the patch ``value`` on key ``k`` (a key or ``(key, offset[, function])``) of the slim
    model becomes. ``info``: the model's ``SlimInfo``; ``shape``: the slim weight's shape. Raises
    :class:`~sdslim_core.io.lora_files.LoraError` for forms that need the full-size weight (DoRA, OFT, BOFT, GLoRA)."""
    key = k if isinstance(k, str) else k[0]
    ckey = key[len(PREFIX):] if key.startswith(PREFIX) else None
    space = info.space
    folded = ckey is not None and (ckey.rsplit(".", 1)[0] in space.roles if space is not None
                                   else ckey in info.slim_keys)
    if not folded:
        out.pairs.append((k, value))
        return
    full, have = math.prod(info.full_shapes[ckey]), made_for_numel(value)
    if have == math.prod(shape) and have != full:                   # already made for the slim layer
        out.pairs.append((k, value))
        return
    if type(value).__name__ in NEEDS_BASE:
        raise LoraError(f"{source}: its {type(value).__name__[:-len('Adapter')]} patch on {key}, a layer the fold "
                        "changes, is computed from the full-size weight, which a slim model no longer has; fold it "
                        "instead: put its LoRA loader before Slim UNet (or apply it before `sdslim slim`)")
    mod = core_module(ckey, value, source) if space is not None and isinstance(k, str) and have == full else None
    if mod is None:
        out.dropped.append(k)
        return
    if space.form(mod) == DROPPED:                  # norm2 of a folded ResBlock (form() raises for DoRA)
        out.lost.append(k)
        return
    out.pairs += _converted(space, ckey, value, mod)


def _converted(space, ckey: str, value, mod: LoraModule) -> list:
    """The slim patches of ``mod`` (made from ``value``), converted once per source tensors: the same LoRA added
    again (a strength change, a hook registered at every sampling) reuses them."""
    sources = patch_tensors(value)
    key = (ckey, type(value).__name__, tuple(("t", id(x)) if torch.is_tensor(x) else ("v", repr(x)) for x in sources))
    cache = _CONVERSIONS.setdefault(space, collections.OrderedDict())
    hit = cache.get(key)
    if hit is not None and all(ref() is x for ref, x in zip(hit[0], [x for x in sources if torch.is_tensor(x)])):
        cache.move_to_end(key)
        return hit[1]
    dtype = _dtype_of(mod)
    pairs = [(PREFIX + f"{mod.target}.{part}", value if new is mod else host_value(new, part, dtype))
             for part, new in space.convert_part(mod, ckey.rsplit(".", 1)[1]).items()]
    cache[key] = ([weakref.ref(x) for x in sources if torch.is_tensor(x)], pairs)
    for old in [k for k, (refs, _) in cache.items() if any(r() is None for r in refs)]:
        del cache[old]                                                # their LoRA is gone
    while len(cache) > _CACHED:
        cache.popitem(last=False)
    return pairs


def fit_patches(model, patches: dict, source: str) -> Fitted:
    """``patches`` (ComfyUI ``add_patches`` form: key or (key, offset[, function]) → value) as they apply to the
    slim ``model`` (everything unchanged on a model that is not slim)."""
    out = Fitted()
    info = getattr(model, "sdslim_info", None)
    if info is None:
        out.pairs = list(patches.items())
        return out
    for k, value in patches.items():
        key = k if isinstance(k, str) else k[0]
        try:
            shape = tuple(model.get_parameter(key).shape) if key.startswith(PREFIX) else None
        except AttributeError:
            shape = None
        fit_to_slim(info, k, value, shape, source, out)
    return out


def fit_patch_lists(model, per_key: dict, source: str) -> tuple[dict, Fitted]:
    """Stored patches (key → [(strength, value, strength_model, offset, function), …], as in ``hook_patches``) as
    they apply to the slim ``model``, and what was dropped or lost."""
    keep, report = {}, Fitted()
    for key, entries in per_key.items():
        for entry in entries:
            one = Fitted()
            fit_to_slim(model.sdslim_info, key, entry[1], tuple(model.get_parameter(key).shape), source, one)
            for k, value in one.pairs:
                keep.setdefault(k, []).append((entry[0], value, *entry[2:]))
            report.dropped += one.dropped
            report.lost += one.lost
    return keep, report


def in_rounds(pairs: list) -> list[dict]:
    """``pairs`` as dicts with distinct keys, in order (ComfyUI's ``add_patches`` takes one patch per key)."""
    rounds: list[dict] = []
    for k, value in pairs:
        for r in rounds:
            if k not in r:
                r[k] = value
                break
        else:
            rounds.append({k: value})
    return rounds


def report(what: str, fitted: Fitted) -> None:
    """One message for the patches of a LoRA/hook that do not apply to the slim model."""
    if fitted.dropped:
        keys = sorted({k if isinstance(k, str) else k[0] for k in fitted.dropped})
        shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
        log.warning("sdslim: %s has %d weight patch(es) made for the full-size layers that Slim UNet replaced, in a "
                    "form that cannot be converted to them (not a LoRA/LoCon/LoHa/LoKr/diff, or the model has no "
                    "adapters to convert with); they are not applied: %s. Load it before Slim UNet to keep them",
                    what, len(keys), shown)
    for key in sorted(set(fitted.lost)):
        log.warning("sdslim: %s", norm2_lost(key[len(PREFIX):], [what]))


class SlimPatcher:
    """Mixin for the patcher of a slim model: patches made for the full-size layers are converted into slim space
    as they are added (LoRA loaders, hook LoRAs); see the module docstring."""

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        if not isinstance(n, SlimPatcher):        # a patcher whose clone() sets its own class (ComfyUI-GGUF's)
            n.__class__ = slim_class(type(n))
        return n

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        fitted = fit_patches(self.model, patches, "a LoRA added after Slim UNet")
        report("a LoRA added after Slim UNet", fitted)
        added = set()
        for r in in_rounds(fitted.pairs):
            added.update(super().add_patches(r, strength_patch, strength_model))
        # dropped keys count as handled: ComfyUI would otherwise also log each one as "NOT LOADED"
        return list(added | set(fitted.dropped) | set(fitted.lost))

    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        name = f"hook '{type(hook).__name__}'"
        fitted = fit_patches(self.model, patches, name)
        ref = getattr(hook, "hook_ref", hook)
        if (fitted.dropped or fitted.lost) and ref not in _reported_hooks:
            _reported_hooks.add(ref)
            report(name, fitted)
        added = set()
        for r in in_rounds(fitted.pairs) or [{}]:
            added.update(super().add_hook_patches(hook, r, strength_patch, strength_model))
        return list(added)


_CLASSES: dict = {}


def slim_class(patcher_cls: type) -> type:
    """The slim variant of a ModelPatcher class (itself when it already is one); ``clone()`` keeps it."""
    if issubclass(patcher_cls, SlimPatcher):
        return patcher_cls
    if patcher_cls not in _CLASSES:
        _CLASSES[patcher_cls] = type(f"Slim{patcher_cls.__name__}", (SlimPatcher, patcher_cls), {})
    return _CLASSES[patcher_cls]
