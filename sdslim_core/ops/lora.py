"""LoRA math on canonical weights: each module's ΔW (LoRA/LoCon/Tucker, LoHa, LoKr, full diff, norm deltas, DoRA)
and the merge into the full weights (:class:`LoraMerger`, :func:`merge_loras`, :func:`apply_deltas`); the files are
read by :mod:`sdslim_core.io.lora_files`.

Merge with strength s: W ← W + s·ΔW; with DoRA, W ← W + s·(W_dora − W), W_dora = (W + ΔW)·m/‖W + ΔW‖ (the norm
per output row when ``dora_scale`` has the output width first, else per input column; LyCORIS/peft semantics).
LoRAs are applied in list order, each on the result of the previous ones.

LoHa/LoKr/Tucker weights are rebuilt with lycoris-lora's functional API (imported lazily).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import torch

from .. import layout, optional
from ..io.lora_files import LoraError, LoraModule, MergeReport, ModuleIndex, parse_lora


# ------------------------------------------------------------------------------------------------ shapes

def _delta_shape(mod: LoraModule) -> tuple | None:
    """Shape of ΔW as the format builds it (before reshaping to the layer), or None for bias-only modules."""
    t = mod.tensors
    if mod.kind == "lora":
        up, down = t["up"], t["down"]
        r = down.shape[0]
        if up.ndim < 2 or down.ndim < 2 or up.shape[1] != r and "mid" not in t:
            raise LoraError(f"{mod.source}: module {mod.name!r}: lora_up {tuple(up.shape)} and lora_down "
                            f"{tuple(down.shape)} do not chain (rank {r})")
        if "mid" in t:
            mid = t["mid"]
            if mid.ndim < 2 or mid.shape[0] != up.shape[1] or mid.shape[1] != r:
                raise LoraError(f"{mod.source}: module {mod.name!r}: lora_mid {tuple(mid.shape)} does not chain "
                                f"up {tuple(up.shape)} and down {tuple(down.shape)}")
            return (up.shape[0], down.shape[1]) + tuple(mid.shape[2:])
        return (up.shape[0], math.prod(down.shape[1:]))
    if mod.kind == "loha":
        w1a, w1b, w2a, w2b = (t[k] for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        if "hada_t1" in t:
            t1, t2 = t["hada_t1"], t["hada_t2"]
            shp1 = (w1a.shape[1], w1b.shape[1]) + tuple(t1.shape[2:])
            shp2 = (w2a.shape[1], w2b.shape[1]) + tuple(t2.shape[2:])
            ok = (t1.shape[0] == w1a.shape[0] and t1.shape[1] == w1b.shape[0] and t2.shape[0] == w2a.shape[0]
                  and t2.shape[1] == w2b.shape[0])
        else:
            shp1 = (w1a.shape[0], math.prod(w1b.shape[1:]))
            shp2 = (w2a.shape[0], math.prod(w2b.shape[1:]))
            ok = w1a.shape[1] == w1b.shape[0] and w2a.shape[1] == w2b.shape[0]
        if not ok or shp1 != shp2:
            raise LoraError(f"{mod.source}: module {mod.name!r}: LoHa factors do not fit together "
                            f"({', '.join(f'{k} {tuple(v.shape)}' for k, v in t.items() if k.startswith('hada'))})")
        return shp1
    if mod.kind == "lokr":
        if "lokr_w1" in t:
            a, c = t["lokr_w1"].shape[:2]
        else:
            if t["lokr_w1_a"].shape[1] != t["lokr_w1_b"].shape[0]:
                raise LoraError(f"{mod.source}: module {mod.name!r}: lokr_w1_a/lokr_w1_b do not chain")
            a, c = t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1]
        if "lokr_w2" in t:
            w2 = tuple(t["lokr_w2"].shape)
        elif "lokr_t2" in t:
            t2, w2a, w2b = t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"]
            if t2.shape[0] != w2a.shape[0] or t2.shape[1] != w2b.shape[0]:
                raise LoraError(f"{mod.source}: module {mod.name!r}: lokr_t2 does not chain lokr_w2_a/lokr_w2_b")
            w2 = (w2a.shape[1], w2b.shape[1]) + tuple(t2.shape[2:])
        else:
            w2a, w2b = t["lokr_w2_a"], t["lokr_w2_b"]
            if w2a.shape[1] != w2b.shape[0]:
                raise LoraError(f"{mod.source}: module {mod.name!r}: lokr_w2_a/lokr_w2_b do not chain")
            w2 = (w2a.shape[0],) + tuple(w2b.shape[1:])
        return (a * w2[0], c * w2[1]) + tuple(w2[2:])
    if mod.kind == "diff":
        return tuple(t["diff"].shape) if "diff" in t else None
    return tuple(t["w_norm"].shape) if "w_norm" in t else None


def _fits(delta: tuple, weight: tuple) -> bool:
    return len(weight) >= 1 and delta[0] == weight[0] and math.prod(delta[1:]) == math.prod(weight[1:])


def check_module(mod: LoraModule, shape_of) -> list[str]:
    """Problems fitting ``mod`` onto the model (shape mismatches), as messages; empty when it fits."""
    problems = []
    w_shape = shape_of(f"{mod.target}.weight")
    delta = _delta_shape(mod)
    if delta is not None and (w_shape is None or not _fits(delta, w_shape)):
        problems.append(f"{mod.name}: ΔW {delta} vs {mod.target}.weight {w_shape}")
    for role in ("diff_b", "b_norm"):
        if role in mod.tensors:
            b_shape = shape_of(f"{mod.target}.bias")
            if b_shape is None or tuple(mod.tensors[role].shape) != tuple(b_shape):
                problems.append(f"{mod.name}: {role} {tuple(mod.tensors[role].shape)} vs {mod.target}.bias {b_shape}")
    dora = mod.dora
    if dora is not None and w_shape is not None and len(w_shape) > 1:
        size = w_shape[0] if mod.dora_on_output(w_shape) else w_shape[1]
        if dora.numel() != size:
            problems.append(f"{mod.name}: DoRA magnitude {tuple(dora.shape)} fits neither axis of {w_shape}")
    return problems


# ------------------------------------------------------------------------------------------------ ΔW math

def _lycoris(name: str):
    return optional.require(f"lycoris.functional.{name}", "merging LoHa/LoKr/Tucker LoRA weights")


def module_scale(mod: LoraModule) -> float:
    """The format's own scale (α/r and friends), not the user strength."""
    t = mod.tensors
    alpha = float(t["alpha"].item()) if "alpha" in t else None
    if mod.kind == "lora":
        if alpha is None:
            return 1.0 if mod.scale_override is None else mod.scale_override
        return alpha / t["down"].shape[0]
    if mod.kind == "loha":
        return 1.0 if alpha is None else alpha / t["hada_w1_b"].shape[0]
    if mod.kind == "lokr":
        rank = t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None
        return 1.0 if alpha is None or rank is None else alpha / rank
    return 1.0


def delta_weight(mod: LoraModule, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """ΔW (format scale applied, strength not) reshaped to the layer's weight ``shape``, in ``dtype``."""
    t = {k: v.to(dtype) for k, v in mod.tensors.items()}
    scale = module_scale(mod)
    if mod.kind == "lora":
        if "mid" in t:
            out = _lycoris("locon").diff_weight(t["down"], t["up"], t["mid"], gamma=scale, backend="torch")
        else:
            out = (t["up"].flatten(1) @ t["down"].flatten(1)) * scale
    elif mod.kind == "loha":
        out = _lycoris("loha").diff_weight(t["hada_w1_b"], t["hada_w1_a"], t["hada_w2_b"], t["hada_w2_a"],
                                           t.get("hada_t1"), t.get("hada_t2"), gamma=scale, backend="torch")
    elif mod.kind == "lokr":
        out = _lycoris("lokr").kron_weight(t.get("lokr_w1"), t.get("lokr_w1_a"), t.get("lokr_w1_b"), t.get("lokr_w2"),
                                           t.get("lokr_w2_a"), t.get("lokr_w2_b"), t.get("lokr_t2"), scale=scale,
                                           backend="torch")
    elif mod.kind == "diff":
        out = t["diff"]
    else:
        out = t["w_norm"]
    return out.reshape(shape)


def _dora_merge(w: torch.Tensor, delta: torch.Tensor, dora: torch.Tensor, strength: float,
                on_out: bool) -> torch.Tensor:
    """W + s·(W_dora − W), W_dora = (W + ΔW)·m/‖W + ΔW‖ per output row (``on_out``) or per input column."""
    merged = w + delta
    if on_out:
        m = dora.to(w.dtype).reshape(w.shape[0], *[1] * (w.ndim - 1))
        norm = merged.reshape(w.shape[0], -1).norm(dim=1).reshape(m.shape)
    else:
        m = dora.to(w.dtype).reshape(1, w.shape[1], *[1] * (w.ndim - 2))
        norm = merged.transpose(0, 1).reshape(w.shape[1], -1).norm(dim=1).reshape(m.shape)
    w_dora = merged * (m / (norm + torch.finfo(w.dtype).eps))
    return w + strength * (w_dora - w)


# ------------------------------------------------------------------------------------------------- merger

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class LoraMerger:
    """Parsed and validated LoRAs, merged one canonical key at a time (for streaming through a checkpoint).

    ``parsed`` keeps [(modules, strength)] per LoRA in order and ``plan`` maps each canonical key to its
    [(module, strength, part)] entries (``part``: ``weight`` or ``bias``).
    """

    def __init__(self, loras: Sequence, cfg: layout.UNetConfig, shapes: Mapping[str, Sequence[int]],
                 keys: set | None = None, fold_sites: Iterable[str] | None = None):
        self.report = MergeReport()
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        index = ModuleIndex(cfg, self.shapes)
        self.plan: dict[str, list] = {}
        self.parsed: list[tuple[list[LoraModule], float]] = []
        problems, hints = [], []
        for src, strength in loras:
            strength = float(strength)
            if not math.isfinite(strength):
                raise LoraError(f"strength {strength} is not a finite number")
            mods = parse_lora(src, index, self.report, strength, keys)
            fitting = []
            for mod in mods:
                found = check_module(mod, self.shapes.get)
                problems.extend(f"{mod.source}: {p}" for p in found)
                if not found:
                    fitting.append(mod)
            self.parsed.append((fitting, strength))
            if self.report.loras and self.report.loras[-1].get("metadata_hint"):
                hints.append(self.report.loras[-1]["source"] + ": " + self.report.loras[-1]["metadata_hint"])
        if problems:
            more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
            hint = f"; LoRA metadata: {'; '.join(hints)}" if hints else ""
            raise LoraError("LoRA does not fit this model (made for another family, e.g. an SDXL LoRA on SD1.5?): "
                            + "; ".join(problems[:6]) + more + hint)
        for mods, strength in self.parsed:
            if strength == 0:
                continue
            for mod in mods:
                for part in module_parts(mod):
                    key = f"{mod.target}.{part}"
                    if keys is not None and key not in keys:
                        continue
                    self.plan.setdefault(key, []).append((mod, strength, part))
                    self.report.merged.setdefault(key, []).append(mod.ref())
        if fold_sites is not None:
            self.report.warnings.extend(fold_conflicts(self.report, fold_sites))

    def touched(self) -> set[str]:
        return set(self.plan)

    def merge(self, key: str, base: torch.Tensor, dtype: torch.dtype | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``base`` with every planned delta for ``key`` applied (see :func:`apply_deltas`)."""
        return apply_deltas(base, self.plan.get(key, ()), dtype, out_dtype)


def module_parts(mod: LoraModule) -> list[str]:
    """The parts of its layer a module changes: ``weight`` and/or ``bias``."""
    parts = ["weight"] if _delta_shape(mod) is not None else []
    if any(r in mod.tensors for r in ("diff_b", "b_norm")):
        parts.append("bias")
    return parts


_SLAB_BYTES = 8 << 20


def _plain_lora(mod: LoraModule, part: str) -> bool:
    return part == "weight" and mod.kind == "lora" and "mid" not in mod.tensors and mod.dora is None


def follow(mod: LoraModule, like: torch.Tensor | torch.device) -> LoraModule:
    """``mod`` with its tensors on ``like``'s device (the weight it changes) or on the device ``like``; itself when
    they are there."""
    device = like.device if isinstance(like, torch.Tensor) else torch.device(like)
    if all(t.device == device for t in mod.tensors.values()):
        return mod
    return dataclasses.replace(mod, tensors={k: v.to(device) for k, v in mod.tensors.items()})


def apply_deltas(base: torch.Tensor, entries: Iterable, dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``base`` + each entry's delta, for entries (module, strength, part) of one tensor, computed in ``dtype``
    (default: the compute dtype) and returned in ``out_dtype`` (default: ``out``'s dtype, else ``dtype``).

    ``base`` is not modified unless it is ``out``: a tensor of its shape that receives the result (in place, with
    no new allocation of the weight's size, when every entry is a plain LoRA). Plain LoRA/LoCon entries with an
    ``out_dtype`` other than the compute dtype go a slab of rows at a time, so the compute-dtype copy of the weight
    never exists whole (a cast slab stays in cache). The entries' tensors (read on the CPU) are brought to ``base``'s
    device (:func:`follow`)."""
    dt = dtype or compute_dtype(base.dtype)
    out_dtype = out.dtype if out is not None else out_dtype or dt
    entries = [(follow(m, base), s, part) for m, s, part in entries]
    if out_dtype != dt and entries and all(_plain_lora(m, part) for m, _, part in entries):
        factors = [(m.tensors["up"].to(dt).flatten(1), m.tensors["down"].to(dt).flatten(1), s * module_scale(m))
                   for m, s, _ in entries]
        flat = base.reshape(base.shape[0], -1)
        dest = torch.empty(flat.shape, dtype=out_dtype, device=base.device) if out is None else out.view(flat.shape)
        rows = max(1, _SLAB_BYTES // (flat.shape[1] * torch.finfo(dt).bits // 8))
        for i in range(0, flat.shape[0], rows):
            w = flat[i:i + rows].to(dt, copy=True)
            for up, down, alpha in factors:       # W += s·(α/r)·up·down, one in-place matmul per LoRA
                w.addmm_(up[i:i + rows], down, alpha=alpha)
            dest[i:i + rows] = w
        return dest.view(base.shape)
    w = base.to(dt, copy=True)
    for mod, strength, part in entries:
        t = mod.tensors
        if part == "bias":
            w.add_(t["diff_b" if mod.kind == "diff" else "b_norm"].to(dt).reshape(w.shape), alpha=strength)
        elif _plain_lora(mod, part):
            # plain LoRA/LoCon: W += s·(α/r)·up·down fused into one in-place matmul (no ΔW allocation)
            w.view(w.shape[0], -1).addmm_(t["up"].to(dt).flatten(1), t["down"].to(dt).flatten(1),
                                          alpha=strength * module_scale(mod))
        elif mod.dora is not None:
            w = _dora_merge(w, delta_weight(mod, w.shape, dt), mod.dora, strength, mod.dora_on_output(w.shape))
        else:
            w.add_(delta_weight(mod, w.shape, dt), alpha=strength)
    return w.to(out_dtype) if out is None else out.copy_(w)


def fold_conflicts(report: MergeReport, fold_sites) -> list[str]:
    """Warnings for LoRA deltas on layers the fold replaces (norm2 = ``out_layers.0`` of slimmed Res sites).

    ``fold_sites``: an :class:`~sdslim_core.io.adapters.AdapterSet` or site names.
    """
    names = fold_sites.sites if hasattr(fold_sites, "sites") else fold_sites
    norm2 = {f"{s}.{layout.RES_LAYERS['ldm']['norm2']}" for s in names if layout.site_kind(s) == "res"}
    return [norm2_lost(key, refs) for key, refs in report.merged.items() if key.rsplit(".", 1)[0] in norm2]


def norm2_lost(key: str, refs: Sequence[str]) -> str:
    """The warning for LoRA modules ``refs`` whose delta on ``key`` (a slimmed ResBlock's norm2) cannot survive."""
    module = key.rsplit(".", 1)[0]
    return (f"{', '.join(refs)} changes {key} (norm2 of the slimmed ResBlock {module[:-len('.out_layers.0')]}); "
            "the fold replaces that layer, so this part of the LoRA is lost")


def _shape_getter(weights: Mapping):
    """canonical key → shape, from the file header where ``weights`` is a lazy checkpoint view."""
    if hasattr(weights, "shapes"):
        return weights.shapes()
    return {k: tuple(v.shape) for k, v in weights.items()}


def merge_loras(weights_canonical: Mapping, loras: Sequence, cfg: layout.UNetConfig | None = None,
                keys: set | None = None, fold_sites=None) -> tuple[dict, MergeReport]:
    """Merge ``loras`` = [(path_or_state_dict, strength), ...] into canonical weights.

    Returns (only the changed canonical keys as new tensors in the base dtype, :class:`MergeReport`); the input is
    not modified. Computes in float32 (float64 when the base is float64). ``keys`` restricts the merge to those
    canonical keys (LoRA modules elsewhere are skipped); ``fold_sites`` (AdapterSet or site names) adds warnings
    for deltas on layers the fold will replace.
    """
    shapes = _shape_getter(weights_canonical)
    if cfg is None:
        cfg = layout.config_from_state_dict(shapes)
    merger = LoraMerger(loras, cfg, shapes, keys, fold_sites)
    out = {}
    for key in merger.plan:
        base = weights_canonical[key]
        out[key] = merger.merge(key, base, out_dtype=base.dtype)
    return out, merger.report
