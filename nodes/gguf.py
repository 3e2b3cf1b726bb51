"""Load Slim GGUF: a slim UNet written as ``.gguf`` by ``sdslim slim --format gguf``, loaded through ComfyUI-GGUF.

ComfyUI-GGUF's own *Unet Loader (GGUF)* cannot load it: ComfyUI builds the model from the detected standard
config, and ComfyUI-GGUF assigns quantised weights of any shape but hands F32/F16 tensors to torch's shape-checked
load, so a folded ResBlock's ``norm2`` (1-D F32, fewer channels, its own group count; openaimodel hard-codes
``GroupNorm(32, …)``) stops it. This loader goes ComfyUI-GGUF's way — its ``gguf_sd_loader``, ComfyUI's
``load_diffusion_model_state_dict`` with its ``GGMLOps`` as the custom operations, its ``GGUFModelPatcher`` — with
``GGMLOps`` subclassed only where slim shapes need it: ``GroupNorm`` (a norm2 takes the stored shape and group
count) and ``Conv2d`` (a slim conv small enough to stay F32/F16 takes its stored shape), both assigning the tensor
as ComfyUI-GGUF assigns quantised ones. Quantised weights stay quantised and are dequantised per forward by
ComfyUI-GGUF. The MODEL is slim like Slim UNet's output: LoRA loaders after it are converted into slim space
(:mod:`.patches`) with the adapter file the slim file records, found by its sha256 in ``models/sdslim`` (or the
adapters it embeds), then ComfyUI-GGUF applies them to the dequantised weights.

ComfyUI-GGUF is found the way ComfyUI exposes custom node packs: the module behind its ``UnetLoaderGGUF`` in
``nodes.NODE_CLASS_MAPPINGS``; its code is used, never copied.
"""
from __future__ import annotations

import importlib
import sys
import types

from sdslim_core import layout
from sdslim_core.io import gguf as io_gguf
from sdslim_core.modules.unet import canonical_shapes
from sdslim_core.ops import lora_slim

from . import folding, monitor, patches, paths

GGUF_LOADER = "UnetLoaderGGUF"           # ComfyUI-GGUF's node, by which its package is found
MISSING = ("sdslim: Load Slim GGUF needs the ComfyUI-GGUF custom nodes (city96/ComfyUI-GGUF), which are not loaded "
           "in this ComfyUI: install ComfyUI-GGUF with ComfyUI-Manager, or `git clone "
           "https://github.com/city96/ComfyUI-GGUF` into custom_nodes and `pip install -r "
           "ComfyUI-GGUF/requirements.txt` with ComfyUI's Python, then restart ComfyUI")


def comfyui_gguf() -> types.SimpleNamespace:
    """ComfyUI-GGUF's ``nodes``, ``loader`` and ``ops`` modules as ComfyUI loaded them; SlimError naming it when it
    is not loaded."""
    try:
        import nodes as comfy_nodes
    except ImportError:
        raise folding.SlimError(MISSING) from None
    cls = getattr(comfy_nodes, "NODE_CLASS_MAPPINGS", {}).get(GGUF_LOADER)
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    package = getattr(module, "__package__", None)
    if not package:
        raise folding.SlimError(MISSING)

    def sub(name):
        return sys.modules.get(f"{package}.{name}") or importlib.import_module(f"{package}.{name}")
    try:
        return types.SimpleNamespace(nodes=module, loader=sub("loader"), ops=sub("ops"))
    except ImportError as err:
        raise folding.SlimError(f"{MISSING} (it is there but incomplete: {err})") from None


def slim_ops(ggml_ops, groups: dict) -> type:
    """ComfyUI-GGUF's ``GGMLOps`` with a ``GroupNorm`` and a ``Conv2d`` that take a slim layer's stored shape, and
    the stored group count of each norm2 in ``groups`` (module path → groups)."""
    base = ggml_ops.GGMLOps

    class GroupNorm(base.GroupNorm):
        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            w = state_dict.get(prefix + "weight")
            if prefix[:-1] in groups:
                self.num_groups = groups[prefix[:-1]]
            if w is not None and self.weight is not None and tuple(w.shape) != tuple(self.weight.shape):
                self.num_channels = w.shape[0]
                return self.ggml_load_from_state_dict(state_dict, prefix, *args, **kwargs)
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    class Conv2d(base.Conv2d):
        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            w = state_dict.get(prefix + "weight")
            if w is not None and self.weight is not None and tuple(w.shape) != tuple(self.weight.shape):
                self.out_channels, self.in_channels = w.shape[0], w.shape[1] * self.groups
                return self.ggml_load_from_state_dict(state_dict, prefix, *args, **kwargs)
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    return type("SlimGGMLOps", (base,), {"GroupNorm": GroupNorm, "Conv2d": Conv2d})


def load(path: str):
    """The MODEL of the slim GGUF UNet at ``path`` (a ``GGUFModelPatcher`` marked slim, with the file's adapters)."""
    gg = comfyui_gguf()
    import comfy.sd
    import comfy.utils
    import folder_paths
    if not io_gguf.is_slim_gguf(path):
        raise folding.SlimError(f"sdslim: {path} is not a slim GGUF file (no sdslim.slim=1 metadata); load it with "
                                "Unet Loader (GGUF), or make one with `sdslim slim ... --format gguf`")
    _, keys, cfg, meta = io_gguf.read_slim(path)
    norm2 = layout.RES_LAYERS["ldm"]["norm2"]
    groups = {f"{s}.{norm2}": int(g) for s, g in (meta.get("sdslim.norm_groups") or {}).items()}
    sd = {k: v for k, v in gg.loader.gguf_sd_loader(path).items() if not k.startswith(layout.SDSLIM_TENSORS)}
    stored = {k: tuple(sd[f].shape) for k, f in keys.items()}
    model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": slim_ops(gg.ops, groups)})
    if model is None:
        raise folding.SlimError(f"sdslim: {path}: ComfyUI does not recognise this UNet (SD1.x/SD2.x/SDXL expected)")
    unet = model.model.diffusion_model
    own = {k for k, _ in unet.named_parameters()} | {k for k, _ in unet.named_buffers()}
    missing, extra = sorted(own - set(stored)), sorted(set(stored) - own)
    if missing or extra:
        raise folding.SlimError(f"sdslim: {path}: its UNet does not match ComfyUI's {type(model.model).__name__}: "
                                f"missing {missing[:3]}, unexpected {extra[:3]}")
    wrong = [k for k, s in stored.items() if tuple(comfy.utils.get_attr(unet, k).shape) != s]
    if wrong:
        raise folding.SlimError(f"sdslim: {path}: tensors not taken at their stored shape: {wrong[:3]}")
    ranks = meta.get("sdslim.ranks") or {}
    full = {k: tuple(v) for k, v in canonical_shapes(cfg).items()}

    def space():
        aset, site_tensors = io_gguf.slim_adapters(path, folders=paths.adapter_folders(folder_paths))
        return lora_slim.SlimSpace.for_slim(aset, stored, site_tensors)
    model = gg.nodes.GGUFModelPatcher.clone(model)
    model.model.sdslim_info = folding.SlimInfo(
        family=meta["sdslim.family"], adapters=paths.adapter_origin(path, meta), ranks=ranks, full_shapes=full,
        slim_keys=frozenset(k for k, s in stored.items() if tuple(full[k]) != s),
        space=lora_slim.DeferredSlimSpace(ranks, space),
        record={k: v for k, v in meta.items() if k not in ("sdslim.adapter_tensors", io_gguf.QUANT_KEY)})
    model.__class__ = patches.slim_class(type(model))
    monitor.install(model)
    return model
