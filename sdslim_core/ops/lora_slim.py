"""LoRAs in slim space: exact conversion of LoRA/LyCORIS modules made for the original model into modules for
its slim form, without the full-size weights.

The fold of every layer is linear (:func:`sdslim_core.ops.fold.map_layer`), so fold(W + s·ΔW) = fold(W) + s·map(ΔW).
Per form, on the layers of folded sites (modules on every other layer pass through unchanged, as the same object):

- LoRA / LoCon (incl. a Tucker ``lora_mid``; kohya, peft, diffusers, ComfyUI names): stays low-rank, same rank and
  alpha. Output-side layers map the up factor (GEGLU proj: blockdiag(A_v, A_g)·up; conv1/emb: D·up), input-side
  layers map the down factor (net.2: down·U; conv2: down×U, a LoCon's 3×3 factor absorbs U);
- LoHa without Tucker cores: (W1a·W1b)⊙(W2a·W2b) is exactly a LoRA of rank k1·k2 (row-wise Kronecker factors),
  converted as above where that costs no more than the dense slim layer, else like the next item;
- LoHa with Tucker cores, LoKr, full diffs, LyCORIS norm deltas: ΔW (:func:`sdslim_core.ops.lora.delta_weight`) mapped
  to an exact dense slim-size delta (kind ``diff``); bias deltas (``diff_b``/``b_norm``) are mapped the same way;
- DoRA on a folded layer renormalises with the full-size base weight: refused (:class:`LoraError`, fold it instead);
- anything on a folded ResBlock's norm2 (which the fold replaces): dropped, with :func:`sdslim_core.ops.lora.norm2_lost`.

Modules are :class:`~sdslim_core.io.lora_files.LoraModule` on canonical module paths, as :func:`sdslim_core.io.lora_files.parse_lora`
returns them or as a host builds them from its own patches; converted modules target the same paths with slim
shapes, so :func:`sdslim_core.ops.lora.apply_deltas`, ComfyUI and A1111 apply them like any LoRA. Strength is not part of
a module: apply a converted module with the strength its original would get.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Mapping

import torch

from . import fold
from .. import layout
from ..io.adapters import AdapterSet
from ..io.lora_files import LoraError, LoraModule
from .lora import delta_weight, module_parts, module_scale, norm2_lost

UNCHANGED, LOW_RANK, DENSE, DROPPED = "unchanged", "low-rank", "dense", "dropped"


class SlimSpace:
    """The fold maps of one adapter set, applied to LoRA modules.

    ``adapters``: the folded :class:`~sdslim_core.io.adapters.AdapterSet` (its tensors may be on ``meta`` when
    ``site_tensors`` reads them); ``full_shapes``: canonical key → shape of the original model (see
    :meth:`for_slim`); ``site_tensors(site)``: that site's adapter tensors (default ``adapters.sites[site]``).
    """

    def __init__(self, adapters: AdapterSet, full_shapes: Mapping[str, tuple],
                 site_tensors: Callable[[str], Mapping[str, torch.Tensor]] | None = None):
        self.adapters = adapters
        self.full_shapes = {k: tuple(v) for k, v in full_shapes.items()}
        self._site_tensors = site_tensors or (lambda site: adapters.sites[site])
        self.roles: dict[str, tuple[str, str]] = {}           # canonical module path → (site, role)
        for site in adapters.sites:
            for module, role in fold.layer_roles(site, adapters.kind(site)).items():
                self.roles[module] = (site, role)
        self._cached: tuple = (None, None)                     # (site, its adapter tensors): the last site read

    @classmethod
    def for_slim(cls, adapters: AdapterSet, slim_shapes: Mapping[str, tuple], site_tensors=None) -> "SlimSpace":
        """The space of a slim model given its own (canonical) shapes: the full-size shapes are recovered from the
        adapter widths."""
        return cls(adapters, fold.slim_shapes(slim_shapes, adapters.widths()), site_tensors)

    def form(self, mod: LoraModule) -> str:
        """How ``mod`` enters slim space: ``unchanged``, ``low-rank``, ``dense`` or ``dropped`` (norm2).

        Raises :class:`LoraError` for DoRA on a layer the fold changes."""
        hit = self.roles.get(mod.target)
        if hit is None:
            return UNCHANGED
        site, role = hit
        if role == "norm2":
            return DROPPED
        if mod.dora is not None:
            raise LoraError(f"{mod.source}: module {mod.name!r} is DoRA on {mod.target}, a layer the fold changes "
                            f"(site {site}): DoRA renormalises with the full-size base weight, which a slim model no "
                            "longer has, so it cannot be applied in slim space; fold it instead: apply it to the "
                            "original checkpoint before slimming (sdslim slim --ckpt ORIGINAL --adapters ADAPTERS "
                            "--lora ...; in ComfyUI, a LoRA loader before Slim UNet)")
        if self._shifts_bias(mod):
            return DENSE                # the intercept c moves the net.2 bias by ΔW·c: a bias delta kohya can't carry
        if mod.kind == "lora" or mod.kind == "loha" and self._loha_rank_pays(mod, site, role):
            return LOW_RANK
        return DENSE

    def convert(self, mod: LoraModule, parts: Iterable[str] = ("weight", "bias")) -> LoraModule | None:
        """``mod`` in slim space: the same object when untouched, None when dropped, else a new module (kind
        ``lora`` with mapped factors, or ``diff`` holding only the requested ``parts``)."""
        form = self.form(mod)
        if form == UNCHANGED:
            return mod
        if form == DROPPED:
            return None
        site, role = self.roles[mod.target]
        t = mod.tensors
        dt = fold.compute_dtype(*t.values(), *self.adapters.sites[site].values())
        ad = self._adapter(site)
        full = self.full_shapes[f"{mod.target}.weight"]
        if form == LOW_RANK:
            if mod.kind == "loha":
                mod = _loha_as_lora(mod, full, dt)
                t = mod.tensors
            new = dict(t)
            if role in ("out", "conv2"):                      # input side: down [k, c(, kh, kw)] → [k, r(, kh, kw)]
                down = t["down"].to(dt)
                k = down.shape[0]
                mapped = fold.map_layer(role, down.reshape(k, full[1], -1), ad)
                new["down"] = (mapped.reshape((k, mapped.shape[1]) + tuple(down.shape[2:])) if down.ndim > 2
                               else mapped.reshape(k, -1))
            else:                                             # output side: up [out, k(, 1, 1)] → [r or 2r, k(, 1, 1)]
                up = t["up"].to(dt)
                new["up"] = fold.map_layer(role, up.reshape(up.shape[0], -1), ad).reshape((-1,) + tuple(up.shape[1:]))
            return dataclasses.replace(mod, tensors=new)
        new, have = {}, module_parts(mod)
        if "bias" in parts and "bias" in have:
            bias = t["diff_b" if mod.kind == "diff" else "b_norm"].to(dt).reshape(-1)
            new["diff_b"] = fold.map_layer(role, bias, ad, bias=True)
        if "weight" in parts and "weight" in have:
            delta = delta_weight(mod, full, dt)
            new["diff"] = fold.map_layer(role, delta, ad)
            if role == "out" and "up_bias" in ad:             # b'_o = b_o + W_o·c is linear in W_o too
                shift = fold.out_bias_shift(delta, ad["up_bias"], dt)
                new["diff_b"] = new["diff_b"] + shift if "diff_b" in new else shift
        return dataclasses.replace(mod, kind="diff", tensors=new, scale_override=None)

    def changes(self, mod: LoraModule, part: str) -> tuple[str, ...]:
        """The parts of its slim layer that ``mod``'s ``part`` (``weight`` or ``bias``) changes: ``(part,)``, also
        ``bias`` for a weight delta on a ``net.2`` whose site has an FF intercept (ΔW·c), ``()`` when dropped."""
        form = self.form(mod)
        if form == DROPPED:
            return ()
        if form == DENSE and part == "weight" and self._shifts_bias(mod):
            return ("weight", "bias")
        return (part,)

    def convert_part(self, mod: LoraModule, part: str) -> dict[str, LoraModule]:
        """``mod``'s ``part`` in slim space, by the part of the slim layer each result changes (see :meth:`changes`):
        ``{part: module}``, with the intercept's bias shift of a ``net.2`` weight delta as a separate ``diff``
        module under ``bias``; ``{}`` when dropped. Apply each with ``lora.apply_deltas(w, [(m, s, part)])`` at the
        strength the original part would get, or hand it to a host as one patch per key."""
        new = self.convert(mod, (part,))
        if new is None:
            return {}
        if new is mod or part != "weight" or "diff_b" not in new.tensors:
            return {part: new}
        return {"weight": dataclasses.replace(new, tensors={"diff": new.tensors["diff"]}),
                "bias": dataclasses.replace(new, tensors={"diff_b": new.tensors["diff_b"]})}

    def _shifts_bias(self, mod: LoraModule) -> bool:
        hit = self.roles.get(mod.target)
        return hit is not None and hit[1] == "out" and "up_bias" in self.adapters.sites[hit[0]]

    def _loha_rank_pays(self, mod: LoraModule, site: str, role: str) -> bool:
        """Whether a plain LoHa on this layer is no dearer as its exact rank-k1·k2 factorisation than dense."""
        t = mod.tensors
        if "hada_t1" in t:
            return False
        full = self.full_shapes[f"{mod.target}.weight"]
        r, n = self.adapters.rank(site), math.prod(full[1:])
        rows, cols = ((2 * r if role == "proj" else r), n) if role in ("proj", "conv1", "emb") else \
            (full[0], r * math.prod(full[2:]))
        k = t["hada_w1_b"].shape[0] * t["hada_w2_b"].shape[0]
        return k * (rows + cols) <= rows * cols

    def site_tensors(self, site: str) -> Mapping[str, torch.Tensor]:
        """``site``'s adapter tensors (read again each call when they come from a file)."""
        return self._site_tensors(site)

    def _adapter(self, site: str) -> Mapping[str, torch.Tensor]:
        if self._cached[0] != site:                            # the last site read (modules come grouped by site)
            self._cached = (None, None)
            self._cached = (site, self._site_tensors(site))
        return self._cached[1]


class DeferredSlimSpace:
    """The :class:`SlimSpace` of a slim model whose adapters are looked for only when a LoRA on a folded layer needs
    them. ``roles`` (which layers the fold changed) comes from the model's own record, ``ranks`` (site → rank);
    everything else is the space ``resolve()`` returns, made on first use (its error, e.g. the adapter file not
    found, is raised to the caller and tried again next time)."""

    def __init__(self, ranks: Mapping[str, int], resolve: Callable[[], SlimSpace]):
        self.roles = {module: (site, role) for site in ranks
                      for module, role in fold.layer_roles(site, layout.site_kind(site)).items()}
        self._resolve, self._space = resolve, None

    def resolved(self) -> SlimSpace:
        if self._space is None:
            self._space = self._resolve()
        return self._space

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolved(), name)


def _loha_as_lora(mod: LoraModule, full: tuple, dt: torch.dtype) -> LoraModule:
    """A plain LoHa as the LoRA it equals: (W1a·W1b)⊙(W2a·W2b) = U·V with U = W1a•W2a (row-wise Kronecker,
    [out, k1·k2]) and V = W1bᵀ•W2bᵀ transposed ([k1·k2, in]); scale α/k1 kept. Conv factors get conv shapes."""
    t = {k: v.to(dt) for k, v in mod.tensors.items() if k.startswith("hada_")}
    w1a, w1b, w2a, w2b = t["hada_w1_a"], t["hada_w1_b"], t["hada_w2_a"], t["hada_w2_b"]
    k = w1b.shape[0] * w2b.shape[0]
    up = (w1a[:, :, None] * w2a[:, None, :]).reshape(w1a.shape[0], k)
    down = (w1b[:, None, :] * w2b[None, :, :]).reshape(k, -1)
    if len(full) == 4:
        up, down = up[:, :, None, None], down.reshape((k,) + tuple(full[1:]))
    return dataclasses.replace(mod, kind="lora", tensors={"up": up, "down": down}, scale_override=module_scale(mod))


@dataclasses.dataclass
class SlimConversion:
    """Modules converted into slim space (dropped ones left out, input order kept), the form of each input module
    (by ``LoraModule.ref()``) and the warnings (norm2 deltas lost)."""
    modules: list
    forms: dict
    warnings: list

    def counts(self) -> dict[str, int]:
        out = {f: 0 for f in (LOW_RANK, DENSE, UNCHANGED, DROPPED)}
        for f in self.forms.values():
            out[f] += 1
        return out


def convert_modules(modules: Iterable[LoraModule], space: SlimSpace) -> SlimConversion:
    """Convert every module (see :class:`SlimSpace`); refusals (DoRA on a folded layer) are raised before any
    arithmetic."""
    modules = list(modules)
    forms = {mod.ref(): space.form(mod) for mod in modules}
    out, lost = [], {}
    for mod in modules:
        new = space.convert(mod)
        if new is None:
            for part in module_parts(mod):
                lost.setdefault(f"{mod.target}.{part}", []).append(mod.ref())
        else:
            out.append(new)
    return SlimConversion(out, forms, [norm2_lost(key, refs) for key, refs in lost.items()])


# ------------------------------------------------------------------------------------------- kohya writer

def kohya_name(cfg: layout.UNetConfig, module: str) -> str:
    """The kohya ``lora_unet_…`` name of a canonical module path: diffusers-derived for SD1.x/SD2.x, LDM-derived for
    SDXL (the names sd-scripts writes; ComfyUI and A1111 read both)."""
    path = module if cfg.family == "sdxl" else layout.canonical_to_diffusers_key(cfg, module)
    return "lora_unet_" + path.replace(".", "_")


_KOHYA_SUFFIX = {"up": "lora_up.weight", "down": "lora_down.weight", "mid": "lora_mid.weight",
                 "dora_scale": "dora_scale", "magnitude": "dora_scale"}
_STRENGTH_TENSORS = {"loha": ("hada_w1_a",), "lokr": ("lokr_w1", "lokr_w1_a"), "diff": ("diff", "diff_b"),
                     "norm": ("w_norm", "b_norm")}


def kohya_tensors(modules: Iterable[LoraModule], cfg: layout.UNetConfig, strength: float = 1.0,
                  dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A kohya-format state dict of (slim-space) ``modules`` with ``strength`` baked in, tensors in ``dtype``
    (default: their own).

    LoRA/LoCon: ``lora_up``/``lora_down``(/``lora_mid``) + ``alpha`` = strength·scale·rank (the loader's alpha/rank is
    then the applied scale); dense slim deltas: LyCORIS full-diff ``diff``/``diff_b``; LoHa/LoKr/norm modules on
    unchanged layers keep their LyCORIS keys (strength folded into one factor). DoRA is written as ``dora_scale``
    (peft magnitudes as [out, 1, …]) and only at strength 1 (its effect is not linear in the strength).
    """
    out: dict[str, torch.Tensor] = {}

    def put(key, value):
        if key in out:
            raise LoraError(f"two LoRA modules write {key}; convert one LoRA file at a time")
        out[key] = value.detach().to(dtype or value.dtype).contiguous()
    for mod in modules:
        if mod.dora is not None and strength != 1:
            raise LoraError(f"{mod.source}: module {mod.name!r} is DoRA, whose effect is not linear in the strength; "
                            "convert it at strength 1 and set the strength in the LoRA loader")
        name = kohya_name(cfg, mod.target)
        t = dict(mod.tensors)
        if mod.kind == "lora":
            if t["up"].ndim == 2 and t["down"].ndim == 4:      # conv layer: up as a 1×1 conv, as kohya writes it
                t["up"] = t["up"][:, :, None, None]
            exact = torch.float64 if (dtype or t["down"].dtype) == torch.float64 else torch.float32
            # a file scalar: a 0-dim CPU tensor, which mixes with the factors on any device and is written as is
            t["alpha"] = torch.tensor(strength * module_scale(mod) * t["down"].shape[0], dtype=exact)
        else:
            roles = [r for r in _STRENGTH_TENSORS[mod.kind] if r in t]
            for role in roles if mod.kind in ("diff", "norm") else roles[:1]:   # ΔW is linear in each of these
                t[role] = strength * t[role]
        if "magnitude" in t:
            t["magnitude"] = t["magnitude"].reshape((-1,) + (1,) * (t["down"].ndim - 1))
        for role, value in t.items():
            if role == "alpha":                               # a scalar, kept in at least float32
                out[f"{name}.alpha"] = value.detach().reshape(()).to(torch.promote_types(value.dtype, torch.float32))
            else:
                put(f"{name}.{_KOHYA_SUFFIX.get(role, role)}", value)
    return out
