"""Peak-VRAM estimates without a GPU: the public API (torch-free in this process).

The work runs in a subprocess (the ``sdslim_core.vram.estimate_worker`` module) because the fake-CUDA
shim must be loaded before torch, and callers (ComfyUI, A1111) have imported torch long before.

    from sdslim_core.vram.estimate import estimate
    from sdslim_core.vram.settings import Settings
    result = estimate(Settings(arch="sd15", resolution=768, lora_rank=16), batch_sizes=(1, 2, 4))
    print(result.format_text())
"""
import collections
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from .allocator import DEFAULT_CONTEXT_GIB
from .fit import CurveFit, classify, fit_curve, kink_note
from .settings import Settings, select_matrix

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The worker finds sdslim_core by this path, not by PYTHONPATH or the working directory: ComfyUI's Windows portable
# Python (a ``._pth`` file beside python.exe) ignores PYTHONPATH, and a custom node is not an installed package.
_LAUNCH = ("import runpy, sys; sys.path.insert(0, {root!r}); "
           "runpy.run_module('sdslim_core.vram.estimate_worker', run_name='__main__', alter_sys=True)")

# The tracker's storage categories, grouped as a VRAM budget is read. Autocast's bf16 weight copies are made
# during the forward pass and count as activations; a category not listed here counts as workspace.
BREAKDOWN_GROUPS = {
    "weights": ("param", "frozen", "buffer", "te_vae"),
    "gradients": ("grad",),
    "optimizer state": ("opt_state",),
    "activations": ("act", "data"),
    "workspace": ("bwd_tmp", "opt_tmp"),
}


def grouped_breakdown(breakdown_gib: dict) -> dict:
    """{group: GiB} of a point's ``breakdown_gib`` (every group present; they sum to the point's peak)."""
    groups = dict.fromkeys(BREAKDOWN_GROUPS, 0.0)
    owner = {c: g for g, cats in BREAKDOWN_GROUPS.items() for c in cats}
    for category, gib in breakdown_gib.items():
        groups[owner.get(category, "workspace")] += gib
    return groups


@dataclass
class EstimateResult:
    """One estimated curve: per-batch peaks, the fit ``max(plateau, intercept + slope·B)``."""
    name: str
    settings: Settings
    points: list  # dicts: batch, peak_gib, phase, breakdown_gib, line_gib, plateau_gib, ...
    fit: CurveFit
    device_mode: str  # "shim" | "native-cuda" | "cpu-fallback"
    warnings: list = field(default_factory=list)
    baseline: str = ""
    classification: str = ""
    seconds: float = 0.0
    n_params: int = 0
    n_trainable: int = 0
    context_gib: float = DEFAULT_CONTEXT_GIB  # the device's CUDA context: a measured input (docs/vram.md)

    def device_gib(self, point: dict) -> float:
        """What nvidia-smi shows at a point's peak: the caching allocator's modelled reserve + the context."""
        return point["reserved_gib"] + self.context_gib

    def to_dict(self) -> dict:
        return {
            "name": self.name, "settings": self.settings.to_dict(), "baseline": self.baseline,
            "context_gib": self.context_gib,
            "points": [dict({k: v for k, v in p.items() if k not in ("phase_start_bytes",)},
                            device_gib=self.device_gib(p)) for p in self.points],
            "intercept_gib": self.fit.intercept_gib, "slope_gib": self.fit.slope_gib,
            "plateau_gib": self.fit.plateau_gib, "kink_batch": self.fit.kink_batch,
            "fit_note": kink_note(self.fit) if not self.settings.sampling else "",
            "classification": self.classification, "device_mode": self.device_mode,
            "warnings": self.warnings, "seconds": self.seconds,
            "n_params": self.n_params, "n_trainable": self.n_trainable,
        }

    @property
    def unet(self) -> str:
        """Which UNet the curve is of: ``original``, ``slim 0.5`` (at a ratio) or ``slim (ckpt)`` (a slim
        checkpoint's own)."""
        s = self.settings
        return "slim (ckpt)" if s.slim_ranks else f"slim {s.slim_ratio:g}" if s.slim_ratio else "original"

    def format_text(self) -> str:
        s = self.settings
        lines = [f"{self.name}: {s.label()}, {self.n_params:,} UNet parameters  (estimate, fake {self.device_mode}; "
                 f"device = allocator reserve + {self.context_gib:.2f} GiB CUDA context)"]
        for p in self.points:
            top = sorted(p["breakdown_gib"].items(), key=lambda kv: -kv[1])[:4]
            parts = ", ".join(f"{k} {v:.2f}" for k, v in top)
            lines.append(f"  B={p['batch']:<3} peak {p['peak_gib']:6.2f} GiB allocated, device {self.device_gib(p):6.2f} "
                         f"GiB  at {p['phase']:<6} [{parts}]")
        f = self.fit
        if len(self.points) > 1:                      # a line through one point says nothing
            lines.append(f"  fit: {f.intercept_gib:.2f} + {f.slope_gib:.3f}·B GiB"
                         + (f", optimizer-step plateau {f.plateau_gib:.2f} GiB" if f.plateau_gib else ""))
            if not s.sampling:
                lines.append(f"  {kink_note(f)}")
        if self.classification:
            lines.append(f"  vs {self.baseline}: {self.classification}")
        lines.extend(f"  note: {w}" for w in self.warnings)
        return "\n".join(lines)


class EstimateCancelled(RuntimeError):
    """The estimate was cancelled: its worker process was stopped before it finished."""


def run_worker(jobs, *, timeout=None, echo_progress=False, env=None, on_progress=None, cancel=None) -> list:
    """Run ``[(name, Settings, batch_sizes)]`` in one worker process; returns its raw JSON results.

    ``on_progress(line)`` receives each line the worker writes to stderr (one per measured point, e.g.
    ``"  estimate: B=2 peak 2.22 GiB (bwd)"``); ``echo_progress`` copies them to this process's stderr.
    Setting ``cancel`` (a ``threading.Event``) stops the worker and raises :class:`EstimateCancelled`;
    ``timeout`` seconds stop it with ``subprocess.TimeoutExpired``.
    """
    request = {"jobs": [{"name": n, "settings": s.to_dict(), "batch_sizes": list(b)} for n, s, b in jobs]}
    cmd = [sys.executable, "-c", _LAUNCH.format(root=_PACKAGE_ROOT)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ if env is None else env))
    tail, stdout = collections.deque(maxlen=200), []

    def pump_stderr():
        for line in proc.stderr:
            tail.append(line)
            if echo_progress:
                sys.stderr.write(line)
                sys.stderr.flush()
            if on_progress is not None:
                on_progress(line.rstrip("\n"))

    readers = [threading.Thread(target=pump_stderr, daemon=True),
               threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.stdin.write(json.dumps(request))
        proc.stdin.close()
    except BrokenPipeError:  # the worker died at start; its stderr says why
        pass
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            stop = EstimateCancelled("estimate cancelled") if cancel is not None and cancel.is_set() else None
            if stop is None and deadline is not None and time.monotonic() > deadline:
                stop = subprocess.TimeoutExpired(cmd, timeout)
            if stop is not None:
                proc.kill()
                proc.wait()
                for t in readers:
                    t.join()
                raise stop from None
    for t in readers:
        t.join()
    results = [json.loads(line) for line in "".join(stdout).splitlines() if line.startswith("{")]
    if proc.returncode or len(results) != len(jobs):
        raise RuntimeError(f"estimate worker failed (exit {proc.returncode}): {''.join(tail)[-2000:]}")
    return results


def _result(raw, settings, baseline="", context_gib=None) -> EstimateResult:
    if "error" in raw:
        raise RuntimeError(f"estimate {raw['name']!r} failed: {raw['error']}")
    return EstimateResult(name=raw["name"], settings=settings, points=raw["points"], fit=fit_curve(raw["points"]),
                          device_mode=raw["device_mode"], warnings=raw["warnings"], baseline=baseline,
                          seconds=raw["seconds"], n_params=raw["n_params"], n_trainable=raw["n_trainable"],
                          context_gib=DEFAULT_CONTEXT_GIB if context_gib is None else context_gib)


def estimate(settings: Settings, batch_sizes=(1, 2, 4, 8), context_gib=None, **worker_kw) -> EstimateResult:
    """Estimated peak VRAM of one training (or sampling) step per batch size (``context_gib``: the device's CUDA
    context for the device peak; default :data:`~.allocator.DEFAULT_CONTEXT_GIB`)."""
    return _result(run_worker([("estimate", settings, batch_sizes)], **worker_kw)[0], settings, "", context_gib)


def estimate_many(entries, batch_sizes=(1, 2, 4, 8), context_gib=None, **worker_kw) -> list:
    """``[(name, Settings, baseline_name[, batch_sizes])]`` -> [EstimateResult] from one worker process,
    each classified against its baseline's fit (when both have two or more batch sizes)."""
    raws = run_worker([(e[0], e[1], e[3] if len(e) > 3 else batch_sizes) for e in entries], **worker_kw)
    results = [_result(r, e[1], e[2], context_gib) for r, e in zip(raws, entries)]
    by_name = {r.name: r for r in results}
    for r in results:
        base = by_name.get(r.baseline)
        if base is not None and base is not r and min(len(base.points), len(r.points)) > 1:
            r.classification = classify(base.fit, r.fit)
    return results


def estimate_matrix(spec="all", batch_sizes=(1, 2, 4, 8), context_gib=None, **worker_kw) -> list:
    """The seed study's matrix (see ``settings.MATRIX``) on fake tensors."""
    return estimate_many(select_matrix(spec), batch_sizes, context_gib, **worker_kw)


def estimate_sampling(settings: Settings, batch_sizes=(1,), context_gib=None, **worker_kw) -> list:
    """Sampling peak of the original UNet and, when ``settings.slim_ratio`` is set, of the slim one (of a slim
    checkpoint's ``settings.slim_ranks``: that slim UNet alone)."""
    from dataclasses import replace
    first = "slim" if settings.slim_ranks else "original"
    jobs = [(first, replace(settings, sampling=True, slim_ratio=0.0), first)]
    if settings.slim_ratio:
        jobs.append((f"slim-{settings.slim_ratio:g}", replace(settings, sampling=True), "original"))
    return estimate_many(jobs, batch_sizes, context_gib, **worker_kw)
