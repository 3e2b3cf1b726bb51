"""Estimate worker process: ``python -m sdslim_core.vram.estimate_worker``.

Reads ``{"jobs": [{"name", "settings", "batch_sizes"}]}`` as JSON on stdin, activates the fake
CUDA device before torch is imported, runs each job's step on fake tensors under ``LiveTracker``
and writes one JSON object per job on stdout (everything else goes to stderr). Run it through
``sdslim_core.vram.estimate``: a process that has already imported torch cannot load the shim.
"""
import contextlib
import json
import os
import sys
import time

from sdslim_core.io.files import GIB
from sdslim_core.optional import MissingDependency
from sdslim_core.vram import fakecuda
from sdslim_core.vram.settings import Settings


def _real_bnb():
    """bitsandbytes, prepared to run on fake tensors, or None when it is not installed."""
    import importlib.util
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    import bitsandbytes
    import bitsandbytes.optim.optimizer as bnb_optimizer
    bnb_optimizer.sync_gpu = lambda t: None  # no device to synchronise
    return bitsandbytes


def _point(batch, tracker, reserve):
    gib = lambda d: {k: v / GIB for k, v in d.items() if v}  # noqa: E731
    peaks = tracker.phase_peak
    line = max((peaks[p] for p in ("data", "fwd", "bwd", "sample") if p in peaks), default=0)
    return {
        "reserved_gib": reserve["reserved"] / GIB,
        "batch": batch,
        "peak_gib": tracker.peak / GIB,
        "phase": tracker.peak_phase,
        "peak_op": tracker.peak_op,
        "line_gib": line / GIB,
        "plateau_gib": peaks["opt"] / GIB if "opt" in peaks else None,
        "breakdown_gib": gib(tracker.peak_breakdown),
        "phase_peaks_gib": gib(peaks),
        "peak_bytes": tracker.peak,
        "phase_start_bytes": tracker.phase_start,
    }


def run_job(job, device):
    """Build the model once on fake tensors, then measure one step per batch size."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    from sdslim_core.vram import harness
    from sdslim_core.vram.allocator import step_reserve
    from sdslim_core.vram.tracker import AllocationTrace, LiveTracker

    settings = Settings.from_dict(job["settings"])
    warnings = [device.note] if device.note else []
    if settings.quantised and not settings.sampling:
        warnings.append("training: the GGUF file's quantised weights are estimated as --precision says "
                        "(quantised weights are not trained)")
    bnb = _real_bnb() if settings.optimizer == "adamw8bit" and not settings.sampling else None
    fake = FakeTensorMode(allow_non_fake_inputs=bnb is not None)  # bnb moves real quantisation maps
    started = time.perf_counter()
    trace = AllocationTrace()          # the build's allocations too: the caching allocator's model replays them
    with fake, torch.device(device.type), LiveTracker(device.type, trace):
        model = harness.build_model(settings)
        if settings.sampling:
            harness.prepare_sampling(model, settings, fakecuda.xformers_attention)
            trainable, optimizer = [], None
        else:
            trainable = harness.prepare_training(model, settings, fakecuda.xformers_attention)
            with unset_fake_temporarily() if bnb else contextlib.nullcontext():  # bnb needs real .tolist()
                optimizer = harness.make_optimizer(trainable, settings, bnb)
            harness.warm_optimizer(optimizer, trainable)
        resident = harness.resident_frozen(settings, device.type) if settings.resident_te_vae else []
    setup = list(trace.events)
    if bnb is not None:
        warnings.append(f"AdamW8bit: real bitsandbytes {getattr(bnb, '__version__', '')} states")
    points = []
    for batch in job["batch_sizes"]:
        tracker = LiveTracker(device.type, trace)
        start = len(trace.events)
        with fake:
            tracker.track_module(model)
            for t in resident:
                tracker.track(t, "te_vae")
            hooks = tracker.hook_grads(trainable)
            if optimizer is not None:
                tracker.tag_optimizer_state(optimizer)
            with tracker:
                if settings.sampling:
                    harness.sampling_step(model, settings, batch, device.type, tracker.set_phase)
                else:
                    harness.train_step(model, optimizer, trainable, settings, batch, device.type, tracker.set_phase)
            for h in hooks:
                h.remove()
        points.append(_point(batch, tracker, step_reserve(setup, trace.events[start:])))
        print(f"  {job['name']}: B={batch} peak {points[-1]['peak_gib']:.2f} GiB ({points[-1]['phase']})",
              file=sys.stderr, flush=True)
    return {"name": job["name"], "settings": settings.to_dict(), "device": device.type, "device_mode": device.mode,
            "warnings": warnings, "points": points, "seconds": time.perf_counter() - started,
            "n_params": harness.parameter_count(model), "n_trainable": sum(p.numel() for p in trainable)}


def main() -> int:
    request = json.load(sys.stdin)
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # libraries that print must not corrupt the JSON stream
    sys.stdout = sys.stderr
    device = fakecuda.activate()
    for job in request["jobs"]:
        try:
            result = run_job(job, device)
        except MissingDependency as err:  # the message says what to install; no traceback
            result = {"name": job["name"], "error": str(err)}
        except Exception as err:  # reported per job; the other jobs still run
            import traceback
            traceback.print_exc()
            result = {"name": job["name"], "error": f"{type(err).__name__}: {err}"}
        results.write(json.dumps(result) + "\n")
        results.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # Not through exit(): the autograd thread torch starts for the fake CUDA device at the first backward pass can
    # make exit()'s teardown abort the process ("terminate called without an active exception") while it starts;
    # the results are written and flushed by now.
    os._exit(code)
