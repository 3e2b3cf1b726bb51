"""Adapter files found by their sha256, the way a shared VAE is found: one adapter file serves every slim file made
with it, whatever it is called and wherever it was moved.

Where: the folders a host passes first (ComfyUI's ``models/sdslim`` with its ``extra_model_paths.yaml`` entries,
A1111's ``models/sdslim``, the CLI's ``--adapters FOLDER``), then ``$SDSLIM_ADAPTER_PATH`` (folders separated by
``os.pathsep``), then ``adapter_paths`` in the config file (``$SDSLIM_CONFIG``, default
``~/.config/sdslim/config.json``), then the folder of the slim file itself. Subfolders are searched; hidden folders
and training work folders (``*.work``) are not. A file named as the slim file records is tried first; other
candidates only when their header says they are adapter files of the same family with the recorded sites and ranks,
so only likely files are ever hashed. Hashes are kept in a small index (``$SDSLIM_CACHE_DIR``, default
``~/.cache/sdslim``, file ``adapter_hashes.json``: path, size and modification time → sha256), so no file is hashed
twice; a file whose size or modification time changed is hashed again. The index is asked first: an adapter file
that made a slim file on this machine, still where it was and unchanged, is found wherever it lies. Two copies of one file: the first in search
order is used (their contents are the same).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from .adapters import FORMAT
from .files import atomic_path, read_raw_header, sha256_file

ENV_PATH = "SDSLIM_ADAPTER_PATH"
ENV_CONFIG = "SDSLIM_CONFIG"
ENV_CACHE = "SDSLIM_CACHE_DIR"
INDEX_FILE = "adapter_hashes.json"
_RANK_TENSORS = (".down_value", ".down")


def config_file() -> Path:
    return Path(os.environ.get(ENV_CONFIG) or Path.home() / ".config" / "sdslim" / "config.json")


def configured_folders() -> list[Path]:
    """``$SDSLIM_ADAPTER_PATH``, then the config file's ``adapter_paths`` (a missing or unreadable config file adds
    nothing)."""
    out = [Path(p).expanduser() for p in os.environ.get(ENV_PATH, "").split(os.pathsep) if p]
    try:
        data = json.loads(config_file().read_text(encoding="utf8"))
    except (OSError, ValueError):
        data = {}
    paths = data.get("adapter_paths") if isinstance(data, dict) else None
    if isinstance(paths, list):
        out += [Path(p).expanduser() for p in paths if isinstance(p, str)]
    return out


def search_folders(folders: Iterable = (), near=None, configured: bool = True) -> list[Path]:
    """The folders searched, in order: ``folders``, :func:`configured_folders` (unless not ``configured``), the
    folder of ``near`` (a slim file); existing ones only, each once."""
    seen, out = set(), []
    candidates = [Path(f) for f in folders] + (configured_folders() if configured else []) + \
        ([Path(near).resolve().parent] if near else [])
    for folder in candidates:
        try:
            real = folder.resolve()
        except OSError:
            continue
        if real.is_dir() and real not in seen:
            seen.add(real)
            out.append(folder)
    return out


class HashIndex:
    """sha256 of files, remembered by (resolved path, size, mtime) in a JSON index (best effort: an unwritable
    cache folder only means hashing again next time)."""

    def __init__(self, path=None):
        self.path = Path(path) if path else Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "sdslim") \
            / INDEX_FILE
        try:
            data = json.loads(self.path.read_text(encoding="utf8"))
            self._files = data["files"] if isinstance(data.get("files"), dict) else {}
        except (OSError, ValueError, KeyError, AttributeError):
            self._files = {}
        self.hashed = 0                       # files hashed by this index (not found in it)

    def sha256(self, path) -> str:
        real = str(Path(path).resolve())
        st = os.stat(real)
        entry = self._files.get(real)
        if isinstance(entry, list) and entry[:2] == [st.st_size, st.st_mtime_ns]:
            return entry[2]
        digest = sha256_file(real)
        self.hashed += 1
        self._files[real] = [st.st_size, st.st_mtime_ns, digest]
        self._save()
        return digest

    def known(self, sha256: str) -> list[Path]:
        """Files this index has seen with ``sha256`` that are still there, unchanged."""
        out = []
        for path, entry in self._files.items():
            if isinstance(entry, list) and len(entry) == 3 and entry[2] == sha256:
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if entry[:2] == [st.st_size, st.st_mtime_ns]:
                    out.append(Path(path))
        return out

    def _save(self) -> None:
        alive = {p: e for p, e in self._files.items() if os.path.exists(p)}
        try:
            with atomic_path(self.path) as tmp:
                Path(tmp).write_text(json.dumps({"version": 1, "files": alive}), encoding="utf8")
        except OSError:
            pass


def _walk(folder: Path) -> Iterator[Path]:
    for dirpath, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not d.endswith(".work"))
        for name in sorted(files):
            if name.lower().endswith(".safetensors"):
                yield Path(dirpath) / name


def header_ranks(path) -> tuple[str | None, dict]:
    """(family, site → rank) of an adapter file read from its header alone; (None, {}) for any other file."""
    try:
        header, _, _ = read_raw_header(path)
    except (OSError, ValueError):
        return None, {}
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("sdslim.format") != FORMAT:
        return None, {}
    ranks = {}
    for key, entry in header.items():
        for suffix in _RANK_TENSORS:
            if key.endswith(suffix) and isinstance(entry, dict) and entry.get("shape"):
                ranks[key[:-len(suffix)]] = int(entry["shape"][0])
    return meta.get("sdslim.family"), ranks


def _could_be(path: Path, family: str | None, ranks: Mapping | None) -> bool:
    fam, have = header_ranks(path)
    if fam is None or (family and fam != family):
        return False
    return not ranks or all(have.get(s) == r for s, r in ranks.items())


def find(sha256: str, folders: Iterable, name: str | None = None, family: str | None = None,
         ranks: Mapping | None = None, index: HashIndex | None = None, preferred: int = 0) -> Path | None:
    """The adapter file whose sha256 is ``sha256``, searched in ``folders`` (in order; see :func:`search_folders`):
    in each, a file called ``name`` first, then any adapter file of ``family`` that has ``ranks`` (site → rank)
    for those sites. After the first ``preferred`` folders (those given explicitly) the hash index is asked: a file
    it has seen with that sha256, still there and unchanged (the file a slim file was made with on this machine),
    is taken wherever it lies. None when there is none."""
    index = index or HashIndex()
    folders = [Path(f) for f in folders]
    tried: set[str] = set()

    def matches(path: Path) -> bool:
        real = str(path.resolve())
        if real in tried:
            return False
        tried.add(real)
        try:
            return _could_be(path, family, ranks) and index.sha256(path) == sha256
        except OSError:
            return False

    def search(group: list[Path]) -> Path | None:
        for folder in group:
            for path in _walk(folder):
                if (not name or path.name == name) and matches(path):
                    return path
        for folder in group:
            for path in _walk(folder):
                if matches(path):
                    return path
        return None
    found = search(folders[:preferred])
    if found is None:
        found = next((p for p in index.known(sha256) if _could_be(p, family, ranks)), None)
    return found or search(folders[preferred:])
