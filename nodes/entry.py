"""Registration with ComfyUI: the model folder, ``sdslim_core`` on the path, and the V3 / V1 node classes."""
from __future__ import annotations

import importlib.util
import logging
import os
import sys

PACK_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("sdslim")


def inside_comfyui() -> bool:
    """True when this process is a ComfyUI (its core modules are already loaded)."""
    return "folder_paths" in sys.modules and "comfy" in sys.modules


def prepare() -> None:
    """Make the pack's ``sdslim_core`` importable (appended: never shadows), register ``models/sdslim`` and the
    shipped tiny demo assets (its adapter file for Slim UNet, its LoRA for the LoRA loaders)."""
    import folder_paths

    from . import paths
    if importlib.util.find_spec("sdslim_core") is None:
        sys.path.append(PACK_ROOT)
    origin = os.path.dirname(importlib.util.find_spec("sdslim_core").origin)
    if os.path.realpath(origin) != os.path.realpath(os.path.join(PACK_ROOT, "sdslim_core")):
        log.info("sdslim: using the installed sdslim_core at %s", origin)
    paths.register(folder_paths)
    paths.register_demo_assets(folder_paths, os.path.join(origin, "tiny", "assets"))


def has_v3() -> bool:
    try:
        from comfy_api.latest import ComfyExtension, io  # noqa: F401
    except ImportError:
        return False
    return True


async def comfy_entrypoint():
    """V3 entry point: a ComfyExtension listing the sdslim nodes."""
    from comfy_api.latest import ComfyExtension

    from . import specs, v3

    class SdslimExtension(ComfyExtension):
        async def get_node_list(self):
            return [v3.node_class(s) for s in specs.SPECS]

    return SdslimExtension()


def v1_mappings() -> tuple[dict, dict]:
    """V1 fallback for ComfyUI without ``comfy_api.latest``."""
    from . import specs, v1
    classes = {s.node_id: v1.node_class(s) for s in specs.SPECS}
    return classes, {s.node_id: s.display_name for s in specs.SPECS}
