"""Weight quantisation round trips: what users pick instead of (or on top of) a slim UNet, for side-by-side fidelity.

- ``fp8``: float8_e4m3fn storage, as ComfyUI's ``--fp8_e4m3fn-unet`` / "weight_dtype fp8_e4m3fn": every weight
  with two or more dimensions is cast to fp8 and back (no scale); biases and norms stay 16-bit.
- ``q8_0`` / ``q4_0``: GGUF (llama.cpp) block formats as ComfyUI-GGUF loads them: each row of the flattened weight
  is cut into blocks of 32; Q8_0 stores an fp16 scale ``absmax/127`` and int8 values (34 bytes per block), Q4_0 an
  fp16 scale ``d = x_max/-8`` (x_max: the value of largest magnitude, with its sign) and 4-bit values ``x/d + 8``
  (18 bytes per block). Tensors of at most 1024 elements, 1-D tensors and rows that 32 does not divide stay
  unquantised (float32 and float16 in the file respectively), as in ComfyUI-GGUF's converter.

A round trip returns the dequantised tensor in the input's dtype; :func:`storage_bytes` gives the file bytes.
"""
from __future__ import annotations

from typing import Mapping

import torch

METHODS = ("fp8", "q8_0", "q4_0")
BLOCK = 32
SMALL = 1024                                             # ComfyUI-GGUF's QUANTIZATION_THRESHOLD
_BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}


def _gguf_quantised(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and t.numel() > SMALL and _row(t) % BLOCK == 0


def _row(t: torch.Tensor) -> int:
    """Length of a GGUF row: the innermost dimension of the weight flattened to 2-D (in-features × kernel)."""
    return t[0].numel() if t.dim() >= 2 else t.numel()


def _blocks(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).reshape(-1, BLOCK)


def _fp16(d: torch.Tensor) -> torch.Tensor:
    return d.to(torch.float16).to(torch.float32)


def q8_0(t: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 round trip of one tensor (rows of 32-blocks, fp16 absmax/127 scale, int8 values)."""
    if not _gguf_quantised(t):
        return t
    x = _blocks(t)
    d = x.abs().amax(dim=1, keepdim=True) / 127            # quantised with the float32 scale, stored as fp16
    q = (x * torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)).round()
    return (q * _fp16(d)).reshape(t.shape).to(t.dtype)


def q4_0(t: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 round trip of one tensor (rows of 32-blocks, fp16 scale ``x_max/-8``, 4-bit values)."""
    if not _gguf_quantised(t):
        return t
    x = _blocks(t)
    idx = x.abs().argmax(dim=1, keepdim=True)
    d = x.gather(1, idx) / -8
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    q = (x * inv + 8.5).floor().clamp(0, 15)              # llama.cpp: MIN(15, (int8_t)(x*id + 8.5f))
    return ((q - 8) * _fp16(d)).reshape(t.shape).to(t.dtype)


def fp8(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn storage round trip of a weight (tensors with fewer than two dimensions are left alone)."""
    if t.dim() < 2:
        return t
    return t.detach().to(torch.float8_e4m3fn).to(t.dtype)


ROUND_TRIPS = {"fp8": fp8, "q8_0": q8_0, "q4_0": q4_0}


def round_trip(weights: Mapping[str, torch.Tensor], method: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``weights`` through ``method``'s storage and back (same keys, dtypes and shapes)."""
    if method not in ROUND_TRIPS:
        raise ValueError(f"unknown quantisation {method!r}; expected one of {METHODS}")
    fn = ROUND_TRIPS[method]
    return {k: fn(v) for k, v in weights.items()}


def tensor_bytes(t: torch.Tensor, method: str | None) -> int:
    """Bytes ``t`` takes when stored with ``method`` (``None``: float16)."""
    n = t.numel()
    if method is None:
        return 2 * n
    if method == "fp8":
        return n if t.dim() >= 2 else 2 * n
    if method in _BLOCK_BYTES:
        if _gguf_quantised(t):
            return n // BLOCK * _BLOCK_BYTES[method]
        return 4 * n if t.dim() < 2 or n <= SMALL else 2 * n
    raise ValueError(f"unknown quantisation {method!r}; expected one of {METHODS}")


def storage_bytes(weights: Mapping[str, torch.Tensor], method: str | None = None) -> int:
    """Weight bytes of a whole state dict stored with ``method`` (``None``: float16)."""
    return sum(tensor_bytes(v, method) for v in weights.values())
