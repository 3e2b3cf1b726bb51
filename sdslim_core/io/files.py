"""File helpers shared by every part of sdslim (torch-free): the safetensors header, atomic writes, sha256,
byte sizes as text."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Iterator

GIB = 2 ** 30
MIB = 2 ** 20
MAX_HEADER = 100 << 20                # a larger header is taken for a non-safetensors file


class HeaderError(ValueError):
    """The file is not a readable safetensors file (the message says why, without the path)."""


def read_raw_header(path) -> tuple[dict, int, int]:
    """(the JSON header with ``__metadata__`` if any, header length, file size) of a safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise HeaderError(f"too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or n > min(size - 8, MAX_HEADER):
            raise HeaderError(f"not a safetensors file (header length {n} of a {size}-byte file)")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise HeaderError(f"corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise HeaderError("corrupt safetensors header (not a JSON object)")
    return header, n, size


@contextlib.contextmanager
def atomic_path(path, mode: int | None = None) -> Iterator[str]:
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path`` (``os.replace``), on error it
    is removed. The file gets normal permissions (0666 less the umask) unless ``mode`` is given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask          # mkstemp makes 0600
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def sha256_file(path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def format_bytes(n: int | float | None) -> str:
    """Bytes as GiB (≥ 1 GiB) or MiB; ``n/a`` for None."""
    if n is None:
        return "n/a"
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"
