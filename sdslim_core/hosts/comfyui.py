"""ComfyUI's weight-patch forms read without ComfyUI: which layer a patch was made for, and its core
:class:`~sdslim_core.io.lora_files.LoraModule` (the node pack converts those into slim space and back).

ComfyUI keeps a loaded LoRA as weight adapters (``comfy.weight_adapter``: ``LoRAAdapter`` with ``weights`` =
(up, down, alpha, mid, dora_scale, reshape), ``LoHaAdapter`` (w1a, w1b, alpha, w2a, w2b, t1, t2, dora_scale),
``LoKrAdapter`` (w1, w2, alpha, w1_a, w1_b, w2_a, w2_b, t2, dora_scale)) and model merges or full diffs as tuples
(``("diff", (tensor,))``); they are recognised by class name and layout, as ComfyUI defines them, so this module
imports nothing of ComfyUI and its tests run without it. ComfyUI's ``alpha`` is the file's alpha.
"""
from __future__ import annotations

import math

import torch

from .. import layout
from ..io.lora_files import LoraModule

PREFIX = layout.COMFY_PREFIX
NEEDS_BASE = ("GLoRAAdapter", "OFTAdapter", "BOFTAdapter")      # ComfyUI forms computed from the base weight


def made_for_numel(value) -> int | None:
    """Number of weights of the layer a ComfyUI patch value was made for, where its form tells it (else None)."""
    if isinstance(value, list) and value and isinstance(value[0], tuple) and hasattr(value[0][0], "numel"):
        return value[0][0].numel()                                    # a nested patch list (model merging)
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("diff", "set") and value[1]:
        t = value[1][0]
        return t.numel() if hasattr(t, "numel") else None
    weights = getattr(value, "weights", None)
    name = type(value).__name__
    if weights is None:
        return None
    if name == "LoRAAdapter":                       # (up, down, alpha, mid, dora_scale, reshape)
        up, down, mid = weights[0], weights[1], weights[3]
        reshape = weights[5] if len(weights) > 5 else None
        if reshape is not None:
            return math.prod(reshape)
        if mid is not None:
            return up.shape[0] * down.shape[1] * math.prod(mid.shape[2:])
        return up.shape[0] * math.prod(down.shape[1:])
    if name == "LoHaAdapter":                       # (w1a, w1b, alpha, w2a, w2b, t1, t2, dora_scale)
        w1a, w1b, t1 = weights[0], weights[1], weights[5]
        if t1 is not None:                          # Tucker: w1a [rank, out], w1b [rank, in], t1 [rank, rank, k, k]
            return w1a.shape[1] * w1b.shape[1] * math.prod(t1.shape[2:])
        return w1a.shape[0] * w1b.shape[1]
    if name == "LoKrAdapter":                       # (w1, w2, alpha, w1_a, w1_b, w2_a, w2_b, t2, dora_scale)
        w1, w2, w1a, w1b, w2a, w2b, t2 = weights[0], weights[1], weights[3], weights[4], weights[5], weights[6], \
            weights[7]
        n1 = w1.numel() if w1 is not None else w1a.shape[0] * w1b.shape[1]
        if w2 is not None:
            n2 = w2.numel()
        elif t2 is not None:
            n2 = w2a.shape[1] * w2b.shape[1] * math.prod(t2.shape[2:])
        else:
            n2 = w2a.shape[0] * w2b.shape[1]
        return n1 * n2
    return None


def _named(tensors: dict) -> dict:
    return {k: v.detach().cpu() for k, v in tensors.items() if v is not None}


def core_module(ckey: str, value, source: str) -> LoraModule | None:
    """The core form of a ComfyUI patch ``value`` on canonical key ``ckey`` (``….weight`` or ``….bias``), or None
    for a form the core does not read. Tensors come to the CPU; ComfyUI's alpha is the file's alpha."""
    module, part = ckey.rsplit(".", 1)
    name = type(value).__name__
    w = getattr(value, "weights", None)
    if part == "weight" and name == "LoRAAdapter" and (len(w) < 6 or w[5] is None):
        up, down, alpha, mid, dora = w[:5]
        kind, tensors = "lora", _named({"up": up, "down": down, "mid": mid, "dora_scale": dora})
    elif part == "weight" and name == "LoHaAdapter":
        w1a, w1b, alpha, w2a, w2b, t1, t2, dora = w
        kind, tensors = "loha", _named({"hada_w1_a": w1a, "hada_w1_b": w1b, "hada_w2_a": w2a, "hada_w2_b": w2b,
                                        "hada_t1": t1, "hada_t2": t2, "dora_scale": dora})
    elif part == "weight" and name == "LoKrAdapter":
        w1, w2, alpha, w1a, w1b, w2a, w2b, t2, dora = w
        kind, tensors = "lokr", _named({"lokr_w1": w1, "lokr_w2": w2, "lokr_w1_a": w1a, "lokr_w1_b": w1b,
                                        "lokr_w2_a": w2a, "lokr_w2_b": w2b, "lokr_t2": t2, "dora_scale": dora})
    elif isinstance(value, tuple) and value and value[0] == "diff" and len(value) == 2 and \
            torch.is_tensor(value[1][0]):
        alpha, kind = None, "diff"
        tensors = _named({"diff" if part == "weight" else "diff_b": value[1][0]})
    else:
        return None
    if alpha is not None:
        tensors["alpha"] = torch.tensor(float(alpha))
    return LoraModule(source, PREFIX + ckey, module, kind, tensors, [PREFIX + ckey])


def patch_tensors(value) -> tuple:
    """The tensors (and other values) a patch is made of: a weight adapter's ``weights`` or a tuple patch's payload."""
    weights = getattr(value, "weights", None)
    return tuple(weights) if weights is not None else tuple(value[1])
