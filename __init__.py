"""ComfyUI entry point of the sdslim node pack.

Inside ComfyUI (its ``folder_paths`` and ``comfy`` modules are loaded) this registers the ``models/sdslim``
folder and the nodes: ``comfy_entrypoint`` (V3 API) where ``comfy_api.latest`` exists, else
``NODE_CLASS_MAPPINGS`` (V1). Anywhere else (pytest, tools, ``python -c``) importing it does nothing.
Nothing heavy happens at import: nodes load their implementation when they first run.
"""
NODE_CLASS_MAPPINGS = None
NODE_DISPLAY_NAME_MAPPINGS = None

if __package__:
    from .nodes import entry as _entry

    if _entry.inside_comfyui():
        _entry.prepare()
        if _entry.has_v3():
            comfy_entrypoint = _entry.comfy_entrypoint
        else:
            NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = _entry.v1_mappings()
