"""The ``models/sdslim`` folder: registration with ComfyUI's ``folder_paths``, adapter-file lookup, and where the
Train node keeps its work folders (beside the listed folder, never inside it)."""
from __future__ import annotations

import logging
import os

FOLDER = "sdslim"
EXTENSIONS = frozenset({".safetensors"})
GGUF_FOLDER = "diffusion_models"     # where ComfyUI (and ComfyUI-GGUF's Unet Loader) look for UNet files
_HEADER_CHECKS: dict = {}
log = logging.getLogger("sdslim")


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


def register_demo_assets(folder_paths, assets: str) -> None:
    """Offer the shipped tiny demo files: the assets folder is searched after ``models/sdslim`` (its adapter file)
    and after the user's LoRA folders (its LoRA; the other tiny_* files there are listed too)."""
    for kind in (FOLDER, "loras"):
        if kind in folder_paths.folder_names_and_paths and assets not in folder_paths.get_folder_paths(kind):
            folder_paths.add_model_folder_path(kind, assets)


def adapter_files(folder_paths) -> list[str]:
    """sdslim adapter files in ``models/sdslim`` (sorted names relative to their search path): files whose
    header says ``sdslim.format: sdslim-adapters``, outside training work folders."""
    out = []
    for name in folder_paths.get_filename_list(FOLDER):
        if any(part.endswith(".work") for part in name.replace("\\", "/").split("/")[:-1]):
            continue
        path = folder_paths.get_full_path(FOLDER, name)
        if path is not None and _is_adapter(path):
            out.append(name)
    return sorted(out)


def slim_checkpoints(folder_paths) -> list[str]:
    """Slim checkpoints in ComfyUI's ``checkpoints`` folders: ``.safetensors`` files whose header says
    ``sdslim.slim: 1`` (only the header is read)."""
    out = []
    for name in folder_paths.get_filename_list("checkpoints"):
        path = folder_paths.get_full_path("checkpoints", name)
        if path is not None and name.lower().endswith(".safetensors") and _header_says(path, "slim"):
            out.append(name)
    return sorted(out)


def slim_ggufs(folder_paths) -> list[str]:
    """Slim ``.gguf`` UNets (header says ``sdslim.slim: 1``) in ComfyUI's ``diffusion_models`` (``unet``) folders,
    as names relative to their folder. ComfyUI lists no ``.gguf`` there (ComfyUI-GGUF adds its own list), so the
    folders are walked here."""
    out = set()
    if GGUF_FOLDER not in folder_paths.folder_names_and_paths:
        return []
    for root in folder_paths.get_folder_paths(GGUF_FOLDER):
        for name in _gguf_names(root):
            if _header_says(os.path.join(root, name), "gguf"):
                out.add(name)
    return sorted(out)


def _gguf_names(root: str) -> list[str]:
    names = []
    for dirpath, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        names += [os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/") for f in files
                  if f.lower().endswith(".gguf")]
    return names


def resolve_gguf(folder_paths, name: str) -> str:
    """Absolute path of a slim ``.gguf`` chosen in Load Slim GGUF's combo; a clear error when it is gone."""
    roots = folder_paths.get_folder_paths(GGUF_FOLDER)
    for root in roots:
        path = os.path.join(root, name)
        if ".." not in name.replace("\\", "/").split("/") and os.path.isfile(path):
            return path
    raise FileNotFoundError(f"sdslim: '{name}' not found in models/{GGUF_FOLDER} (searched: {', '.join(roots)})")


def _is_adapter(path: str) -> bool:
    return _header_says(path, "adapter")


def _header_says(path: str, what: str) -> bool:
    """Whether ``path`` is an sdslim adapter file / slim checkpoint / slim GGUF, remembered per (path, size,
    mtime): the lists are asked for on every page load. A file that cannot be read (cut, garbage, gone, a broken
    link) is not listed; the lists are built at start-up and on every page load, so they never raise."""
    from sdslim_core.io.adapters import is_adapter_file
    from sdslim_core.io.gguf import is_slim_gguf
    from sdslim_core.io.slim_checkpoint import is_slim_checkpoint
    from sdslim_core.io.tensors import FileFormatError
    from sdslim_core.optional import MissingDependency
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (what, path, st.st_size, st.st_mtime_ns)
    if key not in _HEADER_CHECKS:
        check = {"adapter": is_adapter_file, "slim": is_slim_checkpoint, "gguf": is_slim_gguf}[what]
        try:
            _HEADER_CHECKS[key] = check(path)
        except (OSError, FileFormatError, MissingDependency):
            _HEADER_CHECKS[key] = False
        except Exception as err:            # a reader's bug must not take the node list (or the pack) down
            log.warning("sdslim: %s not listed: reading its header failed (%s: %s)", path, type(err).__name__, err)
            _HEADER_CHECKS[key] = False
    return _HEADER_CHECKS[key]


def adapter_folders(folder_paths) -> list[str]:
    """Where a slim file's adapter file is looked for by its sha256: every ``models/sdslim`` search path (those of
    ``extra_model_paths.yaml`` included); the core adds ``$SDSLIM_ADAPTER_PATH``, the config file's and the slim
    file's own folder."""
    return list(folder_paths.get_folder_paths(FOLDER))


def adapter_origin(path: str, meta: dict) -> str:
    """What a slim file's model reports as its adapters: the file it embeds, or the adapter file it records."""
    if meta.get("sdslim.adapter_tensors"):
        return f"{path} (embedded adapters)"
    origin = meta.get("sdslim.adapters") or {}
    sha = origin.get("sha256")
    return f"{origin.get('file', '?')}" + (f" (sha256 {sha[:12]}…, found by hash when a LoRA needs it)" if sha else "")


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
    from sdslim_core.hosts import train_paths
    return train_paths.adapter_output(folder_paths.get_folder_paths(FOLDER)[0], filename)


def work_dir(folder_paths, adapter_path: str) -> str:
    """The Train node's work folder for ``adapter_path`` (from :func:`output_path`):
    ``<parent of models/sdslim>/sdslim_work/<name>.work``, outside the folders Slim UNet lists."""
    from sdslim_core.hosts import train_paths
    return train_paths.work_dir(folder_paths.get_folder_paths(FOLDER)[0], adapter_path)
