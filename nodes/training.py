"""Train Slim Adapters inside ComfyUI: gathers what the trainer needs from ComfyUI objects, then calls
``sdslim_core.train.train_adapters``. The MODEL's LoRAs are merged into the teacher; the MODEL is not modified."""
from __future__ import annotations

import shutil

import torch

import comfy.model_management
import comfy.utils
import folder_paths

from sdslim_core import layout
from sdslim_core.hosts import comfyui_conditioning
from sdslim_core.io.files import refuse_existing

from . import folding, paths, specs
from .errors import SlimError


def calibration_conditioning(positive=None, negative=None, clip=None, prompts: str = ""):
    """(positive, negative) CONDITIONING for calibration: as connected, else ``prompts`` (one per line) and the
    empty prompt encoded by ``clip``, as CLIP Text Encode would (pooled output included)."""
    if positive:
        if not negative and clip is not None:
            negative = _encode(clip, "")
        return positive, negative
    lines = [p.strip() for p in (prompts or "").splitlines() if p.strip()]
    if clip is None or not lines:
        raise ValueError("sdslim: Train Slim Adapters needs calibration conditioning: connect 'positive' (and "
                         "'negative'), or a CLIP plus one prompt per line in 'prompts'")
    return [c for p in lines for c in _encode(clip, p)], negative or _encode(clip, "")


def _encode(clip, text: str) -> list:
    cond, pooled = clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
    return [[cond, {"pooled_output": pooled}]]


def teacher(model) -> tuple[dict, layout.UNetConfig]:
    """(canonical float32 UNet weights with the MODEL's patches merged, on the CPU; its UNetConfig)."""
    kp = model.get_key_patches(folding.PREFIX)
    folding.check_weights(kp)
    get = folding.merged_getter(kp, torch.device("cpu"), set())
    weights = {k[len(folding.PREFIX):]: get(k[len(folding.PREFIX):]) for k in kp}
    unet = model.model.diffusion_model
    heads = {k: int(getattr(unet, k)) for k in ("num_heads", "num_head_channels")
             if isinstance(getattr(unet, k, None), int) and getattr(unet, k) > 0}
    return weights, layout.config_from_state_dict(weights, heads)


def native_latent_size(model) -> int | None:
    """The latent size the MODEL was made for, when its config says (the tiny demo's loader sets it); None lets
    the trainer use the family's default (64 SD1.5, 96 SD2, 128 SDXL)."""
    return getattr(getattr(model.model, "model_config", None), "sdslim_latent_size", None)


def run(model, filename, ratio, steps, seed, positive=None, clip=None, prompts="", budget="",
        latent_size=0, negative=None, recipe="full", start_from=None, overwrite=False, adapter_dtype=None) -> str:
    """Train (or resume) adapters into ``models/sdslim/<filename>`` and return the trainer's text report.

    ``recipe``: full, quick or data-free (``sdslim_core.train.recipes``); ``start_from``: an adapter file of
    models/sdslim made for the model this one derives from (refit); ``adapter_dtype``: the file's storage dtype
    (fp16, bf16, fp32; None: the default). Calibration runs at ``latent_size`` (0: the
    model's native size). The work folder (calibration data, checkpoints) lives in ``sdslim_work/`` beside
    ``models/sdslim`` and is removed once the file is written; an interrupted run keeps it and resumes from it."""
    try:
        from sdslim_core.train import TrainConfig, recipes, train_adapters
    except ImportError as err:
        raise SlimError(f"sdslim: training needs '{err.name}' in ComfyUI's Python "
                           f"(pip install -r requirements.txt): {err}") from None
    out = paths.output_path(folder_paths, filename)
    refuse_existing(out, overwrite)                 # before any work, and again when the file is written
    recipe = recipe or "full"
    start = paths.resolve(folder_paths, start_from) if start_from and start_from != specs.NO_START else None
    stored = {"adapter_dtype": adapter_dtype} if adapter_dtype else {}
    if start is not None and budget and budget.strip():
        raise ValueError("sdslim: start_from keeps that file's sites and ranks, so it takes no budget: clear "
                         "'budget'")
    if recipe == "data-free":
        if start is not None or (budget and budget.strip()):
            raise ValueError("sdslim: the data-free recipe takes only 'ratio' (no budget, no start_from): it "
                             "measures nothing")
        weights, cfg = teacher(model)
        aset, seconds = recipes.data_free(weights, cfg, TrainConfig(ratio=ratio, **stored), out, overwrite=overwrite)
        return recipes.data_free_text(aset, out, seconds)
    calib, notes = comfyui_conditioning.calibration(*calibration_conditioning(positive, negative, clip, prompts))
    bar = comfy.utils.ProgressBar(1)

    def progress(done, total, *_):
        comfy.model_management.throw_exception_if_processing_interrupted()   # every phase reports, not only steps
        if total:
            bar.update_absolute(done, total)

    weights, cfg = teacher(model)
    options: dict = {"budget": budget.strip()} if budget and budget.strip() else {"ratio": ratio}
    options.update(recipes.host_overrides(recipe, steps, start))
    options.update(stored)
    size = int(latent_size or 0) or native_latent_size(model)
    if size:
        options["latent_size"] = size
    work = paths.work_dir(folder_paths, out)
    device = torch.device(model.load_device)
    if device.type != "cpu":    # the trainer holds its own teacher: ComfyUI's models leave the GPU (reloaded when used)
        comfy.model_management.free_memory(1e30, device)
    result = train_adapters(weights, cfg, calib, out_path=out, progress=progress, resume="auto", seed=seed,
                            device=str(device), work_dir=work, overwrite=overwrite, **options)
    shutil.rmtree(work, ignore_errors=True)
    return "\n".join([f"adapters written to {out}", *notes, "", str(result.report)])
