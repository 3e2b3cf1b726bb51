"""Save Slim Checkpoint and Save Slim GGUF: a slim MODEL (with the LoRAs and patches on it) written as the files
Load Slim Checkpoint and Load Slim GGUF read, from inside ComfyUI.

Both go ComfyUI's way: ``comfy.model_management.load_models_gpu(..., force_patch_weights=True)`` puts every patch
(LoRAs after Slim UNet are already in slim space) into the weights, as ComfyUI's own *Save Checkpoint* does, and
what that loaded is unloaded again once the file is written (:func:`patched`: saving never changes what a MODEL
computes afterwards); the checkpoint has ComfyUI's key names for the UNet, CLIP and VAE (``state_dict_for_saving``,
as ``comfy.sd.save_checkpoint``) with the slim model's ``sdslim.*`` record as metadata, streamed tensor by tensor in
the storage dtype chosen (:func:`storage_dtypes`: by default the source's, not the dtype ComfyUI computes in); the
GGUF file is sdslim's writer (``io.gguf.write_unet``: the UNet only, bare LDM names, as ComfyUI-GGUF loads).
Either is written to a temporary file that replaces the target only when complete, and an existing file is replaced
only when asked. By default no adapter tensors are written: the file records the adapter file's sha256 and a later
LoRA finds it (``embed_adapters``: stored as fp16, Q8_0 in GGUF).
"""
from __future__ import annotations

import contextlib
import json
import math
import os

import comfy.model_management
import comfy.utils
import folder_paths

from sdslim_core import layout
from sdslim_core.io import gguf as io_gguf
from sdslim_core.io.files import refuse_existing
from sdslim_core.io.sizes import FileSize, file_size
from sdslim_core.io.slim_checkpoint import ADAPTER_KEY, ADAPTER_PREFIX
from sdslim_core.io.tensors import write_safetensors_streaming

from . import folding
from .specs import SAVE_DTYPES

TINY_REFUSAL = ("sdslim: the tiny demo model cannot be saved: ComfyUI's loaders cannot read its files (its UNet is "
                "smaller than any SD1.5 and its text encoder and VAE are not ComfyUI's), so slim it with Slim UNet "
                "in each workflow instead")


def target(root: str, filename: str, suffix: str, overwrite: bool) -> str:
    """``root/filename`` with ``suffix``; SlimError for a name that leaves ``root`` or an existing file unless
    ``overwrite``."""
    name = filename.strip().replace("\\", "/")
    if not name or name.startswith("/") or ".." in name.split("/") or ":" in name:
        raise folding.SlimError(f"sdslim: '{filename}' is not a file name inside {root} (no '..', no absolute path)")
    if not name.lower().endswith(suffix):
        name += suffix
    path = os.path.join(root, *name.split("/"))
    if os.path.isdir(path):
        raise folding.SlimError(f"sdslim: {path} is a folder")
    refuse_existing(path, overwrite)
    return path


def _info(model):
    if getattr(getattr(model.model, "model_config", None), "sdslim_tiny", False):
        raise folding.SlimError(TINY_REFUSAL)
    info = getattr(model.model, "sdslim_info", None)
    if info is None or not info.record:
        raise folding.SlimError("sdslim: this MODEL is not slim (connect the output of Slim UNet, Load Slim Checkpoint "
                                "or Load Slim GGUF); ComfyUI's own Save Checkpoint saves a plain model")
    return info


def _record(model, info, embed: str | None) -> dict:
    """The ``sdslim.*`` metadata of the file: the model's record, the patches on it, the embedded adapters."""
    meta = dict(info.record)
    patched = sorted(k for k in model.patches if model.patches[k])
    if patched:
        meta["sdslim.loras"] = list(meta.get("sdslim.loras") or []) + [
            {"file": "ComfyUI weight patches on the slim model", "keys": len(patched), "applied": "in slim space"}]
    meta["sdslim.adapters"] = {**(meta.get("sdslim.adapters") or {}), "embedded": embed}
    if embed:
        meta[ADAPTER_KEY] = ADAPTER_PREFIX
    return meta


def _adapter_tensors(info, dtype) -> dict:
    """``sdslim.adapters.<site>.<tensor>`` → tensor of the folded sites, read from the adapter file (found by its
    sha256 when the model came from a slim file)."""
    space = info.space.resolved() if hasattr(info.space, "resolved") else info.space
    if space is None:
        raise folding.SlimError("sdslim: this slim MODEL has no adapters to embed")
    out = {}
    for site in space.adapters.sites:
        for name, t in space.site_tensors(site).items():
            out[f"{ADAPTER_PREFIX}{site}.{name}"] = t.to("cpu", dtype) if dtype is not None else t.cpu()
    return out


def _strings(meta: dict) -> dict:
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def storage_dtypes(choice: str, source):
    """(the dtype of the UNet's matrices, of every other floating-point tensor) in the file for the node's ``dtype``
    input (:data:`~.specs.SAVE_DTYPES`); ``source``: the dtype the weights were stored in (None: unknown, taken as
    fp16). ``as held`` gives (None, None): every tensor as ComfyUI holds it. fp8 is for the UNet's matrices only,
    as ``sdslim slim --weight-dtype`` stores it; the rest is then fp16."""
    import torch
    named = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3fn": torch.float8_e4m3fn}
    if choice not in SAVE_DTYPES:
        raise folding.SlimError(f"sdslim: dtype {choice!r} is not one of {', '.join(SAVE_DTYPES)}")
    if choice == "as held":
        return None, None
    matrices = named.get(choice) or source or torch.float16
    return matrices, matrices if matrices.itemsize == 2 else torch.float16


@contextlib.contextmanager
def patched(model, clip=None):
    """Within the block, ``model`` (and ``clip``'s model) are loaded with every patch in their weights, as ComfyUI's
    Save Checkpoint loads them (``load_models_gpu(..., force_patch_weights=True)``); afterwards each model this added
    to ComfyUI's loaded models is unloaded as ComfyUI unloads one (``LoadedModel.model_unload``: weights restored
    from their backups and back on the offload device, the load marks on the modules cleared). A model loaded
    before stays loaded.

    ComfyUI's own Save Checkpoint leaves its model loaded, every module of the BaseModel its clones share marked as
    patched (``comfy_patched_weights``): a clone then patched by ``patch_model()`` rather than ComfyUI's loader
    (which detaches the loaded clone first) skips every module and computes without its own patches (a LoRA added
    after the save does nothing). After :func:`patched` the models compute what they computed before."""
    mm = comfy.model_management
    before = list(mm.current_loaded_models)
    try:
        mm.load_models_gpu([model] + ([clip.load_model()] if clip is not None else []), force_patch_weights=True)
        yield
    finally:
        loaded = mm.current_loaded_models
        for i in reversed(range(len(loaded))):
            if not any(loaded[i] is lm for lm in before):
                loaded.pop(i).model_unload()


def _parts(clip, vae) -> tuple[dict | None, dict | None]:
    """The tensors of the CLIP and VAE (None where not connected), read as ``comfy.sd.save_checkpoint`` reads them."""
    for part, what in ((clip, "CLIP"), (vae, "VAE")):
        if part is not None and not hasattr(part, "get_sd"):
            raise folding.SlimError(f"sdslim: this {what} ({type(part).__name__}) cannot be saved in a checkpoint; "
                                    f"leave the {what.lower()} input unconnected")
    return (clip.get_sd() if clip is not None else None), (vae.get_sd() if vae is not None else None)


def save_checkpoint(model, filename: str, destination: str, clip=None, vae=None, overwrite: bool = False,
                    embed_adapters: bool = False, dtype: str = SAVE_DTYPES[0], progress=None) -> tuple[str, str]:
    """Write the slim checkpoint, its tensors in the storage dtype ``dtype`` chooses (:func:`storage_dtypes`);
    (path, its size by part and against the source as text). ``progress(done, total)`` after each tensor."""
    import torch
    info = _info(model)
    folding.check_gguf(model.model.diffusion_model)
    root = folder_paths.get_folder_paths("checkpoints")[0] if destination == "checkpoints" else \
        folder_paths.get_output_directory()
    path = target(root, filename, ".safetensors", overwrite)
    matrices, others = storage_dtypes(dtype, info.source_dtype)
    extra = _adapter_tensors(info, torch.float16) if embed_adapters else {}
    meta = _record(model, info, "fp16" if embed_adapters else None)
    clip_sd, vae_sd = _parts(clip, vae)
    with patched(model, clip):
        sd = {**model.model.state_dict_for_saving(clip_sd, vae_sd, None), **extra}

        def stored(key, t):
            if matrices is None or not t.is_floating_point() or key in extra:
                return t.dtype
            return matrices if t.dim() >= 2 and layout.file_part(key) == "unet" else others
        entries = [(k, stored(k, t), tuple(t.shape)) for k, t in sd.items()]
        dtypes = {k: d for k, d, _ in entries}
        done = []

        def produce(key):
            done.append(key)
            if progress is not None:
                progress(len(done), len(entries))
            return sd.pop(key).detach().to("cpu", dtypes[key]).contiguous()
        write_safetensors_streaming(path, entries, produce, _strings(meta), overwrite=overwrite)
    return path, size_text(file_size(path), info)


def size_text(written: FileSize, info) -> str:
    """The written file's size by part and against its source, as ``sdslim slim`` says it. Inside ComfyUI the source
    file is not known: it is taken as this file with the full-size UNet stored in the source's dtype (fp16 where
    that is unknown)."""
    import torch
    dtype = info.source_dtype or torch.float16
    params = sum(math.prod(s) for s in info.full_shapes.values())
    name = str(dtype).replace("torch.", "") + ("" if info.source_dtype else ", taken as the source's")
    source = written.with_unet(params * dtype.itemsize, f"source (this file with the {params / 1e6:.1f}M-parameter "
                                                        f"full-size UNet in {name})")
    return f"{written.text()}\n{source.path}: {source.text()}; {written.ratio_text(source)}"


def save_gguf(model, filename: str, qtype: str, overwrite: bool = False, embed_adapters: bool = False,
              progress=None) -> tuple[str, str]:
    """Write the slim UNet as GGUF ``qtype`` into ``models/unet``; (path, its size as text)."""
    info = _info(model)
    folding.check_gguf(model.model.diffusion_model)
    io_gguf.package()
    path = target(folder_paths.get_folder_paths("diffusion_models")[0], filename, ".gguf", overwrite)
    adapters = _adapter_tensors(info, None) if embed_adapters else {}
    meta = {k: v for k, v in _record(model, info, io_gguf.ADAPTER_TYPE if embed_adapters else None).items()
            if k.startswith("sdslim.")}
    with patched(model):
        sd = model.model.diffusion_model.state_dict()
        entries = [(k, v.dtype, tuple(v.shape)) for k, v in sd.items()] + \
            [(k, v.dtype, tuple(v.shape)) for k, v in adapters.items()]
        done = []

        def produce(name):
            done.append(name)
            if progress is not None:
                progress(len(done), len(entries))
            return adapters[name] if name in adapters else sd[name]
        io_gguf.write_unet(path, entries, set(adapters), produce, qtype, info.family, meta, overwrite=overwrite)
    return path, file_size(path).text()


def slim_record(model, aset, origin: dict) -> dict:
    """The ``sdslim.*`` record of a MODEL slimmed by Slim UNet with ``aset`` (``origin``: the adapter file's name,
    sha256, sites and strength)."""
    from sdslim_core.io.slim_checkpoint import slim_metadata
    info = model.model.sdslim_info
    heads = {k: v for k, v in (getattr(getattr(model.model, "model_config", None), "unet_config", None) or {}).items()
             if k in ("num_heads", "num_head_channels") and isinstance(v, int) and v > 0}
    cfg = layout.config_from_state_dict(info.full_shapes, heads)
    return slim_metadata(cfg, aset, origin, [])
