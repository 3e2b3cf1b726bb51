"""Procedural dataset for the tiny teacher: coloured shapes on coloured backgrounds, with captions and masks.

Every sample is a pure function of ``(seed, index)``; images are RGB in [0, 1], ``SIZE``×``SIZE``, with
anti-aliased edges (4× supersampling); the mask is the hard shape coverage at pixel resolution. A 3-pixel border
is always background (shapes never reach it), which the tests use to read the background colour back.

``SHIFTS`` are shifted styles of the same captions (a fine-tune's data, for derivative models: ``tools/
make_derivatives.py``): ``pastel`` renders every colour 45 % of the way to white, ``stripes`` darkens every other
4-pixel diagonal band of the background by 40 %. Unshifted batches are unchanged by their existence.
"""
from dataclasses import dataclass

import torch

SIZE = 32
COLOURS = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.75, 0.15),
    "blue": (0.10, 0.20, 0.90),
    "yellow": (0.95, 0.85, 0.10),
    "white": (0.95, 0.95, 0.95),
    "black": (0.05, 0.05, 0.05),
}
SHAPES = ("circle", "square", "triangle", "cross")
SHIFTS = ("pastel", "stripes")
BORDER = 3
_SUPERSAMPLE = 4


@dataclass
class Batch:
    """Images (B,3,H,W) in [0,1], masks (B,1,H,W) in {0,1}, captions, and the labels and geometry behind them."""
    images: torch.Tensor
    masks: torch.Tensor
    captions: list
    shape: torch.Tensor
    fg: torch.Tensor
    bg: torch.Tensor
    cx: torch.Tensor
    cy: torch.Tensor
    r: torch.Tensor


def caption(shape: str, fg: str, bg: str) -> str:
    """The caption for one sample, e.g. ``"a red circle on a blue background"``."""
    return f"a {fg} {shape} on a {bg} background"


def palette() -> torch.Tensor:
    """(len(COLOURS), 3) RGB table in ``COLOURS`` order."""
    return torch.tensor(list(COLOURS.values()))


def shape_masks(shape: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor, size: int = SIZE,
                supersample: int = _SUPERSAMPLE) -> torch.Tensor:
    """Soft coverage (B,1,size,size) of each shape (index into ``SHAPES``) centred at (cx, cy) with half-size r."""
    n = size * supersample
    coords = (torch.arange(n, dtype=torch.float32) + 0.5) / supersample
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    dx = x[None] - cx[:, None, None]
    dy = y[None] - cy[:, None, None]
    rr = r[:, None, None]
    circle = dx.square() + dy.square() <= rr.square()
    square = torch.maximum(dx.abs(), dy.abs()) <= 0.85 * rr
    top = -rr  # apex; base at +0.8 r, half-width r at the base
    triangle = (dy >= top) & (dy <= 0.8 * rr) & (dx.abs() <= (dy - top) / 1.8)
    arm = rr / 3
    cross = ((dx.abs() <= arm) & (dy.abs() <= rr)) | ((dy.abs() <= arm) & (dx.abs() <= rr))
    inside = torch.stack([circle, square, triangle, cross], 1)  # B,4,n,n
    cover = inside.gather(1, shape.view(-1, 1, 1, 1).expand(-1, 1, n, n)).float()
    return torch.nn.functional.avg_pool2d(cover, supersample)


def make_batch(seed: int, index: int, batch_size: int, shift: str | None = None) -> Batch:
    """Batch number ``index`` of the stream seeded by ``seed`` (deterministic, CPU), in the style ``shift`` (one of
    ``SHIFTS``; None: the teachers' own data)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    n_col = len(COLOURS)
    shape = torch.randint(len(SHAPES), (batch_size,), generator=g)
    fg = torch.randint(n_col, (batch_size,), generator=g)
    bg = (fg + torch.randint(1, n_col, (batch_size,), generator=g)) % n_col  # never equal to fg
    r = 6 + 4 * torch.rand(batch_size, generator=g)
    lo, hi = r + BORDER, SIZE - r - BORDER
    cx = lo + (hi - lo) * torch.rand(batch_size, generator=g)
    cy = lo + (hi - lo) * torch.rand(batch_size, generator=g)
    return render(shape, fg, bg, cx, cy, r, shift)


def render(shape: torch.Tensor, fg: torch.Tensor, bg: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor,
           r: torch.Tensor, shift: str | None = None) -> Batch:
    """Render given labels and geometry (all 1-D tensors of equal length) in the style ``shift``."""
    if shift not in (None, *SHIFTS):
        raise ValueError(f"unknown data shift {shift!r}: expected one of {SHIFTS}")
    cover = shape_masks(shape, cx, cy, r)
    pal = palette()
    if shift == "pastel":
        pal = 0.55 * pal + 0.45
    back = pal[bg][:, :, None, None]
    if shift == "stripes":
        i = torch.arange(SIZE)
        band = ((i[:, None] + i[None, :]) // 4 % 2).float()
        back = back * (1 - 0.4 * band)
    images = cover * pal[fg][:, :, None, None] + (1 - cover) * back
    names = list(COLOURS)
    captions = [caption(SHAPES[s], names[f], names[b]) for s, f, b in zip(shape.tolist(), fg.tolist(), bg.tolist())]
    return Batch(images, (cover > 0.5).float(), captions, shape, fg, bg, cx, cy, r)


def nearest_colour(images: torch.Tensor) -> torch.Tensor:
    """(B,H,W) index into ``COLOURS`` of the palette colour nearest to each pixel of (B,3,H,W) images."""
    d = (images[:, None] - palette()[None, :, :, None, None]).square().sum(2)
    return d.argmin(1)


def colour_index(name: str) -> int:
    return list(COLOURS).index(name)
