"""Rank and GroupNorm policy of slim sites (torch-free).

GroupNorm rule (:func:`res_groups`): every SD ResBlock's ``norm2`` has 32 groups, so a c-wide site has groups of
c/32 channels. A Res bottleneck keeps whole groups (its rank is a multiple of c/32 and its norm has rank/(c/32)
groups): kept channels are then normalised over exactly the channels the teacher normalises them with.

Tensor-core rule (:func:`rank_step`): fp16/bf16 tensor cores take GEMM and convolution dimensions in multiples of 8
(16 bytes); a narrower or odd dimension is padded or runs a slower kernel. Ranks are therefore multiples of 8 too
(for Res: of lcm(8, c/32), e.g. 40 at every SD ResBlock width) wherever the width holds at least
``MIN_TILED_STEPS`` such steps, which every SD1.x/2.x/XL site does (the smallest, a 320-wide ResBlock, has 8).
"""
from __future__ import annotations

import math
from typing import Iterable

from .. import layout

DEFAULT_GROUPS = 32                   # GroupNorm groups of every SD1.x/2.x/XL ResBlock norm2
TENSOR_TILE = 8                       # fp16/bf16 tensor cores: GEMM/conv dimensions in multiples of 8 elements
MIN_TILED_STEPS = 8                   # tile ranks only where the width holds at least this many rank steps


def norm_groups_for(rank: int, preferred: int = DEFAULT_GROUPS) -> int:
    """GroupNorm groups for a bottleneck of width ``rank``: the largest divisor of ``rank`` ≤ ``preferred``."""
    return max(g for g in range(1, min(preferred, rank) + 1) if rank % g == 0)


def group_size(width: int) -> int:
    """Channels per ``norm2`` group of a ``width``-wide ResBlock (1 when 32 does not divide the width)."""
    return width // DEFAULT_GROUPS if width % DEFAULT_GROUPS == 0 else 1


def res_groups(width: int, rank: int) -> int:
    """GroupNorm groups of a Res bottleneck of ``rank`` channels at a ``width``-wide site: whole teacher groups
    (``rank / group_size``) when the rank allows it, else the largest divisor of the rank ≤ 32."""
    k = group_size(width)
    return rank // k if rank % k == 0 else norm_groups_for(rank)


def rank_step(width: int, kind: str) -> int:
    """The multiple a site's ranks are rounded to: whole ``norm2`` groups for Res (``group_size(width)``), and a
    multiple of ``TENSOR_TILE`` as well (the lcm of the two) where the width is a multiple of that and holds at
    least ``MIN_TILED_STEPS`` of it (narrower widths, e.g. the tiny test models', keep the finer grid)."""
    k = group_size(width) if kind == "res" else 1
    tiled = math.lcm(k, TENSOR_TILE)
    return tiled if width % tiled == 0 and width // tiled >= MIN_TILED_STEPS else k


def rank_for_ratio(width: int, ratio: float, kind: str) -> int:
    """Bottleneck width for a width fraction, rounded to the nearest multiple of :func:`rank_step` (at least one
    step): Res ranks are whole ``norm2`` groups, so the bottleneck can keep the teacher's normalisation, and ranks
    at SD's widths are tensor-core tiles (320 × 3/16 = 60 becomes 80)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    step = rank_step(width, kind)
    return min(width, step * max(1, int(round(width * ratio / step))))


def ranks_for_ratio(site_list: Iterable[layout.Site], ratio: float | None = None, ff_ratio: float | None = None,
                    res_ratio: float | None = None) -> dict[str, int]:
    """Uniform width fractions, with optional per-kind overrides; a kind whose ratio is 1 keeps full width
    (its sites are still listed, so they fold to identity only when the adapter is the identity)."""
    out = {}
    for s in site_list:
        r = ff_ratio if s.kind == "ff" else res_ratio
        r = ratio if r is None else r
        if r is None:
            continue
        out[s.name] = rank_for_ratio(s.width, r, s.kind)
    return out


def fit_groups(channels: int, groups: int) -> int:
    """``groups`` when it divides ``channels``, else :func:`norm_groups_for` (a resized GroupNorm's groups)."""
    return groups if channels % groups == 0 else norm_groups_for(channels)


def aligned_rank(width: int, rank: int, kind: str, multiple: int = 64) -> int:
    """``rank`` rounded to the nearest multiple of ``multiple`` (GPU matrix units work in tiles of 64/128; a
    bottleneck of 400 runs as one of 448 or 512), within [that multiple, ``width``]. A Res rank also stays whole
    ``norm2`` groups (a multiple of ``group_size(width)`` too); where no such multiple up to the rank exists, the
    next smaller power-of-two ``multiple`` (down to 8) is tried, and the rank is kept when none fits."""
    m = multiple
    while m >= 8:
        step = m if kind == "ff" else math.lcm(m, group_size(width))
        if step <= rank:
            return min(width, max(step, step * int(rank / step + 0.5)))
        m //= 2
    return rank
