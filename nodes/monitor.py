"""Per-sampling records for the VRAM report, and the check that LoRAs added after Slim UNet fit the slim layers.

``install(patcher)`` adds one ``OUTER_SAMPLE`` wrapper (key ``sdslim``) to a ModelPatcher. Clones inherit it, so a
LoRA loaded after Slim UNet is checked too. The wrapper records peak memory and duration of the sampling into
:data:`LAST_SAMPLING`, which the VRAM Report node reads.
"""
from __future__ import annotations

import logging
import math
import time

import torch

import comfy.patcher_extension

KEY = "sdslim"
LAST_SAMPLING: dict = {}
log = logging.getLogger("sdslim")
_warned: set = set()


def install(patcher) -> None:
    """Add the sdslim OUTER_SAMPLE wrapper to ``patcher`` (replacing an earlier one, never stacking)."""
    kind = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
    patcher.remove_wrappers_with_key(kind, KEY)
    patcher.add_wrapper_with_key(kind, KEY, outer_sample_wrapper)


def patch_numel(value) -> int | None:
    """Number of weights of the layer a ComfyUI patch value was made for, where its form tells it (else None)."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("diff", "set") and value[1]:
        t = value[1][0]
        return t.numel() if hasattr(t, "numel") else None
    weights = getattr(value, "weights", None)
    name = type(value).__name__
    if name == "LoRAAdapter" and weights is not None:
        up, down, mid = weights[0], weights[1], weights[3]
        reshape = weights[5] if len(weights) > 5 else None
        if reshape is not None:
            return math.prod(reshape)
        if mid is not None:
            return up.shape[0] * down.shape[1] * math.prod(mid.shape[2:])
        return up.shape[0] * math.prod(down.shape[1:])
    if name == "LoHaAdapter" and weights is not None:
        w1a, w1b, t1 = weights[0], weights[1], weights[5]
        return w1a.shape[0] * w1b.shape[1] * (math.prod(t1.shape[2:]) if t1 is not None else 1)
    return None


def misfit_patches(patcher) -> dict:
    """``{key: (patch numel or None, slim shape)}`` for patches on slimmed keys made for another layer size."""
    info = getattr(patcher.model, "sdslim_info", None)
    if info is None:
        return {}
    out = {}
    for key, patches in patcher.patches.items():
        ckey = key[len("diffusion_model."):] if key.startswith("diffusion_model.") else None
        if ckey not in info.slim_keys:
            continue
        slim = comfy_weight_shape(patcher, key)
        for patch in patches:
            numel = patch_numel(patch[1])
            if numel is None or numel != math.prod(slim):
                out[key] = (numel, slim)
                break
    return out


def comfy_weight_shape(patcher, key: str) -> tuple:
    """Current shape of the weight ``key`` of the patcher's model."""
    obj = patcher.model
    for name in key.split("."):
        obj = getattr(obj, name)
    return tuple(obj.shape)


def warn_misfits(patcher) -> dict:
    """Log, once per patch set, each LoRA key that does not fit the slim model (ComfyUI skips those)."""
    bad = misfit_patches(patcher)
    token = (id(patcher.model), patcher.patches_uuid)
    if bad and token not in _warned:
        _warned.add(token)
        for key, (numel, slim) in sorted(bad.items()):
            made = "a layer sdslim cannot size" if numel is None else f"a layer of {numel} weights"
            log.warning("sdslim: patch on '%s' was made for %s but the slim layer is %s; it is not applied "
                        "(apply LoRAs before Slim UNet to keep them)", key, made, list(slim))
    return bad


def outer_sample_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: warn about misfit patches, then time the sampling and record peak memory."""
    guider = executor.class_obj
    patcher = guider.model_patcher
    warn_misfits(patcher)
    device = patcher.load_device
    cuda = getattr(device, "type", "cpu") == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        return executor(*args, **kwargs)
    finally:
        record = {"device": str(device), "seconds": time.perf_counter() - start,
                  "model": type(patcher.model).__name__, "slim": hasattr(patcher.model, "sdslim_info"),
                  "latent_shape": list(args[0].shape) if args and hasattr(args[0], "shape") else None}
        if cuda:
            torch.cuda.synchronize(device)
            record["peak_allocated"] = torch.cuda.max_memory_allocated(device)
            record["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        else:
            record["rss_after"] = _rss()
        LAST_SAMPLING.clear()
        LAST_SAMPLING.update(record)


def _rss() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss
