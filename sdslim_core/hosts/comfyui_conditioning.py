"""ComfyUI ``CONDITIONING`` as training calibration, read without ComfyUI.

A CONDITIONING is a list of ``[tensor [1, T, D], dict]``; the dict holds ``pooled_output`` [1, P] for SDXL and,
from *CLIP Text Encode (SDXL)*, the size conditioning (``width``, ``height``, ``crop_w``, ``crop_h``,
``target_width``, ``target_height``). The positive entries are the calibration prompts; the negative one is CFG's
unconditional branch, as at sampling. Without a negative the unconditional branch is zeros, and the result says so.
"""
from __future__ import annotations

import torch

from ..train.calibration import Calibration

SIZE_KEYS = ("height", "width", "crop_h", "crop_w", "target_height", "target_width")   # SDXL's time-id order


def _pooled(entries) -> torch.Tensor | None:
    pooled = [e[1].get("pooled_output") for e in entries]
    if any(p is None for p in pooled):
        return None
    return torch.cat([p.reshape(1, -1).float() for p in pooled])


def _time_ids(entries) -> torch.Tensor | None:
    """The size conditioning of the first entry, when every entry carries the same (CLIP Text Encode (SDXL));
    else None: the trainer uses the calibration latent size, as ComfyUI does for CLIP Text Encode."""
    values = [tuple(e[1].get(k) for k in SIZE_KEYS) for e in entries]
    if not values or any(v is None for v in values[0]) or len(set(values)) != 1:
        return None
    h, w, ch, cw, th, tw = values[0]
    return torch.tensor([[h, w, ch, cw, th, tw]], dtype=torch.float32)


def calibration(positive: list, negative: list | None = None) -> tuple[Calibration, list[str]]:
    """(a :class:`Calibration` from ``positive`` (every entry) and ``negative`` (its first entry), notes for the
    report)."""
    if not positive:
        raise ValueError("sdslim: the positive conditioning is empty")
    notes = []
    uncond = uncond_pooled = None
    if negative:
        uncond, uncond_pooled = negative[0][0].float(), _pooled(negative[:1])
    else:
        notes.append("no negative conditioning: CFG's unconditional branch is zeros; connect 'negative' (a CLIP "
                     "Text Encode of your negative prompt, or of an empty one) so calibration matches sampling")
    calib = Calibration.from_contexts([e[0] for e in positive], uncond=uncond)
    calib.pooled, calib.uncond_pooled, calib.time_ids = _pooled(positive), uncond_pooled, _time_ids(positive)
    calib.description = dict(calib.description, negative="connected" if negative else "none (zeros)")
    return calib, notes
