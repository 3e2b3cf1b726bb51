"""The ``models/sdslim`` folder: registration with ComfyUI's ``folder_paths`` and adapter-file lookup."""
from __future__ import annotations

import os

FOLDER = "sdslim"
EXTENSIONS = frozenset({".safetensors"})


def register(folder_paths) -> list[str]:
    """Add ``<models_dir>/sdslim`` to ComfyUI's folder table, keeping paths that extra_model_paths.yaml gave first.

    Returns the folder's search paths. Idempotent: registering twice changes nothing.
    """
    default = os.path.join(folder_paths.models_dir, FOLDER)
    table = folder_paths.folder_names_and_paths
    if FOLDER in table:
        paths, exts = table[FOLDER]
        paths = list(paths)
        if default not in paths:
            paths.append(default)
        table[FOLDER] = (paths, set(exts) | EXTENSIONS)
    else:
        table[FOLDER] = ([default], set(EXTENSIONS))
    return list(table[FOLDER][0])


def adapter_files(folder_paths) -> list[str]:
    """Adapter files visible in ``models/sdslim`` (sorted names relative to their search path)."""
    return sorted(folder_paths.get_filename_list(FOLDER))


def resolve(folder_paths, name: str) -> str:
    """Absolute path of an adapter file chosen in a combo; a clear error when it is gone."""
    path = folder_paths.get_full_path(FOLDER, name)
    if path is None:
        searched = ", ".join(folder_paths.get_folder_paths(FOLDER))
        raise FileNotFoundError(f"sdslim: adapter file '{name}' not found in models/{FOLDER} (searched: {searched})")
    return path


def output_path(folder_paths, filename: str) -> str:
    """Where a trained adapter file named ``filename`` is written: the first ``models/sdslim`` search path.

    Only a plain file name (or a relative path without ``..``) is accepted; ``.safetensors`` is appended if missing.
    """
    name = filename.strip()
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise ValueError(f"sdslim: filename '{filename}' must be a relative name inside models/{FOLDER}")
    if not name.endswith(".safetensors"):
        name += ".safetensors"
    return os.path.join(folder_paths.get_folder_paths(FOLDER)[0], name)
