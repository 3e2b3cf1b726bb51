"""Per-sampling records for the VRAM report.

``install(patcher)`` adds one ``OUTER_SAMPLE`` wrapper (key ``sdslim``) to a ModelPatcher; clones inherit it. The
wrapper records peak memory and duration of the sampling into :data:`LAST_SAMPLING`, which VRAM Report reads.
"""
from __future__ import annotations

import time

import torch

import comfy.patcher_extension

KEY = "sdslim"
LAST_SAMPLING: dict = {}


def install(patcher) -> None:
    """Add the sdslim OUTER_SAMPLE wrapper to ``patcher`` (replacing an earlier one, never stacking)."""
    kind = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
    patcher.remove_wrappers_with_key(kind, KEY)
    patcher.add_wrapper_with_key(kind, KEY, outer_sample_wrapper)


def outer_sample_wrapper(executor, *args, **kwargs):
    """OUTER_SAMPLE wrapper: time the sampling and record peak memory."""
    patcher = executor.class_obj.model_patcher
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
