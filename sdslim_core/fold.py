"""The exact fold of bottleneck adapters into neighbouring layers (pure functions on tensors).

FF site (GEGLU proj W_p = [W_v; W_g] ∈ R^{2m×d}, out W_o ∈ R^{d×m}; adapter A_v, A_g ∈ R^{r×m}, U ∈ R^{m×r}):
    W'_p = [A_v W_v; A_g W_g], b'_p = [A_v b_v; A_g b_g], W'_o = W_o U, b'_o = b_o + W_o c
    (c ∈ R^m: the adapter's optional intercept ``up_bias``, the train-time y = W_o (U h + c) + b_o)
Res site (conv1 W_1, emb W_e, conv2 W_2; adapter D ∈ R^{r×c}, GroupNorm' over r, U ∈ R^{c×r}):
    W'_1 = D×W_1, b'_1 = D b_1, W'_e = D W_e, b'_e = D b_e, norm2 := GroupNorm', W'_2 = W_2×U, b'_2 = b_2
Folding is linear in W, so merging a LoRA into W first and folding afterwards is exact.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from .layout import FF_LAYERS, RES_LAYERS

_LDM = RES_LAYERS["ldm"]


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def fold_ff(w_p, b_p, w_o, b_o, down_value, down_gate, up, up_bias=None):
    """Return (W'_p, b'_p, W'_o, b'_o) in the dtype of ``w_p``, computed in at least float32."""
    dt = _compute_dtype(w_p, down_value)
    m = w_o.shape[1]
    w_v, w_g = w_p.to(dt)[:m], w_p.to(dt)[m:]
    a_v, a_g = down_value.to(dt), down_gate.to(dt)
    new_wp = torch.cat([a_v @ w_v, a_g @ w_g])
    new_bp = None if b_p is None else torch.cat([a_v @ b_p.to(dt)[:m], a_g @ b_p.to(dt)[m:]])
    new_wo = w_o.to(dt) @ up.to(dt)
    out = w_p.dtype
    if up_bias is None:
        new_bo = None if b_o is None else b_o.clone()
    else:
        shift = w_o.to(dt) @ up_bias.to(dt)
        new_bo = (shift if b_o is None else b_o.to(dt) + shift).to(out)
    return new_wp.to(out), None if new_bp is None else new_bp.to(out), new_wo.to(out), new_bo


def fold_res(w_1, b_1, w_e, b_e, w_2, b_2, down, up):
    """Return (W'_1, b'_1, W'_e, b'_e, W'_2, b'_2); ``w_e`` may be None (no time embedding)."""
    dt = _compute_dtype(w_1, down)
    d, u = down.to(dt), up.to(dt)
    new_w1 = torch.einsum("rc,cikl->rikl", d, w_1.to(dt))
    new_b1 = None if b_1 is None else d @ b_1.to(dt)
    new_we = None if w_e is None else d @ w_e.to(dt)
    new_be = None if b_e is None else d @ b_e.to(dt)
    new_w2 = torch.einsum("ocij,cr->orij", w_2.to(dt), u)
    out = w_1.dtype

    def cast(t):   # contiguous: einsum may return permuted strides, which send conv2d down another kernel path
        return None if t is None else t.to(out).contiguous()
    return (cast(new_w1), cast(new_b1), cast(new_we), cast(new_be), cast(new_w2),
            None if b_2 is None else b_2.clone())


def fold_site(site: str, kind: str, get: Callable[[str], torch.Tensor | None], tensors: Mapping) -> dict:
    """Fold one site: ``get(canonical_key)`` returns the (LoRA-merged) weight or None; returns new canonical
    tensors for every key the site changes (norm2 included, taken from the adapter)."""
    if kind == "ff":
        p, o = f"{site}.{FF_LAYERS['proj']}", f"{site}.{FF_LAYERS['out']}"
        wp, bp, wo, bo = fold_ff(get(p + ".weight"), get(p + ".bias"), get(o + ".weight"), get(o + ".bias"),
                                 tensors["down_value"], tensors["down_gate"], tensors["up"], tensors.get("up_bias"))
        out = {p + ".weight": wp, o + ".weight": wo}
        if bp is not None:
            out[p + ".bias"] = bp
        if bo is not None:
            out[o + ".bias"] = bo
        return out
    c1, em, n2, c2 = (f"{site}.{_LDM[k]}" for k in ("conv1", "emb", "norm2", "conv2"))
    w1 = get(c1 + ".weight")
    new = fold_res(w1, get(c1 + ".bias"), get(em + ".weight"), get(em + ".bias"), get(c2 + ".weight"),
                   get(c2 + ".bias"), tensors["down"], tensors["up"])
    names = (c1 + ".weight", c1 + ".bias", em + ".weight", em + ".bias", c2 + ".weight", c2 + ".bias")
    out = {k: v for k, v in zip(names, new) if v is not None}
    out[n2 + ".weight"] = tensors["norm.weight"].to(w1.dtype)
    out[n2 + ".bias"] = tensors["norm.bias"].to(w1.dtype)
    return out


def fold_state_dict(weights: Mapping[str, torch.Tensor], adapter_set, sites=None, progress=None) -> dict:
    """Fold ``adapter_set`` (an :class:`~sdslim_core.adapters.AdapterSet`) into canonical ``weights``.

    Returns only the keys that change (slim shapes); everything else is untouched and can be shared.
    ``sites`` restricts the fold to a subset; ``progress(i, n, site)`` is called after each site and may raise
    to interrupt (nothing is mutated).
    """
    names = list(adapter_set.sites if sites is None else sites)
    out = {}
    for i, site in enumerate(names):
        kind = adapter_set.kind(site)
        out.update(fold_site(site, kind, lambda k: weights.get(k), adapter_set.sites[site]))
        if progress is not None:
            progress(i + 1, len(names), site)
    return out


def slim_shapes(shapes: Mapping[str, tuple], ranks: Mapping[str, int]) -> dict:
    """Shapes after folding sites with the given ranks (for counting without any tensor)."""
    out = dict(shapes)
    for site, r in ranks.items():
        if f"{site}.{FF_LAYERS['proj']}.weight" in shapes:
            p, o = f"{site}.{FF_LAYERS['proj']}", f"{site}.{FF_LAYERS['out']}"
            out[p + ".weight"] = (2 * r, shapes[p + ".weight"][1])
            if p + ".bias" in shapes:
                out[p + ".bias"] = (2 * r,)
            out[o + ".weight"] = (shapes[o + ".weight"][0], r)
            continue
        c1, em, n2, c2 = (f"{site}.{_LDM[k]}" for k in ("conv1", "emb", "norm2", "conv2"))
        w1 = shapes[c1 + ".weight"]
        out[c1 + ".weight"] = (r,) + tuple(w1[1:])
        for k in (c1 + ".bias", em + ".bias", n2 + ".weight", n2 + ".bias"):
            if k in shapes:
                out[k] = (r,)
        if em + ".weight" in shapes:
            out[em + ".weight"] = (r, shapes[em + ".weight"][1])
        w2 = shapes[c2 + ".weight"]
        out[c2 + ".weight"] = (w2[0], r) + tuple(w2[2:])
    return out
