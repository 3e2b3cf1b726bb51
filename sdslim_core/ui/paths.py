"""The folders ``sdslim ui`` may read and write (``--root``): every path from the browser is checked here.

A path is resolved (``..`` and symbolic links followed, as the operating system would) and must then lie
inside one of the roots; outputs are a plain file name in a root or one of its sub-folders, never an
existing file. Nothing else on the machine can be read or written through the UI.
"""
from __future__ import annotations

import os

SAFETENSORS = (".safetensors",)


class PathNotAllowed(ValueError):
    """A path outside the configured folders (or an output name that is not a plain new file)."""


class Roots:
    """The configured folders, as real paths (symbolic links resolved)."""

    def __init__(self, folders):
        real = []
        for folder in folders:
            path = os.path.realpath(os.fspath(folder))
            if not os.path.isdir(path):
                raise FileNotFoundError(f"--root {folder}: no such folder")
            real.append(path)
        if not real:
            raise ValueError("at least one --root folder is needed")
        self.folders = tuple(dict.fromkeys(real))

    def __repr__(self):
        return f"Roots({list(self.folders)})"

    def contains(self, real_path: str) -> bool:
        """Whether an already resolved path lies in (or is) one of the roots."""
        return any(os.path.commonpath([real_path, r]) == r for r in self.folders)

    def _refuse(self, path) -> PathNotAllowed:
        return PathNotAllowed(f"{path}: outside the folders this UI may use ({', '.join(self.folders)}); "
                              "start `sdslim ui --root FOLDER` to allow another folder")

    def resolve(self, path, what: str = "file") -> str:
        """The real path of an existing file or folder, given absolute or relative to a root.

        Relative paths are looked up in each root in turn. Raises ``PathNotAllowed`` when the resolved path
        is outside every root, ``FileNotFoundError`` when it does not exist, ``ValueError`` when empty.
        """
        path = "" if path is None else os.fspath(path).strip()
        if not path:
            raise ValueError(f"no {what} chosen")
        candidates = [path] if os.path.isabs(path) else [os.path.join(r, path) for r in self.folders]
        for candidate in candidates:
            real = os.path.realpath(candidate)
            if not self.contains(real):
                raise self._refuse(path)
            if os.path.exists(real):
                return real
        raise FileNotFoundError(f"{path}: no such {what}")

    def output(self, folder, name: str, suffix: str = ".safetensors") -> str:
        """The path of a new file ``name`` in ``folder`` (a root or a folder inside one).

        ``name`` must be a plain file name ending in ``suffix``; an existing file (or link) of that name is
        refused, so the UI never overwrites anything.
        """
        real_folder = self.resolve(folder, "folder")
        if not os.path.isdir(real_folder):
            raise PathNotAllowed(f"{folder}: not a folder")
        name = (name or "").strip()
        if not name:
            raise ValueError("no output file name given")
        if os.path.basename(name) != name or name in (".", "..") or name.startswith(".") or "/" in name \
                or "\\" in name:
            raise PathNotAllowed(f"{name!r}: give a plain file name (no folders, not hidden)")
        if not name.lower().endswith(suffix):
            raise PathNotAllowed(f"{name}: the output is written as {suffix}; use that suffix")
        target = os.path.join(real_folder, name)
        if os.path.lexists(target):
            raise PathNotAllowed(f"{target}: exists already; choose a new file name (the UI never overwrites)")
        return target

    def files(self, suffixes=SAFETENSORS, max_depth: int = 6, limit: int = 2000) -> list[tuple[str, str]]:
        """[(label, real path)] of the files with one of ``suffixes`` under the roots (hidden folders skipped,
        links that lead outside the roots left out), sorted by label; at most ``limit`` files."""
        found = {}
        for root in self.folders:
            prefix = "" if len(self.folders) == 1 else os.path.basename(root) + "/"
            for path in self._walk(root, suffixes, max_depth):
                real = os.path.realpath(path)
                if len(found) < limit and self.contains(real) and os.path.isfile(real):
                    found.setdefault(real, prefix + os.path.relpath(path, root).replace(os.sep, "/"))
        return sorted(((label, p) for p, label in found.items()), key=lambda x: x[0].lower())

    @staticmethod
    def _walk(root, suffixes, max_depth):
        for dirpath, dirnames, filenames in os.walk(root):
            depth = 0 if dirpath == root else os.path.relpath(dirpath, root).count(os.sep) + 1
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and depth < max_depth)
            yield from (os.path.join(dirpath, f) for f in sorted(filenames)
                        if f.lower().endswith(suffixes) and not f.startswith("."))

    def folder_choices(self) -> list[tuple[str, str]]:
        """[(label, real path)] of the roots, for an output-folder picker."""
        return [(r, r) for r in self.folders]
