"""``LiveTracker``: a TorchDispatchMode that counts the bytes of live (fake) storages on one device.

Each storage an op returns is counted once, rounded up to 512 B (the CUDA caching allocator's
smallest block), and subtracted by a weakref callback when it dies. Storages are tagged with a
category when first seen (by phase: fwd -> "act", bwd -> "bwd_tmp", opt -> "opt_tmp") and re-tagged
for gradients and optimizer states. The peak, the per-phase peaks and the category breakdown at
the peak are kept. With an :class:`AllocationTrace`, every storage's creation and death is also recorded in order
(what ``allocator.step_reserve`` replays to model the caching allocator's reserve).
"""
import math
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

ROUND = 512
PHASE_CATEGORY = {"fwd": "act", "bwd": "bwd_tmp", "opt": "opt_tmp", "sample": "act"}


def rounded(nbytes: int) -> int:
    """Bytes a storage of ``nbytes`` occupies in the caching allocator (512-B granularity)."""
    return math.ceil(nbytes / ROUND) * ROUND


class AllocationTrace:
    """Storage births and deaths in order, shared by the trackers of one process: ``events`` holds
    ``(+1, key, bytes)`` and ``(-1, key)``; a storage keeps its key across trackers."""

    def __init__(self):
        self.events = []
        self._keys = WeakIdKeyDictionary()
        self._next = 0

    def born(self, storage, nbytes: int) -> int:
        key = self._keys.get(storage)
        if key is None:
            key = self._keys[storage] = self._next
            self._next += 1
            self.events.append((1, key, nbytes))
        return key

    def died(self, key: int):
        self.events.append((-1, key))


class LiveTracker(TorchDispatchMode):
    def __init__(self, device_type: str = "cuda", trace: AllocationTrace | None = None):
        super().__init__()
        self.device_type = device_type
        self.trace = trace
        self._seen = WeakIdKeyDictionary()  # storage -> (record, weakref keeping the callback alive)
        self.by_cat = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.peak_breakdown = {}
        self.peak_phase = None
        self.peak_op = None
        self.phase = "init"
        self.phase_peak = defaultdict(int)
        self.phase_start = {}  # phase -> {category: bytes} when the phase began

    def _free(self, record):
        self.current -= record[0]
        self.by_cat[record[1]] -= record[0]
        if self.trace is not None:
            self.trace.died(record[2])

    def track(self, t, category: str, op: str = None):
        """Count ``t``'s storage under ``category`` unless it is already counted."""
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
            return
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        record = [rounded(storage.nbytes()), category]
        if self.trace is not None:
            record.append(self.trace.born(storage, storage.nbytes()))
        self._seen[storage] = (record, weakref.ref(storage, lambda _r, rec=record: self._free(rec)))
        self.current += record[0]
        self.by_cat[category] += record[0]
        self._update_peak(op)

    def retag(self, t, category: str):
        """Move ``t``'s storage to ``category`` (tracking it if new)."""
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
            return
        entry = self._seen.get(t.untyped_storage())
        if entry is None:
            self.track(t, category)
            return
        record = entry[0]
        if record[1] != category:
            self.by_cat[record[1]] -= record[0]
            self.by_cat[category] += record[0]
            record[1] = category

    def _update_peak(self, op=None):
        if self.current > self.phase_peak[self.phase]:
            self.phase_peak[self.phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_breakdown = {k: v for k, v in self.by_cat.items() if v}
            self.peak_phase, self.peak_op = self.phase, op

    def set_phase(self, phase: str):
        self.phase = phase
        self.phase_start[phase] = {k: v for k, v in self.by_cat.items() if v}
        self._update_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = PHASE_CATEGORY.get(self.phase, self.phase)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t, category, func.__name__)
        return out

    # -- helpers for the step runner ------------------------------------------------------------
    def track_module(self, module):
        for p in module.parameters():
            self.track(p, "param" if p.requires_grad else "frozen")
        for b in module.buffers():
            self.track(b, "buffer")

    def hook_grads(self, params):
        """Re-tag each ``.grad`` as "grad" once autograd has accumulated it."""
        return [p.register_post_accumulate_grad_hook(lambda p: self.retag(p.grad, "grad"))
                for p in params if p.requires_grad]

    def tag_optimizer_state(self, optimizer):
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.retag(v, "opt_state")
