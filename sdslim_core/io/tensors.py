"""Reading and writing ``.safetensors`` files: lazily, streamed, atomically, with clear errors."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from .files import HeaderError, atomic_path, read_raw_header

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


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
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FileFormatError(f"{path}: corrupt safetensors header (__metadata__ is not a table of strings)")
    entries = {}
    end = 0
    for key, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, stop = (int(o) for o in info["data_offsets"])
            if min(shape, default=0) < 0 or not 0 <= begin <= stop or stop - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise FileFormatError(f"{path}: tensor {key!r} has an unreadable header entry {info!r}") from None
        end = max(end, stop)
        entries[key] = (dtype, shape)
    if 8 + n + end > size:
        raise FileFormatError(f"{path}: truncated: tensors need {8 + n + end} bytes, file has {size}")
    return entries, metadata


class LazyStateDict(Mapping):
    """A read-only mapping key → tensor that reads each tensor from disk only when asked for."""

    def __init__(self, path, device: str = "cpu"):
        from safetensors import SafetensorError, safe_open
        self.path = _check_path(path)
        self.entries, self.metadata = read_header(self.path)
        try:
            self._file = safe_open(str(self.path), framework="pt", device=device)
        except SafetensorError as err:         # what the header check above does not see (overlapping tensors …)
            raise FileFormatError(f"{self.path}: not a readable safetensors file ({err})") from None

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


def save_file_atomic(tensors: Mapping[str, torch.Tensor], path, metadata: Mapping | None = None,
                     overwrite: bool = True) -> Path:
    """Write a safetensors file via a temporary file in the same folder and ``os.replace``
    (:func:`~sdslim_core.io.files.atomic_path`: a full disk raises its ``DiskFullError``; ``overwrite=False``: an
    existing file raises ``OutputExists``); tensors on a GPU are copied to the CPU on the way."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    path = Path(path)
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    with atomic_path(path, overwrite=overwrite) as tmp:
        try:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
        except SafetensorError as err:      # its I/O failures end in "(os error N)": raise that OSError
            code = re.search(r"\(os error (\d+)\)", str(err))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), tmp) from err
    return path


def all_finite(t: torch.Tensor) -> bool:
    """Whether a float tensor holds no NaN/Inf: amax/amin propagate NaN, so two reductions and no boolean copy."""
    return not t.numel() or bool(torch.isfinite(t.amax()) and torch.isfinite(t.amin()))


def write_safetensors_streaming(path, entries: Sequence[tuple[str, torch.dtype, tuple]],
                                produce: Callable[[str], torch.Tensor], metadata: Mapping | None = None,
                                overwrite: bool = True) -> Path:
    """Write a ``.safetensors`` file whose tensors are produced one at a time by ``produce(key)``.

    ``entries`` gives (key, dtype, shape) of every tensor. Tensors are laid out by decreasing element size (so
    every tensor stays aligned), keeping the given order within a size; ``produce`` is called in that layout
    order. The file appears atomically (temporary file in the same folder, then ``os.replace``); ``overwrite=False``
    refuses an existing ``path`` before the first tensor is produced and again before the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)
    header, offset = {}, 0
    for i in order:
        key, dtype, shape = entries[i]
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_path(path, overwrite=overwrite) as tmp, open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for i in order:
            key, dtype, shape = entries[i]
            t = produce(key)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"internal error: {key} produced {t.dtype} {tuple(t.shape)}, header says "
                                   f"{dtype} {tuple(shape)}")
            fh.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return path


class StreamReader:
    """Tensors of a ``.safetensors`` file, read on demand for streaming.

    safetensors maps the file and returns views of the mapping; every page a tensor touches stays mapped, and is
    counted in the process's RSS, for as long as the file is open. Reopening the file after every ``budget`` bytes
    read keeps that bounded, so streaming a whole checkpoint costs only the tensors in flight.
    """

    def __init__(self, path, budget: int = 128 << 20):
        self.path, self.budget = path, budget
        self.lazy = LazyStateDict(path)
        self.entries = self.lazy.entries
        self._since = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._since >= self.budget:
            self.lazy, self._since = LazyStateDict(self.path), 0
        dtype, shape = self.entries[key]
        self._since += math.prod(shape) * dtype.itemsize
        return self.lazy[key]
