"""The exact fold of bottleneck adapters into neighbouring layers (pure functions on tensors).

FF site (GEGLU proj W_p = [W_v; W_g] ∈ R^{2m×d}, out W_o ∈ R^{d×m}; adapter A_v, A_g ∈ R^{r×m}, U ∈ R^{m×r}):
    W'_p = [A_v W_v; A_g W_g], b'_p = [A_v b_v; A_g b_g], W'_o = W_o U, b'_o = b_o + W_o c
    (c ∈ R^m: the adapter's optional intercept ``up_bias``, the train-time y = W_o (U h + c) + b_o)
Res site (conv1 W_1, emb W_e, conv2 W_2; adapter D ∈ R^{r×c}, GroupNorm' over r, U ∈ R^{c×r}):
    W'_1 = D×W_1, b'_1 = D b_1, W'_e = D W_e, b'_e = D b_e, norm2 := GroupNorm', W'_2 = W_2×U, b'_2 = b_2
Each layer's fold is one of three linear maps (:func:`map_rows`, :func:`map_geglu_rows`, :func:`map_cols`), so
fold(W + ΔW) = fold(W) + map(ΔW): merging a LoRA first and folding afterwards is exact, and the same maps take a
LoRA's factors into slim space (:mod:`sdslim_core.ops.lora_slim`).
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from ..layout import FF_LAYERS, RES_LAYERS

_LDM = RES_LAYERS["ldm"]


def compute_dtype(*tensors) -> torch.dtype:
    """float64 if any tensor is float64, else float32 (fp16/bf16/fp8 weights are folded in float32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


# ------------------------------------------------------------------------------------- the three linear maps
# Each map computes in ``compute_dtype(x, adapter)``; ``x`` may have any float dtype (it is cast on the way in), the
# adapter tensors too (against a narrow ``x``, such as a LoRA factor, they are cast a slab of rows at a time, so an
# fp16 adapter never gets a whole float32 copy and each cast slab is used while in cache), and the result comes in
# ``out_dtype`` (default: the compute dtype).

_SLAB_BYTES = 4 << 20
_WIDE = 256          # a product this wide on the other side is compute-bound: cast the adapter whole


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` in ``b``'s dtype, ``a`` cast to it a slab of rows at a time when ``b`` is narrow."""
    if a.dtype == b.dtype or b.shape[1] >= _WIDE:
        return torch.mm(a.to(b.dtype), b, out=out)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=b.dtype, device=b.device)
    rows = max(1, _SLAB_BYTES // (a.shape[1] * b.element_size()))
    for i in range(0, a.shape[0], rows):
        torch.mm(a[i:i + rows].to(b.dtype), b, out=out[i:i + rows])
    return out


def _mm_right(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x @ a`` in ``x``'s dtype, ``a`` cast to it a slab of rows at a time when ``x`` is short (the inner dimension
    split, so each slab is read contiguously and used while in cache)."""
    if a.dtype == x.dtype or x.shape[0] >= _WIDE:
        return torch.mm(x, a.to(x.dtype))
    rows = max(1, _SLAB_BYTES // (a.shape[1] * x.element_size()))
    out = torch.mm(x[:, :rows], a[:rows].to(x.dtype))
    for i in range(rows, a.shape[0], rows):
        out.addmm_(x[:, i:i + rows], a[i:i + rows].to(x.dtype))
    return out


@torch.no_grad()
def map_rows(x: torch.Tensor, down: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """D·X on the first axis: [c, …] → [r, …] (conv1/emb weights and biases, a LoRA's up factor there)."""
    dt = compute_dtype(x, down)
    y = _mm(down, x.reshape(x.shape[0], -1).to(dt))
    return y.to(out_dtype or dt).reshape((down.shape[0],) + tuple(x.shape[1:]))


@torch.no_grad()
def map_geglu_rows(x: torch.Tensor, down_value: torch.Tensor, down_gate: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """blockdiag(A_v, A_g)·X: [2m, …] → [2r, …], value rows first (GEGLU proj weight and bias, a LoRA's up factor
    there); both halves are written straight into one output buffer."""
    r, m = down_value.shape
    dt = compute_dtype(x, down_value)
    flat = x.reshape(x.shape[0], -1).to(dt)
    out = torch.empty((2 * r, flat.shape[1]), dtype=dt, device=flat.device)
    _mm(down_value, flat[:m], out=out[:r])
    _mm(down_gate, flat[m:], out=out[r:])
    return out.to(out_dtype or dt).reshape((2 * r,) + tuple(x.shape[1:]))


@torch.no_grad()
def map_cols(x: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """X×U on the second axis: [o, c, …] → [o, r, …] (net.2 and conv2 weights, a LoRA's down factor there).

    A kernel is contracted as one matrix product over (o, kernel position) rows rather than an einsum; the
    transposes in and out are single copies that also cast."""
    o, c = x.shape[:2]
    dt = compute_dtype(x, up)
    out_dtype = out_dtype or dt
    k, r = math.prod(x.shape[2:]), up.shape[1]
    if k == 1:
        return _mm_right(x.reshape(o, c).to(dt), up).to(out_dtype).reshape((o, r) + tuple(x.shape[2:]))
    rows = torch.empty((o, k, c), dtype=dt, device=x.device)
    rows.copy_(x.reshape(o, c, k).transpose(1, 2))
    y = _mm_right(rows.view(o * k, c), up)                             # [(o, kernel), r]
    out = torch.empty((o, r, k), dtype=out_dtype, device=x.device)     # contiguous: conv2d's fast path
    out.copy_(y.view(o, k, r).transpose(1, 2))
    return out.view((o, r) + tuple(x.shape[2:]))


def follow(adapter: Mapping[str, torch.Tensor], like: torch.Tensor) -> dict:
    """A site's adapter tensors on the device of ``like``, the weight they fold (dtypes kept).

    Adapter tensors are read on the CPU (the file format) while the weights may sit on a GPU: this is the one place
    that brings them together; a tensor already there is not copied."""
    return {k: v if v.device == like.device else v.to(like.device) for k, v in adapter.items()}


def map_layer(role: str, x: torch.Tensor, adapter: Mapping[str, torch.Tensor], bias: bool = False,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fold of one layer of a site applied to ``x`` (its weight, bias or any delta of them).

    ``role``: ``proj``/``out`` (FF) or ``conv1``/``emb``/``conv2`` (Res); ``adapter``: the site's tensors (any float
    dtype, any device: they are brought to ``x``'s, see :func:`follow`). The biases of ``out`` and ``conv2`` pass
    through unchanged. (``norm2`` is replaced, not mapped.)
    """
    adapter = follow(adapter, x)
    if role == "proj":
        return map_geglu_rows(x, adapter["down_value"], adapter["down_gate"], out_dtype)
    if role in ("conv1", "emb"):
        return map_rows(x, adapter["down"], out_dtype)
    if role in ("out", "conv2"):
        return x.to(out_dtype or x.dtype) if bias else map_cols(x, adapter["up"], out_dtype)
    raise ValueError(f"layer role {role!r} has no fold map")


def layer_roles(site: str, kind: str) -> dict[str, str]:
    """Canonical module path → role for the layers a site's fold changes (norm2 included, as ``norm2``)."""
    if kind == "ff":
        return {f"{site}.{FF_LAYERS['proj']}": "proj", f"{site}.{FF_LAYERS['out']}": "out"}
    return {f"{site}.{_LDM[role]}": role for role in ("conv1", "emb", "norm2", "conv2")}


def site_keys(site: str, kind: str) -> list[str]:
    """The canonical keys (weights and biases) of the layers a site's fold changes, norm2 included."""
    return [f"{module}.{p}" for module in layer_roles(site, kind) for p in ("weight", "bias")]


# ---------------------------------------------------------------------------------------------- the fold

def out_bias_shift(w_o: torch.Tensor, up_bias: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W_o·c: what the FF intercept ``up_bias`` adds to the ``net.2`` bias (linear in W_o, so a LoRA delta ΔW_o of
    net.2 adds ΔW_o·c to the slim bias)."""
    dt = compute_dtype(w_o, up_bias)
    return (w_o.to(dt) @ up_bias.to(w_o.device, dt)).to(out_dtype or dt)


def fold_ff(w_p, b_p, w_o, b_o, down_value, down_gate, up, up_bias=None):
    """Return (W'_p, b'_p, W'_o, b'_o) in the dtype of ``w_p``, computed in at least float32."""
    out, t = w_p.dtype, follow({"down_value": down_value, "down_gate": down_gate, "up": up}, w_p)
    if up_bias is None:
        new_bo = None if b_o is None else b_o.clone()
    else:
        shift = out_bias_shift(w_o, up_bias)
        new_bo = (shift if b_o is None else b_o.to(shift.dtype) + shift).to(out)
    return (map_layer("proj", w_p, t, out_dtype=out),
            None if b_p is None else map_layer("proj", b_p, t, bias=True, out_dtype=out),
            map_layer("out", w_o, t, out_dtype=out), new_bo)


def fold_res(w_1, b_1, w_e, b_e, w_2, b_2, down, up):
    """Return (W'_1, b'_1, W'_e, b'_e, W'_2, b'_2); ``w_e`` may be None (no time embedding)."""
    out, t = w_1.dtype, follow({"down": down, "up": up}, w_1)
    new = [None if x is None else map_layer(role, x, t, bias=bias, out_dtype=out)
           for role, x, bias in (("conv1", w_1, False), ("conv1", b_1, True), ("emb", w_e, False),
                                 ("emb", b_e, True), ("conv2", w_2, False))]
    return (*new, None if b_2 is None else b_2.clone())


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
    out[n2 + ".weight"] = tensors["norm.weight"].to(w1.device, w1.dtype)
    out[n2 + ".bias"] = tensors["norm.bias"].to(w1.device, w1.dtype)
    return out


def fold_state_dict(weights: Mapping[str, torch.Tensor], adapter_set, sites=None, progress=None) -> dict:
    """Fold ``adapter_set`` (an :class:`~sdslim_core.io.adapters.AdapterSet`) into canonical ``weights``.

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
