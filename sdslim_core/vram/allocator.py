"""What ``nvidia-smi`` shows for a traced step: PyTorch's CUDA caching allocator replayed on the estimator's
allocation trace, plus the CUDA context (torch-free).

The estimator counts live tensor bytes (torch's *allocated* peak). The device holds more: the caching allocator
takes memory from the driver in *segments* and keeps it (torch's *reserved* memory) after tensors die, and a freed
block can only be reused by a request that fits in it, so the reserve grows past the live bytes when sizes change
from step to step. :class:`CachingAllocator` is a model of the native allocator with its default settings
(``c10/cuda/CUDACachingAllocator.cpp``: no ``max_split_size_mb``, no expandable segments, one stream):

- a request is rounded up to 512 B; requests up to 1 MiB come from the *small* pool (2 MiB segments), larger ones
  from the *large* pool (a 20 MiB segment below 10 MiB, else the request rounded up to 2 MiB);
- the smallest cached free block that fits is used (best fit, lowest address on ties) and split when the rest is
  at least 512 B (small pool) or more than 1 MiB (large pool);
- a freed block merges with free neighbours of its segment; segments go back to the driver only on
  ``empty_cache`` or when a new segment would pass the device's limit (then every fully free segment is released
  and the request retried; out of memory if it still does not fit).

The device peak of a step is then ``context + reserved peak``, where the *context* is what a process using CUDA
holds besides the allocator's segments (the CUDA context, cuBLAS/cuDNN handles, loaded kernels): a per-device,
per-driver quantity, measured (``live.measure_context``) and passed in, never fitted.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math

MIN_BLOCK = 512                 # kMinBlockSize: every request is a multiple of this
SMALL_SIZE = 1 << 20            # kSmallSize: requests up to this come from the small pool
SMALL_BUFFER = 2 << 20          # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc: large requests below this get a LARGE_BUFFER segment
LARGE_BUFFER = 20 << 20         # kLargeBuffer
ROUND_LARGE = 2 << 20           # kRoundLarge: larger segments are rounded up to this

GIB = 2 ** 30
# The CUDA context when none was measured for the device at hand: what NVML showed beyond torch's reserve on the
# project's first GPU (NVIDIA H200, driver 580, torch 2.11+cu130), the same 1.36-1.37 GiB at all 16 training
# points of bench/RESULTS.md's first GPU run (the driver's own reservation on that card included). A consumer
# card's is usually smaller, so a fit check with this default errs on the safe side; measure yours with
# ``sdslim vram context`` (or pass the GPU suite's environment part's figure).
DEFAULT_CONTEXT_GIB = 1.36


def round_size(nbytes: int) -> int:
    """A request's size in the allocator: at least 512 B, rounded up to a multiple of 512 B."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * math.ceil(nbytes / MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes of the segment a rounded request of ``size`` takes from the driver when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


class OutOfMemory(MemoryError):
    """A request did not fit under the device limit even with every cached segment released."""


@dataclasses.dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    segment: int
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None

    def key(self):
        return (self.size, self.addr)


class CachingAllocator:
    """The caching allocator's bookkeeping (no memory): ``malloc(nbytes) -> block``, ``free(block)``,
    ``empty_cache()``; ``allocated``/``reserved`` and their peaks in bytes. ``limit``: the bytes the allocator may
    take from the device (None: unlimited, as on a large GPU)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.pools = {True: [], False: []}          # small? -> sorted [(size, addr, block)] of free blocks
        self.segments = {}                          # id -> (first block, size)
        self._ids = itertools.count()
        self._next_addr = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    # -- pools --------------------------------------------------------------------------------------------
    def _insert(self, b: _Block):
        bisect.insort(self.pools[b.small], (b.size, b.addr, b))

    def _remove(self, b: _Block):
        pool = self.pools[b.small]
        i = bisect.bisect_left(pool, (b.size, b.addr))
        while pool[i][2] is not b:
            i += 1
        del pool[i]

    def _best_fit(self, size: int, small: bool):
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        return pool[i][2] if i < len(pool) else None

    # -- segments -----------------------------------------------------------------------------------------
    def _new_segment(self, size: int, small: bool) -> _Block | None:
        if self.limit is not None and self.reserved + size > self.limit:
            return None
        seg = next(self._ids)
        block = _Block(self._next_addr, size, small, seg)
        self._next_addr += size + ROUND_LARGE          # distinct, increasing addresses (cudaMalloc's order)
        self.segments[seg] = (block, size)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def empty_cache(self):
        """``torch.cuda.empty_cache()``: every segment with no live block goes back to the driver."""
        for seg, (first, size) in list(self.segments.items()):
            if first.free and first.next is None and first.size == size:
                self._remove(first)
                del self.segments[seg]
                self.reserved -= size

    # -- the allocator's calls ----------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is not None:
            self._remove(block)
        else:
            block = self._new_segment(segment_size(size), small)
            if block is None:
                self.empty_cache()                      # release_cached_blocks(), then one more try
                block = self._new_segment(segment_size(size), small)
            if block is None:
                raise OutOfMemory(f"{size} B did not fit: {self.reserved} B reserved of a {self.limit} B limit")
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(block.addr + size, rest, small, block.segment, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block):
        block.free = True
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove(other)
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        self._insert(block)

    def reset_peaks(self):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def replay(allocator: CachingAllocator, events, live: dict | None = None) -> dict:
    """Apply an allocation trace: ``events`` are ``(+1, key, nbytes)`` and ``(-1, key)``; ``live`` maps the keys
    alive before the trace to their blocks (updated in place; a free of an unknown key is ignored: its storage
    predates the trace). Returns ``live``."""
    live = {} if live is None else live
    for ev in events:
        if ev[0] > 0:
            if ev[1] not in live:
                live[ev[1]] = allocator.malloc(ev[2])
        else:
            block = live.pop(ev[1], None)
            if block is not None:
                allocator.free(block)
    return live


def step_reserve(setup, step, repeats: int = 2, limit: int | None = None) -> dict:
    """Bytes the allocator holds for a step run ``repeats`` times after ``setup`` (model build, casts, optimizer
    states) and an ``empty_cache()``, as the GPU study runs a point: ``{"allocated", "reserved"}`` peaks over the
    steps (bytes). Keys a step allocates are renamed per repeat so that the repeats are independent; keys from
    ``setup`` keep their blocks."""
    allocator = CachingAllocator(limit)
    live = replay(allocator, setup)
    allocator.empty_cache()
    allocator.reset_peaks()
    before = set(live)
    for r in range(repeats):
        renamed = [(e[0], e[1] if e[1] in before else (r, e[1])) + tuple(e[2:]) for e in step]
        replay(allocator, renamed, live)
    return {"allocated": allocator.peak_allocated, "reserved": allocator.peak_reserved}
