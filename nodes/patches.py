"""Weight patches on a slim model: which fit the slim layers, and the ModelPatcher behaviour that drops the rest.

A LoRA (or hook LoRA, or any weight patch) added *after* Slim UNet was made for the full-size layers. On the keys
whose shape the fold changed it cannot apply: ComfyUI would log a "shape is invalid" error at every step. A slim
model's patcher (:func:`slim_class`) drops those parts once, when they are added, with one message per LoRA/hook.
:func:`fit_to_slim` is the single place that decides what a patch becomes on the slim model.
"""
from __future__ import annotations

import logging
import math
import weakref

PREFIX = "diffusion_model."
log = logging.getLogger("sdslim")
_reported_hooks = weakref.WeakSet()


def made_for_numel(value) -> int | None:
    """Number of weights of the layer a ComfyUI patch value was made for, where its form tells it (else None)."""
    if isinstance(value, list) and value and isinstance(value[0], tuple) and hasattr(value[0][0], "numel"):
        return value[0][0].numel()                                    # a nested patch list (model merging)
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("diff", "set") and value[1]:
        t = value[1][0]
        return t.numel() if hasattr(t, "numel") else None
    weights = getattr(value, "weights", None)
    name = type(value).__name__
    if weights is None:
        return None
    if name == "LoRAAdapter":                       # (up, down, alpha, mid, dora_scale, reshape)
        up, down, mid = weights[0], weights[1], weights[3]
        reshape = weights[5] if len(weights) > 5 else None
        if reshape is not None:
            return math.prod(reshape)
        if mid is not None:
            return up.shape[0] * down.shape[1] * math.prod(mid.shape[2:])
        return up.shape[0] * math.prod(down.shape[1:])
    if name == "LoHaAdapter":                       # (w1a, w1b, alpha, w2a, w2b, t1, t2, dora_scale)
        w1a, w1b, t1 = weights[0], weights[1], weights[5]
        return w1a.shape[0] * w1b.shape[1] * (math.prod(t1.shape[2:]) if t1 is not None else 1)
    if name == "LoKrAdapter":                       # (w1, w2, alpha, w1_a, w1_b, w2_a, w2_b, t2, dora_scale)
        w1, w2, w1a, w1b, w2a, w2b, t2 = weights[0], weights[1], weights[3], weights[4], weights[5], weights[6], \
            weights[7]
        n1 = w1.numel() if w1 is not None else w1a.shape[0] * w1b.shape[1]
        if w2 is not None:
            n2 = w2.numel()
        elif t2 is not None:
            n2 = w2a.shape[1] * w2b.shape[1] * math.prod(t2.shape[2:])
        else:
            n2 = w2a.shape[0] * w2b.shape[1]
        return n1 * n2
    return None


def fit_to_slim(key: str, value, slim_shape: tuple):
    """What the patch ``value`` on the slimmed weight ``key`` becomes on the slim model: ``value`` when it was made
    for the slim layer's size, else None (dropped). The conversion of full-size LoRAs into slim space plugs in here."""
    return value if made_for_numel(value) == math.prod(slim_shape) else None


def split_patches(model, patches: dict) -> tuple[dict, list]:
    """``patches`` (ComfyUI ``add_patches`` form: key or (key, offset[, function]) → value) as (what applies to the
    slim ``model``, keys dropped)."""
    info = getattr(model, "sdslim_info", None)
    if info is None:
        return patches, []
    keep, dropped = {}, []
    for k, value in patches.items():
        key = k if isinstance(k, str) else k[0]
        ckey = key[len(PREFIX):] if key.startswith(PREFIX) else None
        if ckey in info.slim_keys:
            value = fit_to_slim(key, value, tuple(model.get_parameter(key).shape))
            if value is None:
                dropped.append(key)
                continue
        keep[k] = value
    return keep, dropped


def split_patch_lists(model, per_key: dict) -> tuple[dict, list]:
    """Stored patches (key → [(strength, value, strength_model, offset, function), …], as in ``hook_patches``) as
    (what applies to the slim ``model``, keys with dropped parts)."""
    keep, dropped = {}, []
    for key, entries in per_key.items():
        fitted = []
        for entry in entries:
            value = split_patches(model, {key: entry[1]})[0].get(key)
            if value is None:
                dropped.append(key)
            else:
                fitted.append((entry[0], value, *entry[2:]))
        if fitted:
            keep[key] = fitted
    return keep, sorted(set(dropped))


def report_dropped(what: str, keys: list) -> None:
    shown = ", ".join(sorted(keys)[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
    log.warning("sdslim: %s has %d weight patch(es) made for the full-size layers that Slim UNet replaced; they "
                "are not applied: %s. Load it before Slim UNet to keep them", what, len(keys), shown)


class SlimPatcher:
    """Mixin for the patcher of a slim model: patches that cannot apply to the slim layers are dropped as they are
    added (LoRA loaders, hook LoRAs), with one message per LoRA/hook, instead of failing at every step."""

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        keep, dropped = split_patches(self.model, patches)
        if dropped:
            report_dropped("a LoRA added after Slim UNet", dropped)
        # dropped keys count as handled: ComfyUI would otherwise also log each one as "NOT LOADED"
        return list(super().add_patches(keep, strength_patch, strength_model)) + dropped

    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        keep, dropped = split_patches(self.model, patches)
        ref = getattr(hook, "hook_ref", hook)
        if dropped and ref not in _reported_hooks:
            _reported_hooks.add(ref)
            report_dropped(f"hook '{type(hook).__name__}'", dropped)
        return super().add_hook_patches(hook, keep, strength_patch, strength_model)


_CLASSES: dict = {}


def slim_class(patcher_cls: type) -> type:
    """The slim variant of a ModelPatcher class (itself when it already is one); ``clone()`` keeps it."""
    if issubclass(patcher_cls, SlimPatcher):
        return patcher_cls
    if patcher_cls not in _CLASSES:
        _CLASSES[patcher_cls] = type(f"Slim{patcher_cls.__name__}", (SlimPatcher, patcher_cls), {})
    return _CLASSES[patcher_cls]
