"""Stage-2 augmentations that teach the student to keep what users plug in, measured against the teacher on the fly.

- **ControlNet-like residuals**: random, spatially smooth additions to the UNet's skip features and middle output
  (the residuals a ControlNet / T2I-Adapter adds), each scaled to a random fraction (0-1) of that feature's RMS on
  the teacher (the shipped tiny ControlNet adds 0.06-0.86 of it);
- **LoRA-like weight deltas**: random low-rank deltas of the layers the fold touches (GEGLU proj/out, ResBlock
  conv1/emb/conv2), of relative Frobenius norm up to ``lora_scale`` (a real tiny LoRA: median 0.11, max 0.28),
  added to the shared teacher/student layers: the adapters learn to carry a weight delta through the fold.

Both are drawn from generators keyed by (seed, step), so a resumed run sees the same draws. The target of an
augmented step is the teacher run on the same augmented input (all gates off), not the recorded bank output.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .. import layout
from ..modules import swap
from .calibration import InputBank, _gen, unet_call


@torch.no_grad()
def skip_rms(unet: nn.Module, forward) -> list[tuple[tuple, float]]:
    """(shape without batch, RMS) of every feature a ControlNet adds a residual to — the diffusers UNet's skips in
    residual order, then the middle block's output — during ``forward()`` (a call that runs ``unet``)."""
    got: list = []
    hooks = [unet.conv_in.register_forward_hook(lambda m, i, o: got.append([o]))]
    hooks += [b.register_forward_hook(lambda m, i, o: got.append(list(o[1]))) for b in unet.down_blocks]
    hooks.append(unet.mid_block.register_forward_hook(lambda m, i, o: got.append([o])))
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
    return [(tuple(f.shape[1:]), float(f.float().pow(2).mean().sqrt())) for group in got for f in group]


def smooth_residuals(rms: list, batch: int, generator: torch.Generator, device=None, dtype=None) -> dict:
    """Random ControlNet-like residual kwargs for a diffusers UNet: per feature a smooth random field (drawn at half
    resolution, upsampled) of RMS uniform in [0, the feature's RMS] per sample."""
    out = []
    for shape, scale in rms:
        c, h, w = shape
        z = torch.randn(batch, c, max(1, h // 2), max(1, w // 2), generator=generator)
        if z.shape[-2:] != (h, w):
            z = F.interpolate(z, size=(h, w), mode="bilinear", align_corners=False)
        z = z / z.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt().clamp_min(1e-12)
        out.append((z * torch.rand(batch, 1, 1, 1, generator=generator) * scale).to(device, dtype))
    return {"down_block_additional_residuals": tuple(out[:-1]), "mid_block_additional_residual": out[-1]}


class Augmenter:
    """Random ControlNet-like residuals and LoRA-like deltas for stage-2 steps of a diffusers teacher."""

    def __init__(self, teacher: nn.Module, bank: InputBank, sites, cfg: layout.UNetConfig, seed: int,
                 control_prob: float, lora_prob: float, lora_scale: float = 0.25, lora_rank: int = 4,
                 device=None, dtype=None, amp=None):
        self.seed, self.control_prob, self.lora_prob = seed, control_prob, lora_prob
        self.lora_scale, self.lora_rank = lora_scale, lora_rank
        self.rms = self._skip_rms(teacher, bank, device, dtype, amp) if control_prob > 0 else None
        self.layers = []
        for site in sites:
            kind = layout.site_kind(site)
            for role, path in swap.layer_paths(teacher, site, kind, cfg).items():
                if role != "norm2":
                    self.layers.append(teacher.get_submodule(path).weight)

    @staticmethod
    def _skip_rms(teacher, bank: InputBank, device, dtype, amp, n: int = 8) -> list:
        """:func:`skip_rms` on ``n`` fit inputs of the teacher."""
        def forward():
            with amp():
                unet_call(teacher, bank.batch(bank.fit_ids()[:n], device, dtype))
        return skip_rms(teacher, forward)

    def draw(self, step: int) -> tuple[bool, bool]:
        """(inject residuals, perturb weights) for ``step``."""
        u = torch.rand(2, generator=_gen(self.seed, 91, step))
        return bool(u[0] < self.control_prob), bool(u[1] < self.lora_prob)

    def residuals(self, step: int, batch: int, device, dtype) -> dict:
        """UNet keyword residuals (``down_block_additional_residuals``, ``mid_block_additional_residual``)."""
        return smooth_residuals(self.rms, batch, _gen(self.seed, 92, step), device, dtype)

    @contextlib.contextmanager
    def weight_deltas(self, step: int):
        """Adds random low-rank deltas to the fold's layers for the duration of the block, then restores them
        exactly (the originals are kept)."""
        g = _gen(self.seed, 93, step)
        saved = []
        try:
            with torch.no_grad():
                for w in self.layers:
                    if float(torch.rand(1, generator=g)) >= 0.5:
                        continue
                    flat = w.view(w.shape[0], -1)
                    k = min(self.lora_rank, *flat.shape)
                    delta = torch.randn(flat.shape[0], k, generator=g) @ torch.randn(k, flat.shape[1], generator=g)
                    rel = float(torch.rand(1, generator=g)) * self.lora_scale
                    delta = delta.to(w.device, torch.float32)
                    delta *= rel * float(flat.float().norm()) / float(delta.norm().clamp_min(1e-12))
                    saved.append((w, w.detach().clone()))
                    w.add_(delta.view_as(w).to(w.dtype))
            yield
        finally:
            with torch.no_grad():
                for w, orig in saved:
                    w.copy_(orig)
