"""Weight-storage round trips: what users pick instead of (or on top of) a slim UNet, for side-by-side fidelity.

- ``fp8``: float8_e4m3fn storage, as ComfyUI's ``--fp8_e4m3fn-unet`` / "weight_dtype fp8_e4m3fn": every weight
  with two or more dimensions is cast to fp8 and back (no scale); biases and norms stay 16-bit.
- ``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``: a GGUF file of that type as sdslim writes it and ComfyUI-GGUF
  loads it, in memory: :func:`sdslim_core.io.gguf.round_trip` (the writer's per-tensor rules and the gguf package's
  own quantiser and dequantiser; small and 1-D tensors stay F32).

A round trip returns the dequantised tensor in the input's dtype; :func:`storage_bytes` gives the weight bytes;
:func:`exact_dtype` tells which 16-bit dtype a model held wider was stored in.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from ..io import gguf

GGUF_METHODS = tuple(q.lower() for q in gguf.QUANT_TYPES)        # q8_0, q5_1, q5_0, q4_1, q4_0
METHODS = ("fp8",) + GGUF_METHODS


def fp8(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn storage round trip of a weight (tensors with fewer than two dimensions are left alone)."""
    if t.dim() < 2:
        return t
    return t.detach().to(torch.float8_e4m3fn).to(t.dtype)


def _check(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown quantisation {method!r}; expected one of {METHODS}")


def round_trip(weights: Mapping[str, torch.Tensor], method: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``weights`` through ``method``'s storage and back (same keys, dtypes and shapes)."""
    _check(method)
    if method == "fp8":
        return {k: fp8(v) for k, v in weights.items()}
    return {k: gguf.round_trip(v, method.upper()) for k, v in weights.items()}


def tensor_bytes(t: torch.Tensor, method: str | None) -> int:
    """Bytes ``t`` takes when stored with ``method`` (``None``: float16)."""
    if method is None:
        return 2 * t.numel()
    _check(method)
    if method == "fp8":
        return t.numel() if t.dim() >= 2 else 2 * t.numel()
    return gguf.tensor_bytes(t.shape, method.upper())


def exact_dtype(weights: Iterable[torch.Tensor], candidates: tuple = (torch.float16, torch.bfloat16),
                sample: int = 4096) -> torch.dtype | None:
    """The first of ``candidates`` that holds every floating-point tensor of ``weights`` exactly (each checked on
    its first ``sample`` values), or None. A checkpoint stored in fp16 and loaded as float32 is still exactly
    fp16: this finds the dtype it was stored in; trained float32 weights are exact in neither."""
    heads = [t.detach().reshape(-1)[:sample] for t in weights if t.is_floating_point() and t.numel()]
    if not heads:
        return None
    for dtype in candidates:
        if all(torch.equal(h.to(dtype).to(h.dtype), h) for h in heads):
            return dtype
    return None


def storage_bytes(weights: Mapping[str, torch.Tensor], method: str | None = None) -> int:
    """Weight bytes of a whole state dict stored with ``method`` (``None``: float16)."""
    return sum(tensor_bytes(v, method) for v in weights.values())
