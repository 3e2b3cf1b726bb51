"""Live memory measurement for the report nodes and ``sdslim vram report``.

- ``memory_report()``: device name, total/free/used (NVML via nvidia-ml-py, else
  ``torch.cuda.mem_get_info``), torch allocated/reserved and their peaks; on CPU/MPS system RAM.
- ``measure_peak()``: context manager recording the peak of a block of work: torch's peak and a
  whole-device peak polled from a background thread (what nvidia-smi shows; RSS on CPU).
- ``weights_report()``: weight bytes per model and per UNet component.

Nothing here initialises CUDA on a machine without it; torch's counters are read only once this
process has initialised CUDA itself (reading them would otherwise create a context, ~0.3-0.5 GiB).
All results are dataclasses with ``to_dict()`` and ``format_text()``.
"""
import os
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from ..io.files import GIB

COMPONENTS = ("resnet", "transformer", "feedforward", "downsample", "upsample", "other")


def _gib(n):
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


def _resolve(device):
    """torch.device to report on: the given one, else the current CUDA device, MPS, or CPU."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _nvml_index(index: int):
    """NVML's handle for torch's CUDA index (CUDA_VISIBLE_DEVICES renumbers devices), or None."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # not installed, no driver, or no permission: NVML is optional
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    try:
        if index < len(visible):
            entry = visible[index]
            if entry.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            return pynvml.nvmlDeviceGetHandleByUUID(entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}")
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
        return None


def _nvml_process_bytes(handle):
    import pynvml
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        return None
    used = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None]
    return sum(used) if used else None


def device_used(index: int = 0):
    """Bytes used on CUDA device ``index`` by all processes (NVML, what nvidia-smi shows; torch's
    ``mem_get_info`` once this process has a context), None when neither can be read without creating one."""
    handle = _nvml_index(index)
    if handle is not None:
        import pynvml
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info(index)
        return total - free
    return None


def _ram():
    import psutil
    vm = psutil.virtual_memory()
    return vm.total, vm.available, psutil.Process().memory_info().rss


@dataclass
class MemoryReport:
    device: str  # "cuda:0" | "mps" | "cpu"
    name: str
    source: str  # where total/free come from: "nvml" | "torch.cuda.mem_get_info" | "psutil"
    total_bytes: int | None = None
    free_bytes: int | None = None
    used_bytes: int | None = None  # whole device, all processes (nvidia-smi's "used"); RAM used on CPU
    process_bytes: int | None = None  # this process on the device (NVML; often n/a in containers)
    allocated_bytes: int | None = None  # torch's tensors
    reserved_bytes: int | None = None  # torch's caching allocator
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    process_rss_bytes: int | None = None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format_text(self) -> str:
        lines = [f"{self.device} ({self.name}), totals from {self.source}"]
        if self.device != "cpu":
            lines.append(f"  total {_gib(self.total_bytes)}, free {_gib(self.free_bytes)}, "
                         f"used by all processes {_gib(self.used_bytes)}, by this process {_gib(self.process_bytes)}")
            lines.append(f"  torch allocated {_gib(self.allocated_bytes)} (peak {_gib(self.peak_allocated_bytes)}), "
                         f"reserved {_gib(self.reserved_bytes)} (peak {_gib(self.peak_reserved_bytes)})")
        lines.append(f"  RAM total {_gib(self.ram_total_bytes)}, available {_gib(self.ram_available_bytes)}, "
                     f"this process (RSS) {_gib(self.process_rss_bytes)}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def memory_report(device=None) -> MemoryReport:
    """What the device holds now. ``device``: 'cuda', 'cuda:1', 'mps', 'cpu' or None (the best one)."""
    device = _resolve(device)
    ram_total, ram_avail, rss = _ram()
    common = dict(ram_total_bytes=ram_total, ram_available_bytes=ram_avail, process_rss_bytes=rss)
    if device.type == "cpu":
        return MemoryReport("cpu", "CPU", "psutil", total_bytes=ram_total, free_bytes=ram_avail,
                            used_bytes=ram_total - ram_avail,
                            notes=["no CUDA/MPS device: models run from system RAM"], **common)
    if device.type == "mps":
        rep = MemoryReport("mps", "Apple MPS (unified memory)", "psutil", total_bytes=ram_total,
                           free_bytes=ram_avail, used_bytes=ram_total - ram_avail,
                           allocated_bytes=torch.mps.current_allocated_memory(),
                           reserved_bytes=torch.mps.driver_allocated_memory(), **common)
        rep.notes.append("MPS shares system RAM; torch has no peak counters on MPS")
        return rep
    if device.type != "cuda":       # XPU, DirectML and others: no counters sdslim reads; RAM only, said so
        return MemoryReport(str(device), device.type.upper(), "psutil",
                            notes=[f"no memory counters for {device.type} devices here: RAM only"], **common)
    rep = MemoryReport(str(device), "", "nvml", **common)
    handle = _nvml_index(device.index)
    if handle is not None:
        import pynvml
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        rep.name = name.decode() if isinstance(name, bytes) else name
        rep.total_bytes, rep.free_bytes, rep.used_bytes = info.total, info.free, info.used
        rep.process_bytes = _nvml_process_bytes(handle)
    else:
        rep.source = "torch.cuda.mem_get_info"
        rep.name = torch.cuda.get_device_name(device)
        free, total = torch.cuda.mem_get_info(device)
        rep.total_bytes, rep.free_bytes, rep.used_bytes = total, free, total - free
        rep.notes.append("NVML unavailable (pip install nvidia-ml-py): totals from torch, which created a "
                         "CUDA context if there was none")
    if torch.cuda.is_initialized():
        rep.allocated_bytes = torch.cuda.memory_allocated(device)
        rep.reserved_bytes = torch.cuda.memory_reserved(device)
        rep.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
        rep.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
    else:
        rep.notes.append("this process has not used CUDA yet: torch counters n/a")
    return rep


@dataclass
class PeakResult:
    device: str
    seconds: float
    samples: int  # background polls of the whole-device (or RSS) usage
    torch_start_allocated_bytes: int | None = None
    torch_peak_allocated_bytes: int | None = None
    torch_peak_reserved_bytes: int | None = None
    device_start_used_bytes: int | None = None  # whole device before the block (NVML), RSS on CPU/MPS
    device_peak_used_bytes: int | None = None  # max polled during the block
    source: str | None = None  # what was polled: "nvml" | "torch.cuda.mem_get_info" | "rss" | None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format_text(self) -> str:
        what = "whole device (as nvidia-smi)" if self.device.startswith("cuda") else "process RSS"
        lines = [f"peak over {self.seconds:.2f} s on {self.device}:",
                 f"  torch allocated {_gib(self.torch_peak_allocated_bytes)} "
                 f"(from {_gib(self.torch_start_allocated_bytes)}), reserved {_gib(self.torch_peak_reserved_bytes)}",
                 f"  {what} {_gib(self.device_peak_used_bytes)} (from {_gib(self.device_start_used_bytes)}, "
                 f"{self.samples} samples)"]
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


class measure_peak:  # noqa: N801  (used as a context manager, like torch.no_grad)
    """``with measure_peak('cuda') as m: work()`` then ``m.result`` (a PeakResult).

    On CUDA it resets torch's peak counters at entry (process-wide: other code reading
    ``max_memory_allocated`` sees the reset) and polls NVML every ``interval`` seconds."""

    def __init__(self, device=None, interval: float = 0.01):
        self.device = _resolve(device)
        self.interval = interval
        self.result = None
        self._stop = threading.Event()
        self._peak = None
        self._samples = 0

    def _poll_fn(self):
        """(poll function or None, source name, note or None)."""
        if self.device.type == "cuda":
            handle = _nvml_index(self.device.index)
            if handle is not None:
                import pynvml
                return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used, "nvml", None
            if torch.cuda.is_initialized():
                return (lambda: (lambda f, t: t - f)(*torch.cuda.mem_get_info(self.device)),
                        "torch.cuda.mem_get_info", "NVML unavailable: whole-device usage from torch.cuda.mem_get_info")
            return None, None, "NVML unavailable and CUDA not initialised: no whole-device polling"
        import psutil
        proc = psutil.Process()
        return (lambda: proc.memory_info().rss), "rss", None

    def _run(self, poll):
        while not self._stop.is_set():
            value = poll()
            self._samples += 1
            self._peak = value if self._peak is None else max(self._peak, value)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._t0 = time.perf_counter()
        self.result = PeakResult(str(self.device), 0.0, 0)
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.result.torch_start_allocated_bytes = torch.cuda.memory_allocated(self.device)
        poll, self.result.source, note = self._poll_fn()
        if note:
            self.result.notes.append(note)
        self._thread = None
        self._poll = poll
        if poll is not None:
            self.result.device_start_used_bytes = self._peak = poll()
            self._thread = threading.Thread(target=self._run, args=(poll,), daemon=True)
            self._thread.start()
        return self

    def poll_now(self):
        """The polled quantity now (whole-device bytes used, or RSS), None without a source."""
        return None if self._poll is None else self._poll()

    def __exit__(self, *exc):
        cuda = self.device.type == "cuda" and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize(self.device)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        r = self.result
        r.seconds, r.samples, r.device_peak_used_bytes = time.perf_counter() - self._t0, self._samples, self._peak
        if cuda:
            r.torch_peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
            r.torch_peak_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        return False


@dataclass
class ModelWeights:
    name: str
    params: int
    total_bytes: int
    by_dtype: dict  # "torch.float16" -> bytes
    by_device: dict  # "cuda:0" / "cpu" -> bytes (offloaded weights show up under cpu)
    components: dict | None = None  # UNet only: resnet/transformer/feedforward/downsample/upsample/other -> bytes


@dataclass
class WeightsReport:
    models: list
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format_text(self) -> str:
        lines = []
        for m in self.models:
            devices = ", ".join(f"{k} {_gib(v)}" for k, v in m.by_device.items())
            dtypes = ", ".join(f"{k.replace('torch.', '')} {_gib(v)}" for k, v in m.by_dtype.items())
            lines.append(f"{m.name}: {m.params / 1e6:.1f}M params, {_gib(m.total_bytes)} [{dtypes}] on {devices}")
            if m.components:
                lines.append("  " + ", ".join(f"{k} {_gib(v)}" for k, v in m.components.items() if v))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def unet_components(module):
    """Weight bytes per UNet component, classified by ``sdslim_core.ops.breakdown.classify_key`` on the
    canonical keys; "feedforward" is the GEGLU FF inside transformer blocks (not also counted in
    "transformer"). Raises ImportError/ValueError when the classifier or the key mapping is missing."""
    from sdslim_core import layout
    from sdslim_core.ops import breakdown
    canonical = layout.to_canonical(dict(module.named_parameters()))[0]
    out = dict.fromkeys(COMPONENTS, 0)
    for key, t in canonical.items():
        kind, is_ff = breakdown.classify_key(key)
        out["feedforward" if is_ff else kind] += t.numel() * t.element_size()
    return out


def weights_report(models: dict, unet_names=("unet",)) -> WeightsReport:
    """``models``: {"unet": module, "text_encoder": module, ...}. Components for ``unet_names``."""
    report = WeightsReport([])
    for name, module in models.items():
        by_dtype, by_device = defaultdict(int), defaultdict(int)
        params = total = 0
        for p in module.parameters():
            nbytes = p.numel() * p.element_size()
            params, total = params + p.numel(), total + nbytes
            by_dtype[str(p.dtype)] += nbytes
            by_device[str(p.device)] += nbytes
        entry = ModelWeights(name, params, total, dict(by_dtype), dict(by_device))
        if name in unet_names:
            try:
                entry.components = unet_components(module)
            except (ImportError, ValueError, KeyError) as err:
                report.notes.append(f"{name}: no component breakdown ({type(err).__name__}: {err})")
        report.models.append(entry)
    return report
