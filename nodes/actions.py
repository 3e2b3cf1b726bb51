"""What each node does when it runs (imported on first run; ComfyUI is present)."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

import comfy.model_management
import comfy.utils
import folder_paths

from sdslim_core.io.adapter_lookup import HashIndex
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.io.files import format_bytes
from sdslim_core.io.slim_checkpoint import site_reader

from . import folding, monitor, paths, report, saving
from .specs import Result

log = logging.getLogger("sdslim")


def slim(model, adapters: str, strength: float, enable: bool) -> Result:
    if not enable:
        return Result((model,))
    path = paths.resolve(folder_paths, adapters)
    aset = AdapterSet.load(path, lazy=True).select(strength)      # values read per site, now and for later LoRAs
    if not aset.sites:
        out = model.clone()
        monitor.install(out)
        return Result((out,))
    bar = comfy.utils.ProgressBar(len(aset.sites))
    out = folding.slim_patcher(model, aset, progress=lambda done, total: bar.update_absolute(done, total),
                               site_tensors=site_reader(path, aset))
    origin = {"file": os.path.basename(path), "sha256": HashIndex().sha256(path), "sites": len(aset.sites),
              "select": strength}
    out.model.sdslim_info = dataclasses.replace(out.model.sdslim_info,
                                                record=saving.slim_record(out, aset, origin))
    log.info("sdslim: folded %d sites from %s; UNet %s -> %s", len(aset.sites), adapters,
             format_bytes(model.model_size()), format_bytes(out.model_size()))
    return Result((out,))


def save_slim_checkpoint(model, filename: str, destination: str, overwrite: bool = False,
                         embed_adapters: bool = False, clip=None, vae=None, dtype: str = "source") -> Result:
    bar = comfy.utils.ProgressBar(1)
    path, size = saving.save_checkpoint(model, filename, destination, clip=clip, vae=vae, overwrite=overwrite,
                                        embed_adapters=embed_adapters, dtype=dtype,
                                        progress=lambda done, total: bar.update_absolute(done, total))
    log.info("sdslim: wrote %s: %s", path, size)
    return Result((), text=f"wrote {path}: {size}")


def save_slim_gguf(model, filename: str, quant: str, overwrite: bool = False, embed_adapters: bool = False) -> Result:
    bar = comfy.utils.ProgressBar(1)
    path, size = saving.save_gguf(model, filename, quant, overwrite=overwrite, embed_adapters=embed_adapters,
                                  progress=lambda done, total: bar.update_absolute(done, total))
    log.info("sdslim: wrote %s: %s", path, size)
    return Result((), text=f"wrote {path}: {size}")


def load_slim_checkpoint(ckpt_name: str) -> Result:
    from . import loading
    return Result(loading.load(folder_paths.get_full_path_or_raise("checkpoints", ckpt_name)))


def load_slim_gguf(unet_name: str) -> Result:
    from . import gguf
    gguf.comfyui_gguf()                 # without ComfyUI-GGUF, that is what the user is told first
    return Result((gguf.load(paths.resolve_gguf(folder_paths, unet_name)),))


def vram_monitor(model) -> Result:
    out = model.clone()
    monitor.install(out)
    return Result((out,))


def breakdown(model) -> Result:
    text = report.breakdown_text(model)
    return Result((text,), text)


def vram_report(model=None, model_b=None, trigger=None, width=1024, height=1024, batch=1, estimate=False) -> Result:
    mm = comfy.model_management
    sections = [report.device_lines(mm, torch), report.loaded_models_lines(mm),
                report.sampling_lines(monitor.LAST_SAMPLING)]
    models = [(label, m) for label, m in (("model", model), ("model_b", model_b)) if m is not None]
    for label, m in models:
        sections.append([report.breakdown_text(m, label),
                         f"{label}: weights {format_bytes(m.model_size())} in "
                         f"{str(m.model_dtype()).replace('torch.', '')}"])
    if estimate and models:
        sections.append(report.estimate_lines(report.estimate_jobs(models, width, height), width, height, batch))
    text = "\n\n".join("\n".join(s) for s in sections)
    return Result((text,), text)


def train(model, filename, ratio, steps, seed, positive=None, clip=None, prompts="", budget="",
          latent_size=0, negative=None, recipe="full", start_from=None, overwrite=False,
          adapter_dtype=None) -> Result:
    from . import training
    text = training.run(model, filename=filename, ratio=ratio, steps=steps, seed=seed, positive=positive,
                        negative=negative, clip=clip, prompts=prompts, budget=budget, latent_size=latent_size,
                        recipe=recipe, start_from=start_from, overwrite=overwrite, adapter_dtype=adapter_dtype)
    return Result((text,), text)


def tiny_demo() -> Result:
    from . import tiny
    return Result(tiny.load())
