"""`sdslim eval`: same-seed comparison of the teacher and the slim UNet (optionally both with the same LoRAs).

Metrics, all from the same starting noise and conditioning:

- ``eps_rel_error``: ‖ε_slim − ε_teacher‖ / ‖ε_teacher‖ on the inputs the teacher's own sampling trajectory visits
  (several timesteps from noisy to clean), per timestep and overall;
- ``latent_psnr_db``: PSNR of the slim model's sampled latents against the teacher's (peak = the teacher latents'
  range), per seed;
- with a VAE in the checkpoint: ``image.psnr_db`` / ``image.ssim`` of the decoded images and a side-by-side PNG;
- with LoRAs: ``lora_effect_cosine`` = cos(ε_slim+LoRA − ε_slim, ε_teacher+LoRA − ε_teacher): does the slim model
  move the way the teacher does when the LoRA is applied?

Conditioning: the checkpoint's own text encoder when it can run offline (the tiny shipped model), else embeddings
from ``--embeddings`` (a safetensors file with ``context`` [T, D] and optional ``uncond``), else unconditional
(zeros context); the result says which. Infinite PSNR (identical outputs) is written as the string ``"inf"`` in JSON.
"""
from __future__ import annotations

import collections
import json
import math
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from . import fold, layout, sampling, swap
from .adapters import AdapterSet
from .fidelity import cosine, jsonable, psnr, rel_error, ssim
from .lora import merge_loras
from .safetensors_io import FileFormatError, LazyStateDict, read_header
from .unet import load_diffusers_unet, open_checkpoint

TINY_META = "sdslim.tiny.text_config"
VAE_PREFIXES = ("first_stage_model.", "vae.")
DEFAULT_PROMPT = "a red circle on a blue background"


def _mean(values):
    values = list(values)
    if not values:
        return None
    if any(v == math.inf for v in values):
        finite = [v for v in values if math.isfinite(v)]
        return math.inf if not finite else sum(finite) / len(finite)
    return sum(values) / len(values)


# --------------------------------------------------------------------------------------------- models

def with_weights(unet: nn.Module, cfg: layout.UNetConfig, updates: dict) -> nn.Module:
    """A clone of a diffusers ``unet`` sharing its parameters except the canonical keys in ``updates``."""
    out = swap.clone_sharing(unet)
    for ckey, value in updates.items():
        dkey = layout.canonical_to_diffusers_key(cfg, ckey)
        path, _, pname = dkey.rpartition(".")
        module = out.get_submodule(path)
        old = getattr(module, pname)
        setattr(module, pname, nn.Parameter(value.to(old.dtype).to(old.device), requires_grad=False))
    return out


class _Models:
    """Teacher and slim UNets (with LoRAs when given), plus the LoRA-free pair for the LoRA-effect cosine."""

    def __init__(self, teacher: nn.Module, cfg, aset: AdapterSet, loras: Sequence):
        weights = layout.to_canonical(teacher.state_dict())[0]
        self.report = None
        self.teacher0 = teacher
        self.slim0 = swap.build_slim_module(teacher, aset, fold.fold_state_dict(weights, aset))
        if loras:
            merged, self.report = merge_loras(weights, loras, cfg, fold_sites=aset)
            self.teacher = with_weights(teacher, cfg, merged)
            both = collections.ChainMap(merged, weights)
            self.slim = swap.build_slim_module(self.teacher, aset, fold.fold_state_dict(both, aset))
        else:
            self.teacher, self.slim = self.teacher0, self.slim0

    def params(self) -> dict:
        def count(m):
            return sum(p.numel() for p in m.parameters())
        return {"teacher": count(self.teacher0), "slim": count(self.slim0)}


def _unet_fn(unet, cfg: layout.UNetConfig, pooled=None, size=None):
    """``fn(x, t, context)`` for the sampler; SDXL gets pooled text (zeros unless given) and size conditioning."""
    if not cfg.adm_in_channels:
        return sampling.diffusers_fn(unet)

    def fn(x, t, context, **residuals):
        b = x.shape[0]
        h, w = size or (x.shape[-2] * 8, x.shape[-1] * 8)
        text = pooled if pooled is not None else torch.zeros(1, cfg.adm_in_channels - 6 * 256)
        time_ids = torch.tensor([[h, w, 0, 0, h, w]], dtype=x.dtype).expand(b, 6)
        cond = {"text_embeds": text.to(x).expand(b, -1), "time_ids": time_ids.to(x.device)}
        return unet(x, t, encoder_hidden_states=context, added_cond_kwargs=cond, **residuals).sample
    return fn


# ---------------------------------------------------------------------------------------- conditioning

def _load_embeddings(path, cfg) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    lazy = LazyStateDict(path)
    if "context" not in lazy:
        raise FileFormatError(f"{path}: an embeddings file needs a 'context' tensor [tokens, {cfg.context_dim}] "
                              f"(optional 'uncond' of the same shape); found {sorted(lazy)[:5]}")
    context = lazy["context"].float()
    context = context[None] if context.ndim == 2 else context
    if context.ndim != 3 or context.shape[-1] != cfg.context_dim:
        raise FileFormatError(f"{path}: 'context' has shape {tuple(context.shape)}, the UNet needs "
                              f"[tokens, {cfg.context_dim}]")
    uncond = None
    if "uncond" in lazy:
        uncond = lazy["uncond"].float()
        uncond = uncond[None] if uncond.ndim == 2 else uncond
        if uncond.shape != context.shape:
            raise FileFormatError(f"{path}: 'uncond' {tuple(uncond.shape)} differs from 'context' "
                                  f"{tuple(context.shape)}")
    pooled = lazy["pooled"].float().reshape(1, -1) if "pooled" in lazy else None
    return context[:1], None if uncond is None else uncond[:1], pooled


def _generic_vae(path: Path, entries: dict, family: str):
    """A diffusers AutoencoderKL from LDM VAE keys (config read from shapes), or (None, reason)."""
    prefix = next((p for p in VAE_PREFIXES if f"{p}decoder.conv_out.weight" in entries), None)
    if prefix is None:
        present = any(k.startswith(VAE_PREFIXES) for k in entries)
        return None, ("the checkpoint's VAE is incomplete" if present else "the checkpoint has no VAE")
    try:
        from diffusers import AutoencoderKL
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
        lazy = LazyStateDict(path)
        vae_sd = {k[len(prefix):]: lazy[k].float() for k in entries if k.startswith(prefix)}
        levels = sorted({int(k.split(".")[2]) for k in vae_sd if k.startswith("encoder.down.")})
        widths = [vae_sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] for i in levels]
        per_level = len({k.split(".")[4] for k in vae_sd if k.startswith("encoder.down.0.block.")})
        config = dict(in_channels=vae_sd["encoder.conv_in.weight"].shape[1],
                      out_channels=vae_sd["decoder.conv_out.weight"].shape[0],
                      down_block_types=["DownEncoderBlock2D"] * len(widths),
                      up_block_types=["UpDecoderBlock2D"] * len(widths), block_out_channels=widths,
                      layers_per_block=per_level, latent_channels=vae_sd["decoder.conv_in.weight"].shape[1],
                      norm_num_groups=32, scaling_factor=0.13025 if family == "sdxl" else 0.18215)
        vae = AutoencoderKL(**config)
        vae.load_state_dict(convert_ldm_vae_checkpoint(vae_sd, config), strict=True)
        return vae.eval().requires_grad_(False), None
    except Exception as err:  # noqa: BLE001 - any failure only disables the image metrics
        return None, f"the checkpoint's VAE could not be built ({type(err).__name__}: {str(err)[:160]})"


class _Setup:
    """Everything the comparison needs from the checkpoint: teacher UNet, conditioning, schedule, decoder."""

    def __init__(self, ckpt, prompt, embeddings, guidance, latent_size, device):
        path = Path(ckpt)
        if path.is_file() and path.suffix.lower() == ".safetensors":
            _, meta = read_header(path)
            if meta.get("sdslim.slim") == "1":
                raise FileFormatError(f"{path}: this is a slim checkpoint; eval compares the original checkpoint "
                                      "with its slim form: pass the original --ckpt and the --adapters")
        self.checkpoint = open_checkpoint(ckpt)
        cfg = self.cfg = self.checkpoint.config
        self.pooled = None
        self.decode, self.image_note = None, None
        if TINY_META in self.checkpoint.metadata:
            from .tiny import load_tiny_pipeline
            pipe = load_tiny_pipeline(self.checkpoint.path)
            self.teacher = pipe.unet
            self.schedule = pipe.schedule
            self.latent_size = latent_size or pipe.latent_size
            self.decode = pipe.decode
            if embeddings:
                self.context, self.uncond, self.pooled = _load_embeddings(embeddings, cfg)
                self.conditioning = f"embeddings from {embeddings}"
            else:
                prompt = DEFAULT_PROMPT if prompt is None else prompt
                self.context, self.uncond = pipe.encode_prompt([prompt]), pipe.encode_prompt([""])
                self.conditioning = f"the checkpoint's own (tiny) text encoder, prompt {prompt!r}"
            self.guidance = 4.0 if guidance is None else guidance
        else:
            if prompt is not None:
                raise ValueError("--prompt needs a text encoder that runs offline; this checkpoint's CLIP needs its "
                                 "tokenizer files, which sdslim does not download: pass --embeddings FILE instead")
            self.teacher = load_diffusers_unet(self.checkpoint.weights, cfg, dtype=torch.float32).eval()
            self.schedule = sampling.Schedule()
            self.latent_size = latent_size or {"sd15": 64, "sd2": 96, "sdxl": 128}[cfg.family]
            entries = self.checkpoint.source.entries
            vae, self.image_note = _generic_vae(self.checkpoint.path, entries, cfg.family)
            if vae is not None:
                sf = vae.config.scaling_factor
                self.decode = lambda z: ((vae.to(z.device).decode(z / sf).sample + 1) / 2).clamp(0, 1)
            if embeddings:
                self.context, self.uncond, self.pooled = _load_embeddings(embeddings, cfg)
                self.conditioning = f"embeddings from {embeddings}"
                self.guidance = (7.5 if self.uncond is not None else 1.0) if guidance is None else guidance
            else:
                self.context, self.uncond = torch.zeros(1, 77, cfg.context_dim), None
                self.conditioning = ("unconditional: zeros context [1, 77, %d]; the checkpoint's CLIP text encoder "
                                     "needs tokenizer files that are not available offline, so pass --embeddings "
                                     "FILE.safetensors to condition" % cfg.context_dim)
                self.guidance = 1.0 if guidance is None else guidance
        if self.uncond is None and self.guidance != 1.0:
            raise ValueError("classifier-free guidance needs an unconditional embedding ('uncond' in --embeddings)")
        self.teacher = self.teacher.to(device).requires_grad_(False)
        self.context = self.context.to(device)
        self.uncond = None if self.uncond is None else self.uncond.to(device)


# ----------------------------------------------------------------------------------------------- driver

def _png(rows: list[tuple[torch.Tensor, torch.Tensor]], path: Path) -> Path:
    """Teacher | slim | |difference|×4 for each seed, one row per seed."""
    from PIL import Image
    tiles = []
    for t, s in rows:
        diff = ((t - s).abs() * 4).clamp(0, 1)
        tiles.append(torch.cat([t, s, diff], dim=-1))
    grid = torch.cat(tiles, dim=-2)
    scale = max(1, min(8, 384 // grid.shape[-1]))          # small (tiny-model) images are enlarged
    img = (grid.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
    im = Image.fromarray(img)
    if scale > 1:
        im = im.resize((im.width * scale, im.height * scale), Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path)
    return path


@torch.no_grad()
def evaluate(ckpt, adapters, loras: Sequence = (), seeds: int = 2, steps: int = 20, method: str = "ddim",
             guidance: float | None = None, prompt: str | None = None, embeddings=None, png=None,
             latent_size: int | None = None, eps_points: int = 5, select: float = 1.0, device: str = "cpu") -> dict:
    """Compare the teacher (``ckpt`` + ``loras``) with its slim form (``adapters`` folded); returns a dict."""
    if seeds < 1:
        raise ValueError("--seeds must be at least 1")
    t0 = time.perf_counter()
    setup = _Setup(ckpt, prompt, embeddings, guidance, latent_size, device)
    cfg = setup.cfg
    aset = adapters if isinstance(adapters, AdapterSet) else AdapterSet.load(adapters)
    if select < 1.0:
        aset = aset.select(select)
    shapes = {k: tuple(v.shape) for k, v in layout.to_canonical(setup.teacher.state_dict())[0].items()}
    aset.check_model(shapes, family=cfg.family)
    models = _Models(setup.teacher, cfg, aset, list(loras))

    def fn(unet):
        return _unet_fn(unet, cfg, setup.pooled)
    f_teacher, f_slim = fn(models.teacher), fn(models.slim)
    f_teacher0, f_slim0 = fn(models.teacher0), fn(models.slim0)
    sample_kw = dict(schedule=setup.schedule, steps=steps, method=method, guidance=setup.guidance)

    eps_by_t: dict = collections.defaultdict(list)
    cos_by_t: dict = collections.defaultdict(list)
    latent_psnr, image_psnr, image_ssim, rows = [], [], [], []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(1, cfg.in_channels, setup.latent_size, setup.latent_size, generator=g).to(device)
        calls = []

        def recording(x, t, context, **res):
            out = f_teacher(x, t, context, **res)
            calls.append((x, t, context, out))
            return out
        lat_t = sampling.sample(recording, noise, setup.context, setup.uncond, **sample_kw)
        lat_s = sampling.sample(f_slim, noise, setup.context, setup.uncond, **sample_kw)
        k = min(eps_points, len(calls))             # evenly spaced along the trajectory, first and last included
        picks = sorted({round(i * (len(calls) - 1) / max(1, k - 1)) for i in range(k)})
        for i in picks:
            x, t, context, e_t = calls[i]
            tkey = int(round(float(t.flatten()[0])))
            e_s = f_slim(x, t, context)
            eps_by_t[tkey].append(rel_error(e_s, e_t))
            if loras:
                d_t = e_t - f_teacher0(x, t, context)
                d_s = e_s - f_slim0(x, t, context)
                cos_by_t[tkey].append(cosine(d_s, d_t))
        latent_psnr.append(psnr(lat_s, lat_t))
        if setup.decode is not None:
            img_t, img_s = setup.decode(lat_t.float())[0], setup.decode(lat_s.float())[0]
            image_psnr.append(psnr(img_s, img_t, peak=1.0))
            image_ssim.append(ssim(img_s, img_t))
            rows.append((img_t.cpu(), img_s.cpu()))

    all_eps = [v for vs in eps_by_t.values() for v in vs]
    result = {
        "checkpoint": str(setup.checkpoint.path),
        "family": cfg.family,
        "adapters": str(aset.source),
        "sites": len(aset.sites),
        "params": models.params(),
        "conditioning": setup.conditioning,
        "sampler": {"method": method, "steps": steps, "guidance": setup.guidance, "seeds": seeds,
                    "latent_size": setup.latent_size, "schedule": setup.schedule.to_dict()},
        "eps_rel_error": {"mean": _mean(all_eps), "max": max(all_eps),
                          "by_timestep": {t: _mean(v) for t, v in sorted(eps_by_t.items(), reverse=True)}},
        "latent_psnr_db": {"mean": _mean(latent_psnr), "min": min(latent_psnr), "per_seed": latent_psnr},
    }
    if setup.decode is not None:
        image = {"psnr_db": _mean(image_psnr), "ssim": _mean(image_ssim), "per_seed_psnr_db": image_psnr,
                 "per_seed_ssim": image_ssim}
        if png:
            image["png"] = str(_png(rows, Path(png)))
        result["image"] = image
    else:
        result["image"] = None
        result["image_note"] = setup.image_note
    if loras:
        all_cos = [v for vs in cos_by_t.values() for v in vs]
        result["loras"] = [{"path": str(p), "strength": float(s)} for p, s in loras]
        result["lora_effect_cosine"] = {"mean": _mean(all_cos), "min": min(all_cos),
                                        "by_timestep": {t: _mean(v) for t, v in sorted(cos_by_t.items(),
                                                                                     reverse=True)}}
        result["merge"] = models.report.to_dict()
        result["warnings"] = list(models.report.warnings)
    result["seconds"] = time.perf_counter() - t0
    return result


def format_result(r: dict) -> str:
    """Human-readable summary of :func:`evaluate`'s result."""
    def db(v):
        return "inf (identical)" if v == math.inf else f"{v:.2f} dB"
    lines = [f"{r['family']} teacher vs slim ({r['sites']} sites; UNet {r['params']['teacher'] / 1e6:.2f}M -> "
             f"{r['params']['slim'] / 1e6:.2f}M params)",
             f"conditioning: {r['conditioning']}",
             f"sampler: {r['sampler']['method']} {r['sampler']['steps']} steps, guidance {r['sampler']['guidance']}, "
             f"{r['sampler']['seeds']} seed(s), latent {r['sampler']['latent_size']}x{r['sampler']['latent_size']}",
             f"eps relative error: mean {r['eps_rel_error']['mean']:.4g}, max {r['eps_rel_error']['max']:.4g}  (" +
             ", ".join(f"t={t}: {v:.4g}" for t, v in r["eps_rel_error"]["by_timestep"].items()) + ")",
             f"latent PSNR: mean {db(r['latent_psnr_db']['mean'])}, min {db(r['latent_psnr_db']['min'])}"]
    if r.get("image"):
        im = r["image"]
        lines.append(f"image PSNR {db(im['psnr_db'])}, SSIM {im['ssim']:.4f}" +
                     (f"; side by side (teacher | slim | 4x difference): {im['png']}" if im.get("png") else ""))
    else:
        lines.append(f"images: not compared ({r.get('image_note')})")
    if "lora_effect_cosine" in r:
        c = r["lora_effect_cosine"]
        lines.append(f"LoRA effect cosine: mean {c['mean']:.4f}, min {c['min']:.4f}")
        lines += [f"warning: {w}" for w in r.get("warnings", [])]
    return "\n".join(lines)


def dumps(result: dict) -> str:
    return json.dumps(jsonable(result))
