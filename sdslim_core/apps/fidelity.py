"""Same-seed fidelity of a candidate UNet (slim, quantised, or both) against its teacher: the ladder's columns.

A :class:`Probe` fixes what every model is run on (prompts, starting noise, sampler, guidance, a decoder, an
optional ControlNet). :func:`reference` runs the teacher once (with and without the LoRA) and records the inputs its
own trajectories visit; :func:`compare` runs a candidate on exactly those and returns:

- ``latent_psnr_db`` / ``image_psnr_db`` / ``image_ssim``: sampled latents and decoded images against the teacher's,
  same seeds and prompts (peak = the teacher latents' range; images in [0, 1]); PSNR pools the squared error of
  all samples, so one sample whose trajectory tips into another image dominates it: ``image_psnr_db_median`` (the
  median sample's PSNR) says whether the rest stayed the teacher's;
- ``eps_rel_error``: ‖ε_cand − ε_teacher‖ / ‖ε_teacher‖ on the teacher's trajectory inputs (both CFG halves),
  and ``guided_eps_rel_error`` on the classifier-free-guided ε the sampler actually steps with;
- ``lora_effect_cosine``: cos(ε_cand+LoRA − ε_cand, ε_teacher+LoRA − ε_teacher) on the same inputs;
- ``controlnet_effect_cosine``: the same for the ControlNet's residuals (the same residuals feed both models: a
  ControlNet only reads the latent, timestep and prompt, never the UNet it steers).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Mapping

import torch
from torch import nn

from ..modules.unet import load_diffusers_unet
from ..ops import fold, quant, sampling


# --------------------------------------------------------------------------------------------- metrics

def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return 0.0 if num == 0 else (num / den if den else math.inf)


def psnr(x: torch.Tensor, ref: torch.Tensor, peak: float | None = None) -> float:
    """PSNR in dB of ``x`` against ``ref``; ``peak`` defaults to the range of ``ref``; inf when identical."""
    x, ref = x.double(), ref.double()
    mse = (x - ref).pow(2).mean().item()
    peak = (ref.max() - ref.min()).item() if peak is None else peak
    if mse == 0:
        return math.inf
    return 10 * math.log10(peak * peak / mse) if peak > 0 else -math.inf


def ssim(x: torch.Tensor, ref: torch.Tensor, window: int = 11, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004; Gaussian window, images in [0, 1], per channel, valid region)."""
    x, ref = x.double(), ref.double()
    if x.ndim == 3:
        x, ref = x[None], ref[None]
    window = min(window, x.shape[-1], x.shape[-2])
    coords = torch.arange(window, dtype=torch.float64, device=x.device) - (window - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).expand(x.shape[1], 1, window, window)

    def blur(t):
        return torch.nn.functional.conv2d(t, kernel, groups=x.shape[1])
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mu_x, mu_y = blur(x), blur(ref)
    sxx = blur(x * x) - mu_x ** 2
    syy = blur(ref * ref) - mu_y ** 2
    sxy = blur(x * ref) - mu_x * mu_y
    m = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))
    return m.mean().item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    den = (a.norm() * b.norm()).item()
    return (a @ b).item() / den if den else math.nan


def jsonable(value):
    """Replace non-finite floats by strings (``"inf"``, ``"-inf"``, ``"nan"``) so the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------- probe

@dataclasses.dataclass
class Probe:
    """What teacher and candidates are run on. ``fn_of(module)`` adapts a UNet to ``fn(x, t, context,
    **residuals)``; ``control(x, t, context)`` returns a ControlNet's residual kwargs (optional); ``decode`` turns
    latents into images in [0, 1] (optional)."""
    fn_of: Callable[[nn.Module], Callable]
    context: torch.Tensor
    uncond: torch.Tensor | None
    noise: torch.Tensor
    schedule: sampling.Schedule = dataclasses.field(default_factory=sampling.Schedule)
    steps: int = 20
    method: str = "ddim"
    guidance: float = 4.0
    decode: Callable | None = None
    control: Callable | None = None
    eps_points: int = 5

    def sample(self, fn, record: list | None = None) -> torch.Tensor:
        def step(x, t, context, **res):
            out = fn(x, t, context, **res)
            if record is not None:
                record.append((x, t, context))
            return out
        return sampling.sample(step, self.noise, self.context, self.uncond, schedule=self.schedule,
                               steps=self.steps, method=self.method, guidance=self.guidance)


@dataclasses.dataclass
class Reference:
    """The teacher's results on a probe, computed once and compared against every candidate."""
    latents: torch.Tensor
    images: torch.Tensor | None
    inputs: list                       # (x, t, context) along the teacher's trajectory
    eps: list
    eps_lora: list | None
    residuals: list | None             # the ControlNet's residual kwargs per input
    eps_control: list | None


def _picks(n: int, k: int) -> list[int]:
    """``k`` evenly spaced indices of ``n`` (first and last included)."""
    k = min(k, n)
    return sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)})


@torch.no_grad()
def reference(probe: Probe, teacher: nn.Module, teacher_lora: nn.Module | None = None) -> Reference:
    fn = probe.fn_of(teacher)
    calls: list = []
    latents = probe.sample(fn, calls)
    inputs = [calls[i] for i in _picks(len(calls), probe.eps_points)]
    eps = [fn(*inp) for inp in inputs]
    eps_lora = None
    if teacher_lora is not None:
        fl = probe.fn_of(teacher_lora)
        eps_lora = [fl(*inp) for inp in inputs]
    residuals = eps_control = None
    if probe.control is not None:
        residuals = [probe.control(*inp) for inp in inputs]
        eps_control = [fn(*inp, **res) for inp, res in zip(inputs, residuals)]
    images = probe.decode(latents) if probe.decode is not None else None
    return Reference(latents, images, inputs, eps, eps_lora, residuals, eps_control)


def _guided(eps: torch.Tensor, guidance: float) -> torch.Tensor:
    if guidance == 1.0 or eps.shape[0] % 2:
        return eps
    e_u, e_c = eps.chunk(2)
    return e_u + guidance * (e_c - e_u)


@torch.no_grad()
def compare(probe: Probe, ref: Reference, candidate: nn.Module, candidate_lora: nn.Module | None = None) -> dict:
    """The ladder's fidelity columns of ``candidate`` (and ``candidate_lora``, the candidate with the same LoRA the
    reference was given) against the teacher's :class:`Reference`; ``detail`` holds the per-sample latent and
    image PSNR and, per trajectory input, its timestep, ε error and LoRA-effect cosine."""
    fn = probe.fn_of(candidate)
    latents = probe.sample(fn)
    eps = [fn(*inp) for inp in ref.inputs]
    guided = probe.uncond is not None and probe.guidance != 1.0
    out = {
        "latent_psnr_db": psnr(latents, ref.latents),
        "eps_rel_error": rel_error(torch.cat(eps), torch.cat(ref.eps)),
        "guided_eps_rel_error": rel_error(torch.cat([_guided(e, probe.guidance) for e in eps]),
                                          torch.cat([_guided(e, probe.guidance) for e in ref.eps]))
        if guided else None,
    }
    detail = {"latent_psnr_db": [psnr(a, b) for a, b in zip(latents, ref.latents)],
              "timesteps": [float(inp[1].flatten()[0]) for inp in ref.inputs],
              "eps_rel_error": [rel_error(e, r) for e, r in zip(eps, ref.eps)]}
    if ref.images is not None:
        images = probe.decode(latents)
        out["image_psnr_db"] = psnr(images, ref.images, peak=1.0)
        out["image_ssim"] = ssim(images, ref.images)
        out["images"] = images
        detail["image_psnr_db"] = [psnr(a, b, peak=1.0) for a, b in zip(images, ref.images)]
        out["image_psnr_db_median"] = float(torch.tensor(detail["image_psnr_db"]).median())
        detail["image_ssim"] = [ssim(a, b) for a, b in zip(images, ref.images)]
    if candidate_lora is not None and ref.eps_lora is not None:
        fl = probe.fn_of(candidate_lora)
        d_c = [fl(*inp) - e for inp, e in zip(ref.inputs, eps)]
        d_t = [el - e for el, e in zip(ref.eps_lora, ref.eps)]
        out["lora_effect_cosine"] = cosine(torch.cat(d_c), torch.cat(d_t))
        detail["lora_effect_cosine"] = [cosine(a, b) for a, b in zip(d_c, d_t)]
    out["detail"] = detail
    if ref.residuals is not None:
        d_c = torch.cat([fn(*inp, **res) - e for inp, res, e in zip(ref.inputs, ref.residuals, eps)])
        d_t = torch.cat([ec - e for ec, e in zip(ref.eps_control, ref.eps)])
        out["controlnet_effect_cosine"] = cosine(d_c, d_t)
    return out


# ------------------------------------------------------------------------------------------ candidates

class Candidates:
    """Builds what a user can run instead of the teacher — slim, weight-quantised, or both — each with and without
    the same LoRA, the way the hosts apply it:

    - slim: the LoRA is merged into the full weights, then folded (:mod:`sdslim_core.ops.lora`, :mod:`fold`);
    - ``fp8`` storage: merged, then stored in fp8 (ComfyUI re-casts patched weights to the storage dtype);
    - GGUF ``q8_0`` … ``q4_0``: the LoRA delta is added to the dequantised weights at run time (ComfyUI-GGUF);
      :meth:`from_file` does the same for weights read back from a written ``.gguf``;
    - slim + a storage format: the slim weights (merged and folded for the LoRA) stored as that format stores
      them (for GGUF: the slim-space LoRA delta on the dequantised slim weights).

    ``weights`` are the teacher's canonical float weights: a dict, or a mapping that reads each tensor on access
    (then a candidate is the only full copy in memory while it is built); ``lora_delta`` the canonical keys a LoRA
    changes, with their merged values, e.g. from :func:`sdslim_core.ops.lora.merge_loras`. A model with the LoRA
    shares its unchanged tensors with the model without it.
    """

    def __init__(self, cfg, weights: Mapping, lora_delta: dict | None = None):
        self.cfg, self.weights = cfg, weights
        self.lora_delta = lora_delta or {}

    def unet(self, weights: Mapping, norm_groups: dict | None = None) -> nn.Module:
        return load_diffusers_unet(weights, self.cfg, norm_groups=norm_groups).eval()

    def _base_and_lora(self, aset) -> tuple[Mapping, dict | None]:
        """The teacher's weights (``aset`` None) or its slim form's, unread where unchanged, and the keys the LoRA
        changes in that space (merged, and folded at the sites whose layers it changes)."""
        if aset is None:
            return self.weights, dict(self.lora_delta) or None
        base = collections.ChainMap(fold.fold_state_dict(self.weights, aset), self.weights)
        if not self.lora_delta:
            return base, None
        touched = [s for s in aset.sites if any(k.startswith(s + ".") for k in self.lora_delta)]
        merged = collections.ChainMap(self.lora_delta, self.weights)
        return base, {**self.lora_delta, **fold.fold_state_dict(merged, aset, sites=touched)}

    @staticmethod
    def _lora_added(stored: dict, base: Mapping, lora: dict) -> dict:
        """``stored`` (``base`` as a format stores it) with the LoRA's full-precision delta ``lora − base`` added on
        the keys it changes: how GGUF loaders apply a LoRA (on the dequantised weights)."""
        return {**stored, **{k: stored[k] + (v - base[k]) for k, v in lora.items()}}

    @classmethod
    def _stored(cls, base: Mapping, lora: dict | None, method: str | None) -> tuple[dict, dict | None]:
        """``base`` as ``method`` stores it, and the same with the LoRA's changed keys ``lora`` as the hosts run
        them."""
        stored = quant.round_trip(base, method) if method else dict(base)
        if lora is None:
            return stored, None
        if method is None:
            return stored, {**stored, **lora}
        if method == "fp8":
            return stored, {**stored, **quant.round_trip(lora, method)}
        return stored, cls._lora_added(stored, base, lora)

    @staticmethod
    def _groups(aset) -> dict | None:
        return {s: aset.groups(s) for s in aset.sites if aset.kind(s) == "res"} if aset is not None else None

    def _models(self, stored: dict, lora: dict | None, aset) -> tuple[nn.Module, nn.Module | None]:
        groups = self._groups(aset)
        return self.unet(stored, groups), self.unet(lora, groups) if lora is not None else None

    def quantised(self, method: str) -> tuple[nn.Module, nn.Module | None, dict]:
        """(model, model + LoRA or None, its canonical weights) for a weight-storage ``method``."""
        stored, lora = self._stored(*self._base_and_lora(None), method)
        return *self._models(stored, lora, None), stored

    def slim(self, aset, method: str | None = None) -> tuple[nn.Module, nn.Module | None, dict]:
        """(slim model, slim model + LoRA or None, its canonical weights), optionally stored with ``method``."""
        stored, lora = self._stored(*self._base_and_lora(aset), method)
        return *self._models(stored, lora, aset), stored

    def from_file(self, stored: dict, aset=None) -> tuple[nn.Module, nn.Module | None]:
        """(model, model + LoRA or None) of canonical weights read back from a file (e.g. a ``.gguf`` through the
        gguf package), of the teacher or (``aset``) of its slim form; the LoRA is added as GGUF loaders add it (its
        delta, in slim space for a slim model, on the dequantised weights)."""
        base, lora = self._base_and_lora(aset)
        if set(stored) != set(base):
            raise ValueError(f"the file's UNet has other keys than the {'slim ' if aset else ''}teacher's: "
                             f"{sorted(set(stored) ^ set(base))[:3]}")
        return self._models(stored, self._lora_added(stored, base, lora) if lora else None, aset)


def forward_flops(fn, *args, **kwargs) -> int:
    """Floating-point operations of one call of ``fn`` (a module or a function; matmuls and convolutions, as
    counted by torch)."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())
