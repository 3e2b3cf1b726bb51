"""The caching-allocator model (sdslim_core/vram/allocator.py) against the native allocator's documented rules,
worked out by hand for small traces; the GPU suite's GGUF codec against the gguf package; rank alignment."""
import math
import sys
from pathlib import Path

import pytest
import torch

from sdslim_core.layout import rank_policy
from sdslim_core.vram import allocator
from sdslim_core.vram.allocator import CachingAllocator, OutOfMemory, replay, step_reserve

MIB = 1 << 20


def test_sizes_follow_the_native_rounding_and_segment_rules():
    assert allocator.round_size(1) == 512 and allocator.round_size(513) == 1024
    assert allocator.segment_size(MIB) == 2 * MIB                 # small pool: 2 MiB segments
    assert allocator.segment_size(MIB + 512) == 20 * MIB          # large request below 10 MiB: a 20 MiB segment
    assert allocator.segment_size(11 * MIB) == 12 * MIB           # else rounded up to 2 MiB


def test_small_blocks_share_a_segment_and_large_ones_split_only_past_1mib():
    a = CachingAllocator()
    small = [a.malloc(1000) for _ in range(4)]                    # 4 × 1024 B in one 2 MiB small segment
    assert a.reserved == 2 * MIB and a.allocated == 4 * 1024
    big = a.malloc(3 * MIB)                                       # a 20 MiB segment, the 17 MiB rest kept free
    assert a.reserved == 22 * MIB
    second = a.malloc(16 * MIB)                                   # fits the 17 MiB rest: no new segment
    assert a.reserved == 22 * MIB and second.segment == big.segment
    third = a.malloc(600 * 1024)                                  # small: the small segment's free rest
    assert third.segment == small[0].segment
    # a large block is not split when the rest would be 1 MiB or less: the whole block is handed out
    b = CachingAllocator()
    blk = b.malloc(19 * MIB + 512)
    assert blk.size == 20 * MIB and b.allocated == 20 * MIB


def test_freed_neighbours_merge_and_empty_cache_returns_whole_free_segments():
    a = CachingAllocator()
    x, y = a.malloc(4 * MIB), a.malloc(4 * MIB)                   # both in one 20 MiB segment
    keep = a.malloc(30 * MIB)                                     # its own 30 MiB segment
    a.free(x)
    a.free(y)                                                     # x, y and the 12 MiB rest merge back to 20 MiB
    assert a.malloc(20 * MIB).segment == x.segment                # best fit: the merged block, no new segment
    assert a.reserved == 50 * MIB
    a.free(keep)
    a.empty_cache()
    assert a.reserved == 20 * MIB                                 # the live 20 MiB block's segment stays


def test_fragmentation_grows_the_reserve_past_the_live_peak():
    """Two 6 MiB tensors each get a 20 MiB segment's head; once one dies, a 16 MiB request fits its 20 MiB hole
    after merging, but a 30 MiB one needs a new segment although 14 + 20 MiB are free."""
    a = CachingAllocator()
    t1 = a.malloc(6 * MIB)
    t2 = a.malloc(6 * MIB)                  # same segment: 6 + 6 used, 8 MiB free rest
    a.free(t1)
    big = a.malloc(30 * MIB)
    assert a.reserved == 50 * MIB and a.peak_allocated == 36 * MIB
    assert big.segment != t2.segment


def test_a_device_limit_releases_cached_segments_then_runs_out_of_memory():
    a = CachingAllocator(limit=40 * MIB)
    x = a.malloc(30 * MIB)
    a.free(x)                                                      # 30 MiB cached
    y = a.malloc(36 * MIB)                                         # needs the cache released first
    assert a.reserved == 36 * MIB and y.size == 36 * MIB
    with pytest.raises(OutOfMemory):
        a.malloc(6 * MIB)                                          # a 20 MiB segment would pass 40 MiB


def test_step_reserve_replays_the_setup_then_repeats_the_step_from_an_emptied_cache():
    setup = [(1, "w", 12 * MIB), (1, "tmp", 30 * MIB), (-1, "tmp")]     # the build's temporary is released
    step = [(1, "act", 8 * MIB), (1, "w", 12 * MIB), (-1, "act")]       # "w" predates the step: not allocated twice
    r = step_reserve(setup, step, repeats=2)
    assert r["allocated"] == 12 * MIB + 8 * MIB
    assert r["reserved"] == 12 * MIB + 20 * MIB                          # w's segment + one 20 MiB for act, reused
    live = replay(CachingAllocator(), [(-1, "never-born"), (1, "a", 100)])
    assert list(live) == ["a"]                                            # a death before the trace is ignored


def test_aligned_rank_keeps_whole_groups_and_stays_within_the_width():
    assert rank_policy.aligned_rank(1280, 400, "ff") == 384
    assert rank_policy.aligned_rank(5120, 2560, "ff") == 2560
    assert rank_policy.aligned_rank(320, 160, "res") == 160               # groups of 10: 64-multiples impossible
    assert rank_policy.aligned_rank(1280, 360, "res") == 320             # groups of 40: multiples of 320
    for width, rank, kind in ((1280, 400, "ff"), (640, 240, "res"), (32, 5, "ff"), (64, 30, "res")):
        r = rank_policy.aligned_rank(width, rank, kind)
        assert 1 <= r <= width
        if kind == "res":
            assert r % rank_policy.group_size(width) == 0


def test_the_suites_gguf_codec_reads_the_gguf_packages_blocks():
    """bench/gpu_vram.py keeps weights as GGUF blocks on the GPU and dequantises them per layer: its decoder must
    read exactly what gguf-py (sdslim's writer) stores (rounded once to fp16, the product ComfyUI-GGUF computes), and
    its encoder make the same blocks."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_vram
    from sdslim_core.io import gguf
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    for qtype in ("Q8_0", "Q4_0"):
        p = gguf.plan("w", tuple(w.shape), qtype)
        stored = torch.from_numpy(gguf.encode(w, p).copy()).reshape(-1, gpu_vram._blocks(qtype)[1])
        decoded = gpu_vram.gguf_dequantise(stored, qtype, w.shape, torch.float32)
        assert torch.equal(decoded, gguf.decode(gguf.encode(w, p), qtype, w.shape).half().float())
        ours = gpu_vram.gguf_quantise(w, qtype)
        assert ours.shape == stored.shape and (ours != stored).float().mean() < 0.01   # ties may round apart


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_estimators_gguf_weight_allocates_what_the_dequantiser_does(qtype, dtype):
    """The estimator runs a GGUF UNet with :class:`harness.Dequantised` weights (a memory model, no values): each
    use must allocate, free and peak as the suite's dequantiser (ComfyUI-GGUF's steps, real arithmetic) does,
    counted by the same tracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sdslim_core.vram import harness
    from sdslim_core.vram.tracker import LiveTracker
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_vram
    shape = (640, 320, 3, 3)
    block_bytes = gpu_vram._blocks(qtype)[1]
    blocks = math.prod(shape) // 32
    peaks = []
    with FakeTensorMode():
        stored = torch.empty(blocks, block_bytes, dtype=torch.uint8)
        for dequantise in (lambda: gpu_vram.gguf_dequantise(stored, qtype, shape, dtype),
                           lambda: harness.Dequantised(shape, dtype, stored.numel(), qtype)(stored.reshape(-1))):
            tracker = LiveTracker("cpu")
            tracker.track(stored, "weights")
            with tracker:
                weight = dequantise()
                assert weight.shape == shape and weight.dtype == dtype
                del weight
            peaks.append((tracker.peak, tracker.current))
    assert peaks[0] == peaks[1]
    weight_bytes = math.prod(shape) * dtype.itemsize
    assert peaks[0][0] >= blocks * block_bytes + weight_bytes      # at least the stored bytes and the copy
