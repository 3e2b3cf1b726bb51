"""Reading and writing ``.safetensors`` files: lazily, atomically, with clear errors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Mapping

import torch

from .files import HeaderError, atomic_path, read_raw_header

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class FileFormatError(ValueError):
    """A file is not what it should be; the message names the file and what was expected."""


def _check_path(path) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise FileFormatError(f"{path}: pickle files ({path.suffix}) can run code when loaded and are not read; "
                              "convert it to .safetensors first")
    return path


def read_header(path) -> tuple[dict, dict]:
    """Return ({key: (dtype, shape)}, metadata) from the header alone, without reading any tensor."""
    path = _check_path(path)
    try:
        header, n, size = read_raw_header(path)
    except HeaderError as err:
        raise FileFormatError(f"{path}: {err}") from None
    metadata = header.pop("__metadata__", None) or {}
    entries = {}
    end = 0
    for key, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError):
            raise FileFormatError(f"{path}: tensor {key!r} has an unreadable header entry {info!r}") from None
        entries[key] = (dtype, shape)
    if 8 + n + end > size:
        raise FileFormatError(f"{path}: truncated: tensors need {8 + n + end} bytes, file has {size}")
    return entries, metadata


class LazyStateDict(Mapping):
    """A read-only mapping key → tensor that reads each tensor from disk only when asked for."""

    def __init__(self, path, device: str = "cpu"):
        from safetensors import safe_open
        self.path = _check_path(path)
        self.entries, self.metadata = read_header(self.path)
        self._file = safe_open(str(self.path), framework="pt", device=device)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.entries:
            raise KeyError(f"{self.path}: no tensor {key!r}")
        return _aligned(self._file.get_tensor(key))

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def shapes(self) -> dict:
        return {k: shape for k, (_, shape) in self.entries.items()}


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when its data is not 64-byte aligned (safetensors offsets are only 8-aligned, and a view into
    the file's buffer sends CPU GEMMs down another kernel path: results would differ in the last bits from the same
    weights in freshly allocated memory, and run slower)."""
    return t if t.device.type != "cpu" or t.data_ptr() % 64 == 0 else t.clone()


def load_file(path) -> tuple[dict, dict]:
    """Load every tensor: (state dict, metadata)."""
    lazy = LazyStateDict(path)
    return {k: lazy[k] for k in lazy}, lazy.metadata


def save_file_atomic(tensors: Mapping[str, torch.Tensor], path, metadata: Mapping | None = None) -> Path:
    """Write a safetensors file via a temporary file in the same folder and ``os.replace``."""
    from safetensors.torch import save_file
    path = Path(path)
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
    return path


def all_finite(t: torch.Tensor) -> bool:
    """Whether a float tensor holds no NaN/Inf: amax/amin propagate NaN, so two reductions and no boolean copy."""
    return not t.numel() or bool(torch.isfinite(t.amax()) and torch.isfinite(t.amin()))
