"""Training adapters from the webui's *SD Slim* tab, importable without the webui: the form, the refusals, the
teacher (the loaded UNet as it is without any LoRA), the webui's prompt conditioning as a
:class:`~sdslim_core.train.Calibration`, and the trainer's progress as the webui's job state. ``scripts/sdslim.py``
calls the webui (``prompt_parser``, ``call_queue``, ``lowvram``) and hands the results in; objects of the webui
(``shared.state``, the UNet) are only read or set by attribute.

SDXL: the webui's conditioning of a prompt is ``{"crossattn": [T, 2048], "vector": [2816]}``; ``vector`` is the
pooled OpenCLIP-bigG embedding (1280) followed by the size/crop embeddings (6 × 256: height, width, crop top,
crop left, target height, target width), which the trainer recomputes from the latent size
(:func:`~sdslim_core.train.calibration.sdxl_time_ids`); :func:`calibration` keeps the pooled part and says when the
tail is not the embedding of the trainer's ids (a non-zero crop setting).
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch

from ... import layout
from ...io.adapters import DEFAULT_FILE_DTYPE, FILE_DTYPES
from ...train import Calibration, recipes
from ...train.calibration import SDXL_TIME_EMBEDS, sdxl_time_ids
from ...train.config import parse_budget
from ...train.report import short_site
from ...train.session import DEFAULT_LATENT
from .. import train_paths
from .lora import base_weights

JOB = "sdslim-train"                    # shared.state.job while training
SIZE_STEP = 64                          # image sizes are multiples of this (latents of 8: every UNet downsamples)
TIME_EMBED_DIM = 256                    # width of each size/crop embedding in SDXL's vector
REFINER_CONTEXT = 1280                  # the SDXL refiner's context width (base SDXL: 2048)
_TEACHER_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Interrupted(Exception):
    """The webui's Interrupt was pressed: the run stops after its current step; the work folder keeps it."""


@dataclasses.dataclass(frozen=True)
class TrainForm:
    """The SD Slim tab's inputs, checked."""
    prompts: tuple
    negative: str
    ratio: float | None     # None when a budget is given
    budget: str | None
    steps: int              # both stages; 0: the trainer's defaults
    size: int               # image side in pixels; 0: the model's native size
    seed: int
    filename: str
    recipe: str = recipes.DEFAULT_RECIPE
    start_from: str | None = None   # an adapter file name in models/sdslim (refit for a derivative), or None
    adapter_dtype: str = DEFAULT_FILE_DTYPE   # the adapter file's storage dtype (training runs in float32)

    def start_path(self, adapter_dir: str) -> str | None:
        """The ``start_from`` file in ``adapter_dir`` (a clear error when it is gone), or None."""
        if self.start_from is None:
            return None
        path = os.path.join(adapter_dir, self.start_from)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SD Slim training: start from adapters: {path} not found")
        return path

    def paths(self, adapter_dir: str) -> tuple[str, str]:
        """(adapter file in ``adapter_dir``, its work folder beside that folder)."""
        out = train_paths.adapter_output(adapter_dir, self.filename)
        return out, train_paths.work_dir(adapter_dir, out)

    def pixels(self, cfg: layout.UNetConfig) -> int:
        """The image side of the calibration trajectories: the form's, else the family's native size."""
        return self.size or DEFAULT_LATENT.get(cfg.family, 64) * 8

    def options(self, cfg: layout.UNetConfig, unet_dtype: torch.dtype, device: str, adapter_dir: str = "") -> dict:
        """``train_adapters`` keyword options. The teacher runs in the webui UNet's dtype (``--no-half``: float32);
        the recipe's settings (``start_from`` is looked up in ``adapter_dir``)."""
        out = {"seed": self.seed, "latent_size": self.pixels(cfg) // 8, "device": device,
               "teacher_dtype": _TEACHER_DTYPES.get(unet_dtype, "auto")}
        out.update({"budget": self.budget} if self.budget else {"ratio": self.ratio})
        out.update(recipes.host_overrides(self.recipe, self.steps, self.start_path(adapter_dir)))
        out["adapter_dtype"] = self.adapter_dtype
        return out


def _whole(value, name: str, low: int, high: int | None = None) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"SD Slim training: {name} must be a whole number, got {value!r}") from None
    if number != int(number) or number < low or (high is not None and number > high):
        span = f"≥ {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"SD Slim training: {name} must be a whole number {span}, got {value!r}")
    return int(number)


NO_START = "(none)"                     # the "start from adapters" choice of a run from scratch


def parse_form(prompts: str, negative: str, ratio, budget: str, steps, size, seed, filename: str,
               recipe: str = recipes.DEFAULT_RECIPE, start_from: str = NO_START,
               adapter_dtype: str = DEFAULT_FILE_DTYPE) -> TrainForm:
    """The tab's values as a :class:`TrainForm`; a clear ValueError naming the field that is wrong."""
    lines = tuple(p.strip() for p in (prompts or "").splitlines() if p.strip())
    recipe = recipe or recipes.DEFAULT_RECIPE
    if recipe not in recipes.RECIPES:
        raise ValueError(f"SD Slim training: recipe must be one of {', '.join(recipes.RECIPES)}, got {recipe!r}")
    start_from = None if start_from in (None, "", NO_START) else str(start_from)
    adapter_dtype = adapter_dtype or DEFAULT_FILE_DTYPE
    if adapter_dtype not in FILE_DTYPES:
        raise ValueError(f"SD Slim training: adapter file dtype must be one of {', '.join(FILE_DTYPES)}, got "
                         f"{adapter_dtype!r}")
    if recipe == "data-free" and (start_from or (budget or "").strip()):
        raise ValueError("SD Slim training: the data-free recipe takes a ratio only (no budget, no start from "
                         "adapters): it measures nothing")
    if not lines and recipe != "data-free":
        raise ValueError("SD Slim training needs at least one prompt (one per line)")
    budget = (budget or "").strip() or None
    if budget is not None:
        try:
            parse_budget(budget)
        except ValueError as err:
            raise ValueError(f"SD Slim training: budget {budget!r}: {err}") from None
        ratio = None
    else:
        try:
            ratio = float(ratio)
        except (TypeError, ValueError):
            raise ValueError(f"SD Slim training: ratio must be a number in (0, 1], got {ratio!r}") from None
        if not 0 < ratio <= 1:
            raise ValueError(f"SD Slim training: ratio must be in (0, 1], got {ratio}")
    size = _whole(size, "size", 0, 4096)
    if size % SIZE_STEP:
        raise ValueError(f"SD Slim training: size must be 0 (the model's native size) or a multiple of {SIZE_STEP} "
                         f"pixels, got {size}")
    form = TrainForm(lines, (negative or "").strip(), ratio, budget, _whole(steps, "steps", 0), size,
                     _whole(seed, "seed", 0), (filename or "").strip(), recipe, start_from, adapter_dtype)
    train_paths.adapter_output("models/sdslim", form.filename)     # the name's own check
    return form


def busy(state) -> str | None:
    """The refusal while another webui job runs (the webui's ``shared.state.job_count`` is 0 only when idle)."""
    if getattr(state, "job_count", 0):
        return (f"SD Slim: another job is running ({getattr(state, 'job', None) or 'a generation'}); wait for it to "
                "finish (or press Interrupt), then press Train again")
    return None


def model_refusal(sd_model, forge: bool, fp8: bool) -> str | None:
    """Why the loaded model cannot be trained from, or None."""
    if forge:
        return "SD Slim does not support Forge; nothing was trained"
    if getattr(getattr(sd_model, "model", None), "diffusion_model", None) is None:
        return "SD Slim training needs a loaded Stable Diffusion checkpoint (none is loaded)"
    if fp8:
        return "SD Slim training: the UNet is stored in fp8, which SD Slim cannot fold; switch FP8 weight off first"
    return None


def teacher(unet: torch.nn.Module) -> tuple[dict, layout.UNetConfig]:
    """(canonical weights, config) of the webui's LDM UNet as it is without any network: the Lora extension's
    backups where it has merged one (:func:`~sdslim_core.hosts.a1111.lora.base_weights`). The tensors are CPU
    copies, so the trainer (which adds LoRA-like deltas to its teacher's weights for a step) never shares
    memory with the webui's model."""
    weights = {}
    for name, module in unet.named_modules():
        for pname, t in base_weights(module).items():
            weights[f"{name}.{pname}" if name else pname] = t.to("cpu", copy=True)
    heads = {k: int(getattr(unet, k)) for k in ("num_heads", "num_head_channels")
             if isinstance(getattr(unet, k, None), int) and getattr(unet, k) > 0}
    canon, _, _ = layout.to_canonical(weights)
    return canon, layout.config_from_state_dict(canon, heads)


def size_embedding(ids: torch.Tensor, dim: int = TIME_EMBED_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """SDXL's embedding of size/crop ids [n, k] → [n, k·dim] (float64): per id, cos then sin of id·10000^(−i/half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64) / half)
    args = ids.double().reshape(-1, 1) * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).reshape(ids.shape[0], -1)


def _crossattn(cond) -> torch.Tensor:
    c = cond["crossattn"] if isinstance(cond, dict) else cond
    return c.detach().float().cpu().reshape(-1, c.shape[-1])


def _pad(context: torch.Tensor, length: int, empty: torch.Tensor) -> torch.Tensor:
    """``context`` [T, D] extended to ``length`` tokens with copies of the empty prompt's chunk, as the webui pads a
    prompt/negative pair of different lengths."""
    missing = length - context.shape[0]
    if missing % empty.shape[0]:
        raise ValueError(f"SD Slim training: conditioning of {context.shape[0]} tokens cannot be padded to {length} "
                         f"with chunks of {empty.shape[0]}")
    return torch.cat([context, empty.repeat(missing // empty.shape[0], 1)]) if missing else context


def calibration(conds: list, negative, empty: torch.Tensor, prompts, negative_text: str,
                cfg: layout.UNetConfig, pixels: int) -> tuple[Calibration, list[str]]:
    """(Calibration, notes) from the webui's conditioning.

    ``conds``: one conditioning per prompt (``get_learned_conditioning``'s first schedule entry): a tensor [T, D], or
    for SDXL ``{"crossattn": [T, D], "vector": [V]}``; ``negative``: the negative prompt's (the unconditional branch
    of CFG, encoded as the webui encodes a negative prompt); ``empty``: the empty prompt's context [1, 77, D] (the
    webui's ``cond_stage_model_empty_prompt``), which pads shorter contexts to the longest. ``pixels``: the image
    side the conditioning was made for. ``notes``: what the user should know (an SDXL size/crop mismatch).
    """
    if cfg.adm_in_channels and cfg.context_dim == REFINER_CONTEXT:
        raise ValueError("SD Slim training: the SDXL refiner is not supported (its added conditioning carries an "
                         "aesthetic score the trainer does not model); train the base model")
    ctx = [_crossattn(c) for c in conds]
    unc = _crossattn(negative)
    empty = empty.detach().float().cpu().reshape(-1, empty.shape[-1])
    length = max(c.shape[0] for c in ctx + [unc])
    contexts = torch.stack([_pad(c, length, empty) for c in ctx])
    kw, notes = {}, []
    if cfg.adm_in_channels:
        width = cfg.adm_in_channels
        p_dim = width - SDXL_TIME_EMBEDS * TIME_EMBED_DIM
        vectors = []
        for cond in [*conds, negative]:
            v = cond.get("vector") if isinstance(cond, dict) else None
            if v is None or v.reshape(-1).shape[0] != width:
                got = "none" if v is None else v.reshape(-1).shape[0]
                raise ValueError(f"SD Slim training: this SDXL UNet expects a conditioning vector of width {width} "
                                 f"(pooled {p_dim} + {SDXL_TIME_EMBEDS}×{TIME_EMBED_DIM} size/crop); the webui "
                                 f"gave {got}")
            vectors.append(v.detach().double().cpu().reshape(-1))
        expected = size_embedding(sdxl_time_ids(1, pixels // 8))[0]
        worst = max(float((v[p_dim:] - expected).abs().max()) for v in vectors)
        if worst > 0.05:
            notes.append(f"the webui's SDXL size/crop conditioning is not ({pixels}, {pixels}, 0, 0, {pixels}, "
                         f"{pixels}) (a crop setting?); calibration uses that one")
        kw = {"pooled": torch.stack([v[:p_dim] for v in vectors[:-1]]).float(),
              "uncond_pooled": vectors[-1][:p_dim][None].float()}
    description = {"source": "webui prompts", "n_prompts": len(ctx), "negative_prompt": negative_text}
    calib = Calibration(contexts=contexts, uncond=_pad(unc, length, empty)[None], prompts=tuple(prompts),
                        description=description, **kw)
    return calib, notes


# the trainer's phases before its optimizer steps: (what the tab calls it, its units, what a resume keeps of it)
PHASES = {"calibration": ("calibration", "trajectories", "the calibration starts over"),
          "capture": ("calibration", "inputs", "the calibration starts over"),
          "rank curves": ("rank allocation", "sites", "the sites already measured are kept"),
          "init": ("initialisation", "sites", "the sites already initialised are kept")}


class JobProgress:
    """The trainer's ``progress(done, total, info)`` as a webui job's state (``shared.state``): one job whose steps
    are the trainer's optimizer steps (``sampling_step`` of ``sampling_steps``, as a generation reports its sampler
    steps), ``textinfo`` the stage, site and loss. Raises :class:`Interrupted` once ``state.interrupted`` is set,
    at the step or the unit of a phase before the steps (:data:`PHASES`) it hears of next."""

    def __init__(self, state):
        self.state = state
        self.done = self.total = 0
        self.phase = None                     # the info of a phase before the steps, while in one
        self.stage = None                     # the optimizer steps' stage
        state.job = JOB
        state.job_count, state.job_no = 1, 0
        state.sampling_step = state.sampling_steps = 0

    def say(self, text: str):
        """A message of the trainer (or the tab) as the status line."""
        self.state.textinfo = f"SD Slim: {text}"

    def __call__(self, done: int, total: int, info: dict):
        self.done, self.total = done, total
        s = self.state
        s.sampling_steps, s.sampling_step = total, done
        if "of" in info:                      # a phase before the optimizer steps: calibration, rank curves, init
            self.phase = info
            self.say(f"{info['stage']} {info['done']} of {info['of']}")
        else:
            self.phase, self.stage = None, info.get("stage", "?")
            where = short_site(info["site"]) if "site" in info else f"p={info['p']}" if "p" in info else ""
            loss = f", loss {info['loss']:.4g}" if "loss" in info else ""
            self.say(f"stage {self.stage} {where}, step {done} of {total}{loss}")
        if getattr(s, "interrupted", False):
            raise Interrupted(self.where())

    def where(self) -> str:
        """Where the run is, in the tab's words (``at step 20 of 32 (stage 1)``, ``during rank allocation (3 of 15
        sites done)``), and what a resume keeps of it."""
        if self.phase is None:
            return f"at step {self.done} of {self.total} (stage {self.stage}); it resumes from its last checkpoint"
        name, units, kept = PHASES.get(self.phase["stage"], (self.phase["stage"], "units", "it is done again"))
        of = f" of {self.phase['of']}" if self.phase["of"] else ""
        return f"during {name} ({self.phase['done']}{of} {units} done); {kept}"


def interrupted_text(job: JobProgress, work: str) -> str:
    return (f"Interrupted {job.where()}. The run is kept in {work}: press Train with the same settings to continue "
            "it (the result equals an uninterrupted run).")


def finished_text(out: str, report, notes: list[str]) -> str:
    lines = [f"adapters written to {out}", *(f"note: {n}" for n in notes), "", str(report)]
    return "\n".join(lines)


def exists_refusal(out: str) -> str | None:
    """Nothing the user owns is overwritten."""
    if os.path.exists(out):
        return f"SD Slim training: {out} exists; choose another output file name (or delete that file)"
    return None
