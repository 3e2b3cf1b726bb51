"""The training-VRAM study on a real GPU (the seed's harness): random latents, text encoder frozen,
no VAE, ``steps`` training steps per batch size, one setting changed at a time. A setting is built once (its
optimizer states made up front, as the estimator makes them) and each batch size starts from an emptied cache.

Per point it records torch's allocated/reserved peaks per phase (outside vs inside the optimizer
step, so the curve fits as ``max(plateau, a + b·B)`` like the estimate) and the whole-device peak
polled from NVML, which is what the seed read from nvidia-smi (and NVML's reading at the end of the steps: the
reserve only grows until the next ``empty_cache``, so that reading is the point's peak whatever the polling
caught).

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

    def watch(self, unet, resident, optimizer):
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

    def watch(self, unet, resident, optimizer):
        self.tracker.track_module(unet)
        for t in resident:
            self.tracker.track(t, "te_vae")
        if optimizer is not None:
            self.tracker.tag_optimizer_state(optimizer)
        return self.tracker


class _Setting:
    """One setting on the device, built once: the model, its optimizer warmed as the estimator warms it (states
    made by one step on zero gradients) and the resident stand-ins; each :meth:`point` starts from an emptied
    cache, so every batch size is measured as a fresh run of that setting would be."""

    def __init__(self, settings, device):
        self.settings, self.device = settings, device
        xformers_fn = bnb = None
        if settings.attention == "xformers":
            import xformers.ops
            xformers_fn = xformers.ops.memory_efficient_attention
        if settings.optimizer == "adamw8bit" and not settings.sampling:
            import bitsandbytes as bnb
        with torch.device(device):
            self.unet = harness.build_model(settings)
            if settings.sampling:
                harness.prepare_sampling(self.unet, settings, xformers_fn)
                self.trainable, self.optimizer = [], None
            else:
                self.trainable = harness.prepare_training(self.unet, settings, xformers_fn)
                self.optimizer = harness.make_optimizer(self.trainable, settings, bnb)
                harness.warm_optimizer(self.optimizer, self.trainable)
            self.resident = harness.resident_frozen(settings, device) if settings.resident_te_vae else []

    def point(self, batch, steps):
        """Run ``steps`` steps at ``batch`` and return the point's dict (raises on OOM)."""
        device, cuda = self.device, self.device.type == "cuda"
        gc.collect()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        peaks = _PhasePeaks(device) if cuda else _LivePeaks(device)
        with measure_peak(device) as monitor:
            peaks.reset()
            t0 = time.perf_counter()
            with peaks.watch(self.unet, self.resident, self.optimizer):
                for _ in range(steps):
                    if self.settings.sampling:
                        harness.sampling_step(self.unet, self.settings, batch, device, peaks)
                    else:
                        harness.train_step(self.unet, self.optimizer, self.trainable, self.settings, batch, device,
                                           peaks)
            if cuda:
                torch.cuda.synchronize(device)
            seconds = (time.perf_counter() - t0) / steps
            peaks("done")
            end_used = monitor.poll_now()
        phase_alloc = {k: v for k, v in peaks.allocated.items() if k not in ("build", "init", "idle", "done")}
        top = max(phase_alloc, key=phase_alloc.get)
        line = max(phase_alloc.get(p, 0) for p in ("data", "fwd", "bwd", "sample"))
        r = monitor.result
        return {
            "batch": batch, "peak_gib": phase_alloc[top] / GIB, "phase": top, "line_gib": line / GIB,
            "plateau_gib": phase_alloc.get("opt", 0) / GIB if not self.settings.sampling else None,
            "reserved_gib": max(peaks.reserved.values()) / GIB if peaks.reserved else None,
            "nvml_peak_gib": None if r.device_peak_used_bytes is None else r.device_peak_used_bytes / GIB,
            "nvml_end_gib": None if end_used is None else end_used / GIB,
            "nvml_start_gib": None if r.device_start_used_bytes is None else r.device_start_used_bytes / GIB,
            "device_peak_source": r.source, "nvml_samples": r.samples,
            "phase_peaks_gib": {k: v / GIB for k, v in phase_alloc.items()},
            "step_seconds": seconds,
        }


def measure_point(settings, batch, steps, device):
    """One point of ``settings`` on a model built for it alone (raises on OOM)."""
    return _Setting(settings, torch.device(device)).point(batch, steps)


def run_study(entries, batch_sizes, steps=20, device="cuda", log=print, stop=None, on_point=None):
    """``entries``: [(name, Settings, baseline)]; returns curve dicts (name, baseline, settings, points). Each
    setting is built once and measured at every batch size (``batch_sizes``: a sequence, or a function of the
    setting's name), ascending, until one runs out of memory. ``stop(name, batch, curve)`` returning True ends a
    setting's sweep early (it should note why in ``curve["notes"]``); ``on_point(curves)`` after every point.
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
        setting = None
        for batch in (batch_sizes(name) if callable(batch_sizes) else batch_sizes):
            if stop is not None and stop(name, batch, curve):
                break
            try:
                setting = setting or _Setting(settings, device)
                point = setting.point(batch, steps)
            except torch.cuda.OutOfMemoryError:
                curve["notes"].append(f"out of memory at B={batch}")
                log(f"{name}: B={batch} out of memory; skipping larger batches")
                break
            curve["points"].append(point)
            log(f"{name}: B={batch} torch peak {point['peak_gib']:.2f} GiB ({point['phase']}), reserved "
                f"{point['reserved_gib'] or float('nan'):.2f}, device {point['nvml_end_gib'] or float('nan'):.2f} GiB "
                f"({point['step_seconds']:.2f} s/step)")
            if on_point is not None:
                on_point(curves)
        del setting
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return curves
