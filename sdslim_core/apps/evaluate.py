"""`sdslim eval`: same-seed comparison of the teacher and its slim UNet — and of what users pick instead.

Everything runs on the fidelity engine (:mod:`sdslim_core.apps.fidelity`), from the same starting noise (one sample per
seed) and conditioning:

- ``eps_rel_error``: ‖ε_slim − ε_teacher‖ / ‖ε_teacher‖ on the inputs the teacher's own sampling trajectory visits
  (several timesteps from noisy to clean), per timestep and overall;
- ``latent_psnr_db``: PSNR of the slim model's sampled latents against the teacher's (peak = the teacher latents'
  range), per seed;
- with a VAE in the checkpoint: ``image.psnr_db`` / ``image.ssim`` of the decoded images and a side-by-side PNG;
- with LoRAs: ``lora_effect_cosine`` = cos(ε_slim+LoRA − ε_slim, ε_teacher+LoRA − ε_teacher): does the slim model
  move the way the teacher does when the LoRA is applied?
- ``ladder``: the bench's fidelity ladder for this checkpoint: the slim model and the ``compare`` alternatives (fp8
  storage; GGUF Q8_0 … Q4_0 as sdslim's GGUF writer stores them, through the gguf package's quantiser and
  dequantiser; slim + any of them) with params ×, weight bytes, forward FLOPs ×, latent / image
  PSNR, SSIM, ε error (plain and CFG-guided), LoRA-effect cosine and ControlNet-effect cosine. The ControlNet
  effect uses synthetic ControlNet-like residuals (smooth random fields scaled to each skip feature's RMS; a real
  ControlNet needs its own file and control image), identical for every row.

Conditioning: ``--prompt`` (and ``--negative``, default "") through the checkpoint's own text encoders (any SD1.5/SD2/
SDXL checkpoint that carries them, as ComfyUI's CLIPTextEncode encodes; the tiny shipped model uses its own), or
``--embeddings`` (a conditioning file: ``sdslim encode``'s, or ``context`` [T, D] with optional ``uncond``), else
unconditional (zeros context); the result says which. Infinite PSNR (identical outputs) is written as the string ``"inf"`` in JSON.
"""
from __future__ import annotations

import collections
import collections.abc
import json
import math
import time
from pathlib import Path
from typing import Callable, Sequence

import torch


from .. import devices, layout
from ..io.adapters import AdapterSet
from ..io.sizes import file_size
from ..io.tensors import FileFormatError, LazyStateDict, read_header
from ..modules.unet import load_diffusers_unet, open_checkpoint
from ..ops import quant, sampling
from ..ops.lora import merge_loras
from ..text.conditioning import Conditioning, PromptEncoder, common_length, repeat_tokens
from ..tiny import load_tiny_pipeline
from ..train.augment import skip_rms, smooth_residuals
from .fidelity import Candidates, Probe, compare as compare_with, forward_flops, jsonable, reference

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

class _FloatWeights(collections.abc.Mapping):
    """A checkpoint's canonical UNet weights, read from the file as float32 on each access: the ladder's candidates
    are built from it one at a time, with no resident float copy of the teacher beside them (full-size SDXL: 10 GB
    each)."""

    def __init__(self, lazy):
        self._lazy = lazy

    def shapes(self) -> dict:
        return self._lazy.shapes()

    def __getitem__(self, key):
        return self._lazy[key].float()

    def __iter__(self):
        return iter(self._lazy)

    def __len__(self):
        return len(self._lazy)


def _unet_fn(unet, cfg: layout.UNetConfig, cond):
    """``fn(x, t, context)`` for the sampler; SDXL gets each row's pooled text (the negative prompt's on the rows
    that hold its context; zeros when none is known) and the size conditioning (``cond.time_ids``, else the
    latent size × 8)."""
    if not cfg.adm_in_channels:
        return sampling.diffusers_fn(unet)
    p_dim = cfg.adm_in_channels - 6 * 256

    def fn(x, t, context, **residuals):
        b = x.shape[0]
        pooled = cond.pooled if cond.pooled is not None else torch.zeros(1, p_dim)
        text = pooled.to(x).expand(b, -1).clone()
        if cond.uncond is not None and cond.uncond_pooled is not None:
            unc = cond.uncond.to(context)[0]
            rows = [i for i in range(b) if context[i].shape == unc.shape and torch.equal(context[i], unc)]
            text[rows] = cond.uncond_pooled.to(x)
        if cond.time_ids is not None:
            time_ids = cond.time_ids.to(x).reshape(1, 6).expand(b, 6)
        else:
            h, w = x.shape[-2] * 8, x.shape[-1] * 8
            time_ids = torch.tensor([[h, w, 0, 0, h, w]], dtype=x.dtype, device=x.device).expand(b, 6)
        added = {"text_embeds": text, "time_ids": time_ids}
        return unet(x, t, encoder_hidden_states=context, added_cond_kwargs=added, **residuals).sample
    return fn


# ---------------------------------------------------------------------------------------- conditioning

def _load_embeddings(path, cfg) -> Conditioning:
    """The first row of a conditioning file (``sdslim encode``'s, or 'context' [tokens, dim] + optional 'uncond',
    'pooled', 'uncond_pooled', 'time_ids'), context and uncond brought to one length."""
    lazy = LazyStateDict(path)
    if "context" not in lazy:
        raise FileFormatError(f"{path}: an embeddings file needs a 'context' tensor [tokens, {cfg.context_dim}] "
                              f"(optional 'uncond'); found {sorted(lazy)[:5]}")
    cond = Conditioning.load(path)
    context = cond.context[:1]
    if context.ndim != 3 or context.shape[-1] != cfg.context_dim:
        raise FileFormatError(f"{path}: 'context' has shape {tuple(cond.context.shape)}, the UNet needs "
                              f"[tokens, {cfg.context_dim}]")
    uncond = cond.uncond
    if uncond is not None:
        if uncond.shape[-1] != cfg.context_dim:
            raise FileFormatError(f"{path}: 'uncond' {tuple(uncond.shape)} does not have the context's width "
                                  f"{cfg.context_dim}")
        length = common_length([context.shape[1], uncond.shape[1]])
        context, uncond = repeat_tokens(context, length), repeat_tokens(uncond[:1], length)
    pooled = None if cond.pooled is None else cond.pooled.reshape(-1, cond.pooled.shape[-1])[:1]
    return Conditioning(context, uncond, pooled, cond.uncond_pooled, cond.time_ids, cond.info)


def _encode_prompt(path, cfg, prompt, negative, text_options) -> Conditioning:
    """The prompt and its negative through the checkpoint's own text encoders; CFG rows at one length."""
    cond = PromptEncoder(path, cfg.family, **(text_options or {})).encode([prompt], negative)
    cond.time_ids = None                                  # the size conditioning follows the sampled latents
    length = common_length([cond.context.shape[1], cond.uncond.shape[1]])
    cond.context, cond.uncond = repeat_tokens(cond.context, length), repeat_tokens(cond.uncond, length)
    return cond


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

    def __init__(self, ckpt, prompt, negative, embeddings, guidance, latent_size, device, text_options=None):
        path = Path(ckpt)
        if path.is_file() and path.suffix.lower() == ".safetensors":
            _, meta = read_header(path)
            if meta.get("sdslim.slim") == "1":
                raise FileFormatError(f"{path}: this is a slim checkpoint; eval compares the original checkpoint "
                                      "with its slim form: pass the original --ckpt and the --adapters")
        if prompt is not None and embeddings:
            raise ValueError("give --prompt or --embeddings, not both")
        self.checkpoint = open_checkpoint(ckpt)
        cfg = self.cfg = self.checkpoint.config
        self.decode, self.image_note = None, None
        if TINY_META in self.checkpoint.metadata:
            pipe = load_tiny_pipeline(self.checkpoint.path)
            self.teacher = pipe.unet
            self.schedule = pipe.schedule
            self.latent_size = latent_size or pipe.latent_size
            self.decode = pipe.decode
            if embeddings:
                self.cond = _load_embeddings(embeddings, cfg)
                self.conditioning = f"embeddings from {embeddings}"
            else:
                prompt = DEFAULT_PROMPT if prompt is None else prompt
                self.cond = Conditioning(pipe.encode_prompt([prompt]), pipe.encode_prompt([negative]))
                self.conditioning = f"the checkpoint's own (tiny) text encoder, prompt {prompt!r}"
            default_guidance = 4.0
        else:
            self.teacher = load_diffusers_unet(self.checkpoint.weights, cfg, dtype=torch.float32).eval()
            self.schedule = sampling.Schedule()
            self.latent_size = latent_size or {"sd15": 64, "sd2": 96, "sdxl": 128}[cfg.family]
            entries = self.checkpoint.source.entries
            vae, self.image_note = _generic_vae(self.checkpoint.path, entries, cfg.family)
            if vae is not None:
                sf = vae.config.scaling_factor
                self.decode = lambda z: ((vae.to(z.device).decode(z / sf).sample + 1) / 2).clamp(0, 1)
            if embeddings:
                self.cond = _load_embeddings(embeddings, cfg)
                self.conditioning = f"embeddings from {embeddings}"
            elif prompt is not None:
                self.cond = _encode_prompt(ckpt, cfg, prompt, negative, text_options)
                self.conditioning = (f"the checkpoint's own text encoders, prompt {prompt!r}, negative {negative!r} "
                                     f"(tokenizer: {self.cond.info['tokenizer']})")
            else:
                self.cond = Conditioning(torch.zeros(1, 77, cfg.context_dim), None)
                self.conditioning = ("unconditional: zeros context [1, 77, %d]; pass --prompt (encoded by the "
                                     "checkpoint's own text encoders) or --embeddings FILE to condition"
                                     % cfg.context_dim)
            default_guidance = 7.5 if self.cond.uncond is not None else 1.0
        self.guidance = default_guidance if guidance is None else guidance
        if self.cond.uncond is None and self.guidance != 1.0:
            raise ValueError("classifier-free guidance needs an unconditional embedding ('uncond' in --embeddings)")
        self.teacher = self.teacher.to(device).requires_grad_(False)
        self.context = self.cond.context.to(device)
        self.uncond = None if self.cond.uncond is None else self.cond.uncond.to(device)


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


COMPARE = quant.METHODS + tuple(f"slim+{m}" for m in quant.METHODS)   # fp8, q8_0 … q4_0, slim+each


def _ladder_row(label, r: dict, weights: dict, method, flops: float, teacher_params: int) -> dict:
    n = sum(v.numel() for v in weights.values())
    keys = ("latent_psnr_db", "image_psnr_db", "image_psnr_db_median", "image_ssim", "eps_rel_error",
            "guided_eps_rel_error",
            "lora_effect_cosine", "controlnet_effect_cosine")
    return {"row": label, "params_ratio": n / teacher_params, "weight_bytes": quant.storage_bytes(weights, method),
            "flops_ratio": flops, **{k: r.get(k) for k in keys}}


@torch.no_grad()
def evaluate(ckpt, adapters, loras: Sequence = (), seeds: int = 2, steps: int = 20, method: str = "ddim",
             guidance: float | None = None, prompt: str | None = None, embeddings=None, png=None,
             latent_size: int | None = None, eps_points: int = 5, select: float = 1.0, device: str = "cpu",
             compare: Sequence[str] = (), negative: str = "", text_options: dict | None = None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Compare the teacher (``ckpt``) with its slim form (``adapters`` folded), with ``loras`` for the LoRA-effect
    cosine, and with each ``compare`` alternative (:data:`COMPARE`) in the ladder; returns a dict. ``prompt`` and
    ``negative`` are encoded by the checkpoint's own text encoders (``text_options``: ``tokenizer``,
    ``clip_skip`` of :class:`~sdslim_core.text.conditioning.PromptEncoder`); ``progress(message)`` hears each phase."""
    if seeds < 1:
        raise ValueError("--seeds must be at least 1")
    unknown = sorted(set(compare) - set(COMPARE))
    if unknown:
        raise ValueError(f"--compare: unknown {unknown}; choose from {', '.join(COMPARE)}")
    device = devices.resolve(device, float64=True)
    t0 = time.perf_counter()
    setup = _Setup(ckpt, prompt, negative, embeddings, guidance, latent_size, device, text_options)
    cfg = setup.cfg
    aset = adapters if isinstance(adapters, AdapterSet) else AdapterSet.load(adapters)
    if select < 1.0:
        aset = aset.select(select)
    weights = _FloatWeights(setup.checkpoint.weights)
    shapes = weights.shapes()
    aset.check_model(shapes, family=cfg.family)
    report = None
    merged = {}
    if loras:
        merged, report = merge_loras(weights, list(loras), cfg, fold_sites=aset)
    cands = Candidates(cfg, weights, merged)
    teacher = setup.teacher
    del setup.teacher                                     # freed after the reference: one UNet resident at a time

    def fn_of(unet):
        return _unet_fn(unet, cfg, setup.cond)
    noise = torch.cat([torch.randn(1, cfg.in_channels, setup.latent_size, setup.latent_size,
                                   generator=torch.Generator().manual_seed(s)) for s in range(seeds)]).to(device)
    context = setup.context.expand(seeds, -1, -1)
    uncond = None if setup.uncond is None else setup.uncond.expand(seeds, -1, -1)
    f_teacher = fn_of(teacher)
    rms = skip_rms(teacher, lambda: f_teacher(noise, torch.full((seeds,), 500.0, device=device), context))
    control_gen = torch.Generator().manual_seed(1234)

    def control(x, t, ctx):
        return smooth_residuals(rms, x.shape[0], control_gen, x.device, x.dtype)
    probe = Probe(fn_of=fn_of, context=context, uncond=uncond, noise=noise, schedule=setup.schedule, steps=steps,
                  method=method, guidance=setup.guidance, decode=setup.decode, control=control, eps_points=eps_points)
    teacher_lora = None
    if loras:                                             # shares the teacher's unchanged tensors
        teacher_lora = cands.unet({**layout.to_canonical(teacher.state_dict())[0], **merged}).to(device)
    say = progress or (lambda message: None)
    say(f"teacher: {seeds} sample(s) of {steps} steps at {setup.latent_size}² latents"
        + (", with and without the LoRAs" if loras else ""))
    ref = reference(probe, teacher, teacher_lora)
    flop_args = ref.inputs[0]
    teacher_flops = forward_flops(f_teacher, *flop_args)
    del teacher, teacher_lora, f_teacher

    def flops_ratio(model):
        return forward_flops(fn_of(model), *flop_args) / teacher_flops

    teacher_params = sum(math.prod(s) for s in shapes.values())
    rows, slim_r = [], None
    todo = [("slim", None)] + [(c, c) for c in compare]
    for i, (label, what) in enumerate(todo):
        say(f"row {i + 1}/{len(todo)}: {label}")
        if what is None or what.startswith("slim+"):
            storage = what.removeprefix("slim+") if what else None
            model, model_lora, w = cands.slim(aset, storage)
        else:
            model, model_lora, w = cands.quantised(what)
            storage = what
        model = model.to(device)
        model_lora = None if model_lora is None else model_lora.to(device)
        r = compare_with(probe, ref, model, model_lora)
        rows.append(_ladder_row(label, r, w, storage, flops_ratio(model), teacher_params))
        if what is None:
            slim_r, slim_params = r, sum(p.numel() for p in model.parameters())
        del model, model_lora, w                          # before the next candidate is built
    d = slim_r["detail"]
    by_t: dict = collections.defaultdict(list)
    cos_t: dict = collections.defaultdict(list)
    for i, tt in enumerate(d["timesteps"]):
        by_t[int(round(tt))].append(d["eps_rel_error"][i])
        if "lora_effect_cosine" in d:
            cos_t[int(round(tt))].append(d["lora_effect_cosine"][i])
    result = {
        "checkpoint": str(setup.checkpoint.path),
        "family": cfg.family,
        "adapters": str(aset.source),
        "sites": len(aset.sites),
        "params": {"teacher": teacher_params, "slim": slim_params},
        "conditioning": setup.conditioning,
        "sampler": {"method": method, "steps": steps, "guidance": setup.guidance, "seeds": seeds,
                    "latent_size": setup.latent_size, "schedule": setup.schedule.to_dict()},
        "eps_rel_error": {"mean": _mean(d["eps_rel_error"]), "max": max(d["eps_rel_error"]),
                          "overall": slim_r["eps_rel_error"], "guided": slim_r["guided_eps_rel_error"],
                          "by_timestep": {t: _mean(v) for t, v in sorted(by_t.items(), reverse=True)}},
        "latent_psnr_db": {"mean": _mean(d["latent_psnr_db"]), "min": min(d["latent_psnr_db"]),
                           "per_seed": d["latent_psnr_db"]},
        "ladder": rows,
        "controlnet_note": "ControlNet cos (synthetic): ControlNet-like residuals (smooth random fields at each "
                           "skip feature's RMS scale), the same for every row; no real ControlNet was given",
        "source_file": file_size(ckpt).to_dict(),
    }
    if setup.decode is not None:
        image = {"psnr_db": _mean(d["image_psnr_db"]), "ssim": _mean(d["image_ssim"]),
                 "per_seed_psnr_db": d["image_psnr_db"], "per_seed_ssim": d["image_ssim"]}
        if png:
            pairs = [(a.cpu(), b.cpu()) for a, b in zip(ref.images, slim_r["images"])]
            image["png"] = str(_png(pairs, Path(png)))
        result["image"] = image
    else:
        result["image"] = None
        result["image_note"] = setup.image_note
    if loras:
        cs = d["lora_effect_cosine"]
        result["loras"] = [{"path": str(p), "strength": float(s)} for p, s in loras]
        result["lora_effect_cosine"] = {"mean": _mean(cs), "min": min(cs), "overall": slim_r["lora_effect_cosine"],
                                        "by_timestep": {t: _mean(v) for t, v in sorted(cos_t.items(),
                                                                                     reverse=True)}}
        result["merge"] = report.to_dict()
        result["warnings"] = list(report.warnings)
    result["seconds"] = time.perf_counter() - t0
    return result


def format_ladder(rows: list) -> str:
    """The ladder rows as a Markdown table."""
    def f(v, spec):
        return "–" if v is None else ("inf" if v == math.inf else format(v, spec))
    out = ["| row | params × | UNet MB | FLOPs × | latent PSNR dB | image PSNR dB | median image PSNR dB | SSIM "
           "| ε rel err | guided ε err | LoRA cos | ControlNet cos (synthetic) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['row']} | {r['params_ratio']:.3f} | {r['weight_bytes'] / 1e6:.1f} | {r['flops_ratio']:.2f} "
                   f"| {f(r['latent_psnr_db'], '.1f')} | {f(r['image_psnr_db'], '.1f')} "
                   f"| {f(r['image_psnr_db_median'], '.1f')} | {f(r['image_ssim'], '.3f')} "
                   f"| {f(r['eps_rel_error'], '.4f')} | {f(r['guided_eps_rel_error'], '.4f')} "
                   f"| {f(r['lora_effect_cosine'], '.4f')} | {f(r['controlnet_effect_cosine'], '.4f')} |")
    return "\n".join(out)


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
    src = r["source_file"]
    lines += ["", "fidelity ladder (same seeds). UNet MB: the UNet tensors as each format's file stores them (a slim "
              "checkpoint or fp8 file adds the text encoders and VAE, "
              f"{(src['text_encoders'] + src['vae']) / 1e6:.1f} MB here; a GGUF file holds the UNet only):",
              format_ladder(r["ladder"]), r["controlnet_note"]]
    return "\n".join(lines)


def dumps(result: dict) -> str:
    return json.dumps(jsonable(result))
