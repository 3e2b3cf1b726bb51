"""LoRA / LyCORIS / peft files: parsing onto canonical UNet modules and merging into the full weights.

Formats (each module may carry ``alpha`` and, for DoRA, ``dora_scale`` / peft's ``lora_magnitude_vector``):

- LoRA / LoCon: ``lora_down.weight`` [r, in(, k, k)], ``lora_up.weight`` [out, r(, 1, 1)], optional
  ``lora_mid.weight`` (Tucker core); also peft ``lora_A``/``lora_B`` and diffusers ``lora.down``/``lora.up``
  (and the old attention-processor ``processor.to_q_lora.down`` form). ΔW = (α/r)·up·down.
- LoHa: ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b`` (optional ``hada_t1``/``hada_t2``).
  ΔW = (α/r)·(w1a·w1b) ⊙ (w2a·w2b).
- LoKr: ``lokr_w1`` or ``lokr_w1_a``/``lokr_w1_b``, ``lokr_w2`` or ``lokr_w2_a``/``lokr_w2_b`` (optional ``lokr_t2``).
  ΔW = s·kron(w1, w2), s = α/r when a side is factorised, else 1.
- Full differences ``diff``/``diff_b`` and LyCORIS norm deltas ``w_norm``/``b_norm``.

Merge with strength s: W ← W + s·ΔW; with DoRA, W ← W + s·(W_dora − W), W_dora = (W + ΔW)·m/‖W + ΔW‖ (the norm
per output row when ``dora_scale`` has the output width first, else per input column; LyCORIS/peft semantics).
LoRAs are applied in list order, each on the result of the previous ones.

Module names are resolved against the model's own module paths in both namings (LDM ``input_blocks.1.1…`` and
diffusers ``down_blocks.0.attentions.0…``), dotted or with dots turned into underscores (kohya ``lora_unet_…``); no
underscore is ever guessed. Prefixes: ``lora_unet_``, ``diffusion_model.``, ``model.diffusion_model.``, ``unet.``,
``base_model.model.``; text-encoder prefixes (``lora_te_``, ``lora_te1_``, ``lora_te2_``, ``text_encoder.`` …) are
reported as ignored. LoHa/LoKr/Tucker weights are rebuilt with lycoris-lora's functional API (imported lazily).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from .. import layout, optional
from ..io.tensors import FileFormatError, LazyStateDict, all_finite

TE_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "text_encoder.", "text_encoder_2.",
               "text_encoders.", "lora_te.", "lora_te1.", "lora_te2.", "te.", "te1.", "te2.", "cond_stage_model.",
               "conditioner.", "clip_l.", "clip_g.")
KOHYA_UNET = "lora_unet_"
DOTTED_PREFIXES = ("base_model.model.unet.", "base_model.model.", *layout.LDM_PREFIXES, *layout.DIFFUSERS_PREFIXES,
                   "lora_unet.")
IGNORED_PREFIXES = {"bundle_emb.": "embedding bundled with the LoRA (a text-encoder token, not a UNet weight)"}

# file suffix → role; longest suffixes first so ``.lora_A.default.weight`` wins over ``.weight``-less forms.
_SUFFIXES = {
    ".lora_down.weight": "down", ".lora_up.weight": "up", ".lora_mid.weight": "mid",
    ".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_A.default.weight": "down",
    ".lora_B.default.weight": "up", ".lora.down.weight": "down", ".lora.up.weight": "up",
    ".lora_linear_layer.down.weight": "down", ".lora_linear_layer.up.weight": "up",
    ".lora_magnitude_vector": "magnitude", ".lora_magnitude_vector.weight": "magnitude",
    ".lora_magnitude_vector.default.weight": "magnitude",
    ".alpha": "alpha", ".dora_scale": "dora_scale",
    ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b", ".hada_w2_a": "hada_w2_a", ".hada_w2_b": "hada_w2_b",
    ".hada_t1": "hada_t1", ".hada_t2": "hada_t2",
    ".lokr_w1": "lokr_w1", ".lokr_w1_a": "lokr_w1_a", ".lokr_w1_b": "lokr_w1_b", ".lokr_w2": "lokr_w2",
    ".lokr_w2_a": "lokr_w2_a", ".lokr_w2_b": "lokr_w2_b", ".lokr_t2": "lokr_t2",
    ".diff": "diff", ".diff_b": "diff_b", ".w_norm": "w_norm", ".b_norm": "b_norm",
}
_SUFFIX_ORDER = sorted(_SUFFIXES, key=len, reverse=True)
_PROCESSOR_RX = re.compile(r"^(.*)\.processor\.(to_q|to_k|to_v|to_out)_lora\.(down|up)\.weight$")
_PROCESSOR_TARGET = {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"}


class LoraError(FileFormatError):
    """A LoRA file is malformed or does not fit the model; the message names the file and keys."""


# --------------------------------------------------------------------------------------------------- report

@dataclasses.dataclass
class MergeReport:
    """What a merge did: merged canonical keys (with the LoRA modules behind each), ignored and unknown keys."""
    loras: list = dataclasses.field(default_factory=list)          # per LoRA: source, strength, formats, counts
    merged: dict = dataclasses.field(default_factory=dict)         # canonical key → ["source:module", ...]
    ignored_text_encoder: list = dataclasses.field(default_factory=list)
    ignored: list = dataclasses.field(default_factory=list)        # other known-but-unused keys (bundled embeddings)
    unknown: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        lines = []
        for info in self.loras:
            lines.append(f"LoRA {info['source']} (strength {info['strength']:g}, {'/'.join(info['formats']) or '-'}): "
                         f"{info['modules']} UNet modules, {info['ignored_text_encoder']} text-encoder keys ignored, "
                         f"{info['unknown']} unknown keys")
        lines.append(f"merged into {len(self.merged)} UNet tensors")
        if self.unknown:
            lines.append("unknown keys: " + ", ".join(self.unknown[:8]) + (" …" if len(self.unknown) > 8 else ""))
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


@dataclasses.dataclass
class LoraModule:
    """One adapted layer of one LoRA file."""
    source: str
    name: str                    # the module name as written in the file
    target: str                  # canonical module path
    kind: str                    # lora | loha | lokr | diff | norm
    tensors: dict                # role → tensor
    keys: list                   # the file keys it consists of
    scale_override: float | None = None   # peft/diffusers alpha/r from metadata (no ``alpha`` key)

    @property
    def dora(self) -> torch.Tensor | None:
        return self.tensors.get("dora_scale", self.tensors.get("magnitude"))

    def dora_on_output(self, weight_shape) -> bool:
        """Whether the DoRA magnitude is per output row (peft always; LyCORIS/kohya when its first dim is out)."""
        if "magnitude" in self.tensors:
            return True
        d = self.tensors["dora_scale"]
        return d.shape[0] == weight_shape[0] and d.numel() == weight_shape[0]

    def ref(self) -> str:
        return f"{self.source}:{self.name}"


# --------------------------------------------------------------------------------------------- module index

class ModuleIndex:
    """Every weight-bearing module of a UNet, by canonical path, diffusers path and both with ``_`` for ``.``."""

    def __init__(self, cfg: layout.UNetConfig, keys: Iterable[str]):
        keys = list(keys)
        self.modules = {k[:-len(".weight")] for k in keys if k.endswith(".weight")}
        self.dotted: dict[str, str] = {}
        self.underscore: dict[str, str] = {}
        self.ambiguous: set[str] = set()
        for module in self.modules:
            names = {module}
            try:
                names.add(layout.canonical_to_diffusers_key(cfg, module))
            except layout.LayoutError:
                pass
            for name in names:
                self.dotted[name] = module
                flat = name.replace(".", "_")
                if self.underscore.get(flat, module) != module:
                    self.ambiguous.add(flat)
                self.underscore[flat] = module

    def resolve_kohya(self, flat: str) -> str | None:
        if flat in self.ambiguous:
            raise LoraError(f"kohya name {flat!r} matches more than one module of this model")
        return self.underscore.get(flat)

    def resolve_dotted(self, path: str) -> str | None:
        return self.dotted.get(path)


def _split_suffix(key: str) -> tuple[str, str] | None:
    """(module name, role) for a key with a known LoRA suffix, else None."""
    m = _PROCESSOR_RX.match(key)
    if m:
        return f"{m.group(1)}.{_PROCESSOR_TARGET[m.group(2)]}", m.group(3)
    for suffix in _SUFFIX_ORDER:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[:-len(suffix)], _SUFFIXES[suffix]
    return None


# ------------------------------------------------------------------------------------------------ sources

def _open_source(src) -> tuple[Mapping, dict, str, dict | None]:
    """(tensors, metadata, display name, peft adapter_config or None) for a path, folder or mapping."""
    if isinstance(src, Mapping):
        return src, dict(getattr(src, "metadata", {}) or {}), getattr(src, "path", None) and str(src.path) or \
            "<state dict>", None
    path = Path(src)
    peft_cfg = None
    if path.is_dir():
        found = [path / n for n in ("adapter_model.safetensors", "pytorch_lora_weights.safetensors")
                 if (path / n).exists()]
        if not found:
            raise LoraError(f"{path}: a LoRA folder needs adapter_model.safetensors or pytorch_lora_weights.safetensors")
        path = found[0]
    side = path.parent / "adapter_config.json"
    if side.exists():
        try:
            peft_cfg = json.loads(side.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise LoraError(f"{side}: unreadable peft adapter_config.json ({err})") from None
    try:
        lazy = LazyStateDict(path)
    except FileFormatError as err:
        raise LoraError(str(err)) from None
    return lazy, dict(lazy.metadata), str(path), peft_cfg


def text_encoder_part(src) -> tuple[dict, dict]:
    """(text-encoder keys → tensors, file metadata) of a LoRA (path, folder or state dict), keys as written."""
    tensors, metadata, name, _ = _open_source(src)
    try:
        return {k: tensors[k] for k in tensors.keys() if k.startswith(TE_PREFIXES)}, metadata
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise LoraError(f"{name}: cannot read its text-encoder tensors ({err})") from None


def _family_hint(metadata: Mapping) -> str:
    for key in ("ss_base_model_version", "modelspec.architecture", "ss_sd_model_name"):
        if metadata.get(key):
            return f" (its metadata says {key}={metadata[key]!r})"
    return ""


def _peft_scale(metadata: Mapping, peft_cfg: dict | None):
    """A function module-name → alpha/r scale from diffusers' ``lora_adapter_metadata`` or peft's config, or None."""
    conf = None
    if peft_cfg:
        conf = peft_cfg
    elif metadata.get("lora_adapter_metadata"):
        try:
            raw = json.loads(metadata["lora_adapter_metadata"])
        except json.JSONDecodeError:
            return None
        conf = {k[len("unet."):]: v for k, v in raw.items() if k.startswith("unet.")} or \
            {k: v for k, v in raw.items() if "." not in k}
    if not conf or "lora_alpha" not in conf:
        return None
    alpha = float(conf["lora_alpha"])
    alpha_pattern = conf.get("alpha_pattern") or {}
    rs = bool(conf.get("use_rslora"))

    def scale(name: str, rank: int) -> float:
        a = alpha
        for pattern, value in alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", name):
                a = float(value)
        return a / (math.sqrt(rank) if rs else rank)
    return scale


# -------------------------------------------------------------------------------------------------- parsing

_KIND_ROLES = {
    "lora": {"up", "down", "mid"},
    "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"},
    "lokr": {"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"},
    "diff": {"diff", "diff_b"},
    "norm": {"w_norm", "b_norm"},
}
_COMMON_ROLES = {"alpha", "dora_scale", "magnitude"}


def _kind_of(roles: set, src: str, name: str) -> str:
    kinds = [k for k, r in _KIND_ROLES.items() if roles & r]
    if len(kinds) != 1:
        found = ", ".join(sorted(roles))
        if not kinds:
            raise LoraError(f"{src}: module {name!r} has only {found}: no weights to merge")
        raise LoraError(f"{src}: module {name!r} mixes formats ({found})")
    kind = kinds[0]
    need = {"lora": [("up",), ("down",)],
            "loha": [("hada_w1_a",), ("hada_w1_b",), ("hada_w2_a",), ("hada_w2_b",)],
            "lokr": [("lokr_w1", "lokr_w1_a"), ("lokr_w2", "lokr_w2_a")]}.get(kind, [])
    for options in need:
        if not roles & set(options):
            raise LoraError(f"{src}: module {name!r} is incomplete: {kind} needs {' or '.join(options)}, "
                            f"found {', '.join(sorted(roles))}")
    pairs = {"lokr_w1_a": "lokr_w1_b", "lokr_w2_a": "lokr_w2_b", "hada_t1": "hada_t2"}
    for a, b in pairs.items():
        if (a in roles) != (b in roles):
            raise LoraError(f"{src}: module {name!r} is incomplete: {a} and {b} come together")
    return kind


def parse_lora(src, index: ModuleIndex, report: MergeReport | None = None, strength: float = 1.0,
               keys: set | None = None) -> list[LoraModule]:
    """Parse one LoRA (path, folder or state dict) into modules targeting canonical paths of ``index``.

    Text-encoder and unknown keys are recorded in ``report``. Raises :class:`LoraError` for malformed content
    (incomplete modules, non-finite values, non-float tensors).
    """
    report = report if report is not None else MergeReport()
    tensors, metadata, name, peft_cfg = _open_source(src)
    groups: dict[tuple, dict] = {}
    te, unknown, ignored = [], [], []
    try:
        all_keys = list(tensors.keys())
    except Exception as err:  # noqa: BLE001 - a broken mapping
        raise LoraError(f"{name}: cannot list tensors ({err})") from None
    for key in all_keys:
        if key.startswith(TE_PREFIXES):
            te.append(key)
            continue
        if key.startswith(tuple(IGNORED_PREFIXES)):
            ignored.append(key)
            continue
        if key.startswith(KOHYA_UNET):
            head, dot, rest = key.partition(".")
            split = _split_suffix("x." + rest) if dot else None
            if split is None:
                unknown.append(key)
                continue
            groups.setdefault(("kohya", head[len(KOHYA_UNET):]), {})[split[1]] = key
            continue
        split = _split_suffix(key)
        if split is None:
            unknown.append(key)
            continue
        module, role = split
        for prefix in DOTTED_PREFIXES:
            if module.startswith(prefix):
                module = module[len(prefix):]
                break
        groups.setdefault(("dotted", module), {})[role] = key

    scale_fn = _peft_scale(metadata, peft_cfg)
    modules, formats = [], set()
    missing: dict[str, list] = {}            # module name → its keys, for UNet modules this model lacks
    n_matched = 0
    for (style, mname), roles in groups.items():
        shown = (KOHYA_UNET + mname) if style == "kohya" else mname
        if not set(roles) - _COMMON_ROLES:
            unknown.extend(roles.values())       # e.g. an alpha without weights
            continue
        target = index.resolve_kohya(mname) if style == "kohya" else index.resolve_dotted(mname)
        if target is None:
            missing[shown] = sorted(roles.values())
            continue
        kind = _kind_of(set(roles) - _COMMON_ROLES, name, shown)
        n_matched += 1
        if keys is not None and f"{target}.weight" not in keys and f"{target}.bias" not in keys:
            continue
        values = {}
        for role, key in roles.items():
            try:
                t = tensors[key]
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise LoraError(f"{name}: cannot read tensor {key!r} ({err})") from None
            if not torch.is_tensor(t) or not torch.is_floating_point(t):
                raise LoraError(f"{name}: tensor {key!r} has dtype {getattr(t, 'dtype', type(t))}, expected floats")
            if not all_finite(t):
                raise LoraError(f"{name}: tensor {key!r} contains NaN or Inf")
            values[role] = t
        if "alpha" in values and values["alpha"].numel() != 1:
            raise LoraError(f"{name}: {roles['alpha']!r} must be a scalar, got shape {tuple(values['alpha'].shape)}")
        override = None
        if kind == "lora" and "alpha" not in values and scale_fn is not None:
            override = scale_fn(mname, values["down"].shape[0])
        mod = LoraModule(name, shown, target, kind, values, sorted(roles.values()), override)
        formats.add(_format_name(mod))
        modules.append(mod)

    n_unet = n_matched + len(missing)
    if missing and (not n_matched or len(missing) > n_unet / 2):
        raise LoraError(f"{name}: {len(missing)} of its {n_unet} UNet modules do not exist in this model, e.g. "
                        f"{sorted(missing)[:3]}: the LoRA was made for another model family{_family_hint(metadata)}")
    missing_keys = [k for ks in missing.values() for k in ks]
    if missing:
        report.warnings.append(f"{name}: {len(missing)} modules name UNet layers this model does not have and are "
                               f"not merged: {sorted(missing)[:5]}")
    if not n_matched and not missing and not te and not ignored:
        raise LoraError(f"{name}: no LoRA/LyCORIS keys recognised"
                        + (f", e.g. {unknown[:3]}" if unknown else " (the file is empty)"))
    if not n_matched and te and not missing:
        report.warnings.append(f"{name}: only text-encoder weights; nothing merged into the UNet")
    if unknown:
        report.warnings.append(f"{name}: {len(unknown)} keys not understood and not merged: {unknown[:5]}")
    report.ignored_text_encoder.extend(f"{name}:{k}" for k in te)
    report.ignored.extend(f"{name}:{k} ({IGNORED_PREFIXES[p]})" for k in ignored for p in IGNORED_PREFIXES
                          if k.startswith(p))
    report.unknown.extend(f"{name}:{k}" for k in unknown + missing_keys)
    report.loras.append({"source": name, "strength": float(strength), "formats": sorted(formats),
                         "modules": len(modules), "ignored_text_encoder": len(te),
                         "unknown": len(unknown) + len(missing_keys),
                         "metadata_hint": _family_hint(metadata).strip(" ()")})
    return modules


def _format_name(mod: LoraModule) -> str:
    if mod.kind == "lora":
        t = mod.tensors
        base = "locon" if t["down"].ndim == 4 and t["down"].shape[2:] != (1, 1) or "mid" in t else "lora"
        return base + ("+dora" if mod.dora is not None else "")
    return mod.kind + ("+dora" if mod.dora is not None else "")


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


def apply_deltas(base: torch.Tensor, entries: Iterable, dtype: torch.dtype | None = None,
                 out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``base`` + each entry's delta, for entries (module, strength, part) of one tensor, computed in ``dtype``
    (default: the compute dtype) and returned in ``out_dtype`` (default: ``out``'s dtype, else ``dtype``).

    ``base`` is not modified unless it is ``out``: a tensor of its shape that receives the result (in place, with
    no new allocation of the weight's size, when every entry is a plain LoRA). Plain LoRA/LoCon entries with an
    ``out_dtype`` other than the compute dtype go a slab of rows at a time, so the compute-dtype copy of the weight
    never exists whole (a cast slab stays in cache)."""
    dt = dtype or compute_dtype(base.dtype)
    out_dtype = out.dtype if out is not None else out_dtype or dt
    entries = list(entries)
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


def parse_lora_arg(text: str) -> tuple[str, float]:
    """``PATH[:STRENGTH]`` → (path, strength); a suffix that is not a number belongs to the path."""
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return text, 1.0
