"""Load Slim Checkpoint: a slim checkpoint (written by ``sdslim slim``) as ComfyUI's MODEL, CLIP and VAE.

ComfyUI's own checkpoint loader cannot open one: it builds the full-size UNet and its ``load_state_dict`` stops at
the first slimmed weight ("size mismatch"). This loader goes ComfyUI's way (model detection, which only reads
unslimmed shapes, ComfyUI's dtype choice, its CLIP and VAE loaders) with one change: the UNet is built on the meta
device, the slimmed layers are replaced by layers of the file's shapes (same ``comfy.ops`` classes), and the file's
tensors are assigned. The MODEL is slim like Slim UNet's output: LoRAs added after it are converted into slim space
with the adapter file the slim file records, found by its sha256 in ``models/sdslim`` when the first LoRA on a folded
layer comes (or the adapters the file embeds, ``sdslim.adapters.*``, read again per site). Loading and sampling need
no adapter file.
"""
from __future__ import annotations

import comfy.model_detection
import comfy.model_management as mm
import comfy.model_patcher
import comfy.sd
import comfy.utils
import folder_paths

from sdslim_core import layout, tiny
from sdslim_core.io import slim_checkpoint
from sdslim_core.io.tensors import LazyStateDict
from sdslim_core.ops import lora_slim

from . import folding, monitor, patches, paths

UNET_PREFIX = layout.CHECKPOINT_PREFIX


def load(path: str) -> tuple:
    """(MODEL, CLIP, VAE) of the slim checkpoint at ``path`` (CLIP/VAE None when the file has none, as in ComfyUI)."""
    if not slim_checkpoint.is_slim_checkpoint(path):
        raise folding.SlimError(f"sdslim: {path} is not a slim checkpoint (no sdslim.slim=1 metadata); load it with "
                                "Load Checkpoint, or make one with `sdslim slim`")
    lazy = LazyStateDict(path)
    sd = {k: lazy[k] for k in lazy if not k.startswith(layout.SDSLIM_TENSORS)}   # the embedded adapters stay on disk
    metadata = dict(lazy.metadata)
    if not any(k.startswith(UNET_PREFIX) for k in sd):
        raise folding.SlimError(f"sdslim: {path}: no '{UNET_PREFIX}' keys; Load Slim Checkpoint reads LDM-named "
                                "single-file checkpoints (as Load Checkpoint does)")
    model = _model(path, sd, metadata)
    _, clip, vae, _ = comfy.sd.load_state_dict_guess_config(
        dict(sd), output_vae=True, output_clip=True, output_model=False,
        embedding_directory=folder_paths.get_folder_paths("embeddings"), metadata=metadata)
    return model, clip, vae


def _model(path: str, sd: dict, metadata: dict):
    """ComfyUI's BaseModel and ModelPatcher over the slim UNet of ``sd``, marked slim with the file's adapters."""
    config = comfy.model_detection.model_config_from_unet(sd, UNET_PREFIX, metadata=metadata)
    if config is None and tiny.META["schedule"] in metadata:
        raise folding.SlimError(f"sdslim: {path} is a slim file of the tiny demo model, which ComfyUI's loaders cannot "
                                "read: use Load Tiny Demo Model and Slim UNet instead")
    if config is None:
        raise folding.SlimError(f"sdslim: {path}: ComfyUI does not recognise this UNet (SD1.x/SD2.x/SDXL expected)")
    weight_dtype = None if config.scaled_fp8 is not None else comfy.utils.weight_dtype(sd, UNET_PREFIX)
    load_device = mm.get_torch_device()
    dtype = mm.unet_dtype(model_params=comfy.utils.calculate_parameters(sd, UNET_PREFIX),
                          supported_dtypes=list(config.supported_inference_dtypes), weight_dtype=weight_dtype)
    config.set_inference_dtype(dtype, mm.unet_manual_cast(dtype, load_device, config.supported_inference_dtypes))
    base = config.get_model(sd, UNET_PREFIX, device="meta")
    unet = base.diffusion_model
    weights = config.process_unet_state_dict({k[len(UNET_PREFIX):]: v for k, v in sd.items()
                                              if k.startswith(UNET_PREFIX)})
    full = {k: tuple(v.shape) for k, v in unet.state_dict().items()}
    missing, extra = sorted(set(full) - set(weights)), sorted(set(weights) - set(full))
    if missing or extra:
        raise folding.SlimError(f"sdslim: {path}: its UNet does not match ComfyUI's {type(base).__name__}: missing "
                                f"{missing[:3]}, unexpected {extra[:3]}")
    meta = slim_checkpoint.read_metadata(path)
    norm2 = layout.RES_LAYERS["ldm"]["norm2"]
    groups = {f"{s}.{norm2}": g for s, g in (meta.get("sdslim.norm_groups") or {}).items()}
    slim_keys = {k for k, v in weights.items() if tuple(v.shape) != full[k]}
    dtypes = {k: v.dtype for k, v in unet.state_dict(keep_vars=True).items()}
    weights = {k: v.to(dtypes[k], copy=True) for k, v in weights.items()}      # ComfyUI's dtype, off the file map
    folding.replace_layers(unet, weights, slim_keys, groups, lambda layer_path: True)
    unet.load_state_dict(weights, strict=True, assign=True)
    left = [n for n, t in list(base.named_parameters()) + list(base.named_buffers()) if t.is_meta]
    if left:
        raise folding.SlimError(f"sdslim: {path}: ComfyUI's {type(base).__name__} has tensors the checkpoint does "
                                f"not fill: {left[:3]}")
    ranks = meta.get("sdslim.ranks") or {}

    def space():
        aset, site_tensors = slim_checkpoint.slim_adapters(path, folders=paths.adapter_folders(folder_paths))
        return lora_slim.SlimSpace(aset, full, site_tensors)
    base.sdslim_info = folding.SlimInfo(family=meta["sdslim.family"], adapters=paths.adapter_origin(path, meta),
                                        ranks=ranks, full_shapes=full, slim_keys=frozenset(slim_keys),
                                        space=lora_slim.DeferredSlimSpace(ranks, space),
                                        record={k: v for k, v in meta.items() if k != slim_checkpoint.ADAPTER_KEY},
                                        source_dtype=comfy.utils.weight_dtype(sd, UNET_PREFIX))
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=load_device, offload_device=mm.unet_offload_device())
    patcher.__class__ = patches.slim_class(type(patcher))
    monitor.install(patcher)
    return patcher
