"""Where a host's training writes its adapter file (inside the host's ``models/sdslim``) and keeps its work folder
(``sdslim_work/`` beside that folder, so the host never lists the work folder's shards as adapters). Torch-free;
the ComfyUI Train node and the webui's SD Slim tab both use it."""
from __future__ import annotations

import os

WORK_FOLDER = "sdslim_work"
SUFFIX = ".safetensors"


def adapter_output(folder: str, filename: str) -> str:
    """The adapter file ``filename`` inside ``folder``: a relative name (subfolders allowed, no ``..``, not
    absolute); ``.safetensors`` is appended when missing."""
    name = (filename or "").strip()
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise ValueError(f"sdslim: filename '{filename}' must be a relative name inside models/sdslim")
    if not name.endswith(SUFFIX):
        name += SUFFIX
    return os.path.join(folder, name)


def work_dir(folder: str, adapter_path: str) -> str:
    """The work folder of ``adapter_path`` (from :func:`adapter_output`): ``<parent of folder>/sdslim_work/
    <name>.work``."""
    rel = os.path.relpath(adapter_path, folder)
    return os.path.join(os.path.dirname(os.path.normpath(folder)), WORK_FOLDER, rel + ".work")
