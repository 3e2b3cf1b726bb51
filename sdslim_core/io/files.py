"""File helpers shared by every part of sdslim (torch-free): the safetensors header, atomic writes, sha256,
byte sizes as text."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import Iterator

GIB = 2 ** 30
MIB = 2 ** 20
MAX_HEADER = 100 << 20                # a larger header is taken for a non-safetensors file


class HeaderError(ValueError):
    """The file is not a readable safetensors file (the message says why, without the path)."""


class OutputExists(FileExistsError):
    """An output file exists and replacing it was not asked for: the one message every writer gives, the CLI's and
    the nodes' alike; ``switch`` names how the host allows replacing (``--overwrite``, a node's ``overwrite``)."""

    def __init__(self, path, switch: str = "--overwrite"):
        self.path = str(path)
        super().__init__(self.message(switch))

    def message(self, switch: str) -> str:
        return f"{self.path} exists and was left as it is; choose another name, or set {switch} to replace it"


def refuse_existing(path, overwrite: bool = False) -> None:
    """:class:`OutputExists` when ``path`` exists (a file, a folder or a link) and ``overwrite`` is off."""
    if not overwrite and os.path.lexists(path):
        raise OutputExists(path)


class DiskFullError(OSError):
    """A file could not be written for lack of space (or a file-size limit); the message names it and says that
    nothing was written there."""


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "the file is larger than the file system or this process's file-size limit "
                           "(ulimit -f) allows"}


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
def atomic_path(path, mode: int | None = None, overwrite: bool = True) -> Iterator[str]:
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path`` (``os.replace``), on error it
    is removed, so ``path`` is either the complete new file or what it was before. ``overwrite=False``: an existing
    ``path`` is refused (:class:`OutputExists`) before the temporary file is made and again before the rename. The file gets normal
    permissions (0666 less the umask) unless ``mode`` is given. A full disk (or quota, or file-size limit) raises
    :class:`DiskFullError` naming ``path``. The temporary name carries this host and process id
    (``.<name>.<random>.<host>-<pid>.tmp``), so one left behind by a killed process is removed by the next write
    of the same file."""
    path = Path(path)
    refuse_existing(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{_host()}-{os.getpid()}.tmp", dir=path.parent)
        os.close(fd)
        yield tmp
        refuse_existing(path, overwrite)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask          # mkstemp makes 0600
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as err:
        if err.errno not in _DISK_FULL or isinstance(err, DiskFullError):
            raise
        why = _DISK_FULL[err.errno]
        if err.errno != errno.EFBIG:
            why += f" ({format_bytes(shutil.disk_usage(path.parent).free)} free in {path.parent})"
        before = "is unchanged" if path.exists() else "was not created"
        raise DiskFullError(f"{path}: not written: {why}; {path.name} {before}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _remove_orphans(path: Path) -> None:
    """Remove the temporary files of ``path`` that processes of this host which no longer run left behind."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.[^.]+\.{re.escape(_host())}-(\d+)\.tmp$")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if m and not _running(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(path.parent / name)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:              # another user's process
        return True
    return True


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
