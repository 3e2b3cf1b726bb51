"""The training-VRAM study on a real GPU (the seed's harness): random latents, text encoder frozen,
no VAE, ``steps`` training steps per batch size, one setting changed at a time.

Per point it records torch's allocated/reserved peaks per phase (outside vs inside the optimizer
step, so the curve fits as ``max(plateau, a + b·B)`` like the estimate) and the whole-device peak
polled from NVML, which is what the seed read from nvidia-smi.

On ``device="cpu"`` (the GPU suite's dry run) the same steps run on real CPU tensors and the allocated
peak is the live-storage count of :class:`~sdslim_core.vram.tracker.LiveTracker` (there is no caching
allocator: reserved is None; the device peak is the process RSS).
"""
import contextlib
import gc
import time

import torch

from . import harness
from .. import optional
from ..io.files import GIB
from .live import measure_peak
from .tracker import LiveTracker


class NoGPU(RuntimeError):
    """The study needs a CUDA device."""


def unavailable_reason(settings, device_type="cuda"):
    """Why this setting cannot run on this machine, or None."""
    if settings.attention == "xformers":
        reason = optional.missing("xformers", "xformers attention")
        if reason or device_type == "cuda":
            return reason
        return "xformers needs CUDA"
    if settings.optimizer == "adamw8bit":
        reason = optional.missing("bitsandbytes", "the adamw8bit optimizer")
        if reason or device_type == "cuda":
            return reason
        return "bitsandbytes' 8-bit AdamW needs CUDA"
    return None


class _PhasePeaks:
    """on_phase callback: torch's allocated/reserved peak of each phase (max over steps)."""

    def __init__(self, device):
        self.device = device
        self.phase = "build"
        self.allocated, self.reserved = {}, {}

    def __call__(self, phase):
        alloc = torch.cuda.max_memory_allocated(self.device)
        res = torch.cuda.max_memory_reserved(self.device)
        self.allocated[self.phase] = max(self.allocated.get(self.phase, 0), alloc)
        self.reserved[self.phase] = max(self.reserved.get(self.phase, 0), res)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.phase = phase

    def reset(self):
        torch.cuda.reset_peak_memory_stats(self.device)

    def watch(self, unet, resident):
        return contextlib.nullcontext()


class _LivePeaks:
    """The CPU counterpart: live tensor storages counted by a LiveTracker (weights tracked explicitly)."""

    def __init__(self, device):
        self.tracker = LiveTracker(device.type)
        self.allocated, self.reserved = self.tracker.phase_peak, {}

    def __call__(self, phase):
        self.tracker.set_phase(phase)

    def reset(self):
        pass

    def watch(self, unet, resident):
        self.tracker.track_module(unet)
        for t in resident:
            self.tracker.track(t, "te_vae")
        return self.tracker


def measure_point(settings, batch, steps, device):
    """Build, train ``steps`` steps at ``batch`` and return the point's dict (raises on OOM)."""
    xformers_fn = None
    if settings.attention == "xformers":
        import xformers.ops
        xformers_fn = xformers.ops.memory_efficient_attention
    bnb = None
    if settings.optimizer == "adamw8bit":
        import bitsandbytes as bnb
    cuda = device.type == "cuda"
    peaks = _PhasePeaks(device) if cuda else _LivePeaks(device)
    with measure_peak(device) as monitor:
        peaks.reset()
        with torch.device(device):
            unet = harness.build_model(settings)
            trainable = harness.prepare_training(unet, settings, xformers_fn)
            optimizer = harness.make_optimizer(trainable, settings, bnb)
            resident = harness.resident_frozen(settings, device) if settings.resident_te_vae else []
        t0 = time.perf_counter()
        with peaks.watch(unet, resident):
            for _ in range(steps):
                harness.train_step(unet, optimizer, trainable, settings, batch, device, peaks)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - t0) / steps
        peaks("done")
    del unet, optimizer, trainable, resident
    phase_alloc = {k: v for k, v in peaks.allocated.items() if k not in ("build", "init", "idle", "done")}
    top = max(phase_alloc, key=phase_alloc.get)
    line = max(phase_alloc.get(p, 0) for p in ("data", "fwd", "bwd"))
    r = monitor.result
    return {
        "batch": batch, "peak_gib": phase_alloc[top] / GIB, "phase": top, "line_gib": line / GIB,
        "plateau_gib": phase_alloc.get("opt", 0) / GIB,
        "reserved_gib": max(peaks.reserved.values()) / GIB if peaks.reserved else None,
        "nvml_peak_gib": None if r.device_peak_used_bytes is None else r.device_peak_used_bytes / GIB,
        "nvml_start_gib": None if r.device_start_used_bytes is None else r.device_start_used_bytes / GIB,
        "device_peak_source": r.source,
        "phase_peaks_gib": {k: v / GIB for k, v in phase_alloc.items()},
        "step_seconds": seconds,
    }


def run_study(entries, batch_sizes, steps=20, device="cuda", log=print):
    """``entries``: [(name, Settings, baseline)]; returns curve dicts (name, baseline, settings, points).
    ``device="cpu"`` runs the same steps on the CPU (a structural check: see the module docstring)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise NoGPU("sdslim vram study needs a CUDA GPU (none is visible to torch); "
                    "use `sdslim vram estimate` for a prediction without one")
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    curves = []
    for name, settings, baseline in entries:
        curve = {"name": name, "baseline": baseline, "settings": settings.to_dict(), "points": [], "notes": []}
        curves.append(curve)
        reason = unavailable_reason(settings, device.type)
        if reason:
            curve["notes"].append(f"skipped: {reason}")
            log(f"{name}: skipped ({reason})")
            continue
        for batch in batch_sizes:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            try:
                point = measure_point(settings, batch, steps, device)
            except torch.cuda.OutOfMemoryError:
                curve["notes"].append(f"out of memory at B={batch}")
                log(f"{name}: B={batch} out of memory; skipping larger batches")
                break
            curve["points"].append(point)
            log(f"{name}: B={batch} torch peak {point['peak_gib']:.2f} GiB ({point['phase']}), reserved "
                f"{point['reserved_gib'] or float('nan'):.2f}, device {point['nvml_peak_gib'] or float('nan'):.2f} GiB")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return curves
