"""Adapter sets: the public ``sdslim-adapters`` file format, validation, ranks and data-free initialisation.

Tensors per FF site ``<site>.down_value`` [r,m], ``<site>.down_gate`` [r,m], ``<site>.up`` [m,r] and, from format
version 2, an optional ``<site>.up_bias`` [m] (the least-squares intercept, folded into the ``net.2`` bias); per Res
site ``<site>.down`` [r,c], ``<site>.norm.weight`` [r], ``<site>.norm.bias`` [r], ``<site>.up`` [c,r].
Metadata: ``sdslim.format``=``sdslim-adapters``, ``sdslim.version`` (``1``, or ``2`` when a file holds ``up_bias``),
``sdslim.family``, ``sdslim.norm_groups`` (JSON site→groups where not 32), free JSON (``sdslim.train``,
``sdslim.base``).

Storage: a delivered file holds its tensors in :data:`DEFAULT_FILE_DTYPE` (fp16) unless asked for another of
:data:`FILE_DTYPES`; any float dtype reads (files written before were float32), and every consumer computes in
float32 from what it reads (``ops/fold.py``'s maps, ``modules/swap.SiteAdapter``). Training state keeps float32.

Ranks and GroupNorm groups of Res bottlenecks follow :mod:`sdslim_core.layout.rank_policy`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import torch

from .. import layout
from ..layout import rank_policy
from .tensors import FileFormatError, all_finite, load_file, read_header, save_file_atomic

FORMAT = "sdslim-adapters"
VERSION = 2                           # written only when a file needs it (``up_bias``); version 1 otherwise
READ_VERSIONS = ("1", "2")
FF_TENSORS = ("down_value", "down_gate", "up")
FF_OPTIONAL = ("up_bias",)
RES_TENSORS = ("down", "norm.weight", "norm.bias", "up")
FILE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}   # a delivered file's choices
DEFAULT_FILE_DTYPE = "fp16"           # half the bytes of float32, the same slim model to 7 digits (bench/RESULTS.md)


class AdapterError(FileFormatError):
    """An adapter file or set is invalid; the message names the file and key."""


class AdapterSet:
    """Adapters for a set of sites of one UNet family."""

    def __init__(self, family: str, sites: dict[str, dict[str, torch.Tensor]], norm_groups: dict | None = None,
                 metadata: dict | None = None, source: str = "<memory>"):
        self.family = family
        self.sites = sites
        self.norm_groups = {s: int(g) for s, g in (norm_groups or {}).items()}
        self.metadata = dict(metadata or {})
        self.source = source
        self.validate()

    # ------------------------------------------------------------------ queries
    def kind(self, site: str) -> str:
        return "ff" if "down_value" in self.sites[site] else "res"

    def rank(self, site: str) -> int:
        t = self.sites[site]
        return (t["down_value"] if "down_value" in t else t["down"]).shape[0]

    def groups(self, site: str) -> int:
        return self.norm_groups.get(site, rank_policy.DEFAULT_GROUPS)

    def ranks(self) -> dict[str, int]:
        return {s: self.rank(s) for s in self.sites}

    def widths(self) -> dict[str, int]:
        """Site → full width (FF inner width m, ResBlock inner channels c); ``fold.slim_shapes(slim, widths)``
        gives back the full-size shapes of a slim model."""
        return {s: t["up"].shape[0] for s, t in self.sites.items()}

    def site_errors(self) -> dict[str, float]:
        """Per-site relative error recorded by the trainer (``sdslim.train``.site_error), if any."""
        return {k: float(v) for k, v in self.metadata.get("sdslim.train", {}).get("site_error", {}).items()}

    def select(self, strength: float) -> "AdapterSet":
        """The fraction ``strength`` of sites, lowest recorded error first (file order without errors)."""
        if not 0 <= strength <= 1:
            raise ValueError(f"strength must be in [0, 1], got {strength}")
        errors = self.site_errors()
        order = sorted(self.sites, key=lambda s: (errors.get(s, math.inf), list(self.sites).index(s)))
        keep = set(order[:int(round(strength * len(order)))])
        return AdapterSet(self.family, {s: t for s, t in self.sites.items() if s in keep},
                          {s: g for s, g in self.norm_groups.items() if s in keep}, self.metadata, self.source)

    # --------------------------------------------------------------- validation
    def _fail(self, key: str, what: str):
        raise AdapterError(f"{self.source}: {key}: {what}")

    def validate(self):
        if self.family not in layout.FAMILIES:
            self._fail("sdslim.family", f"unknown family {self.family!r}, expected one of {layout.FAMILIES}")
        for site, t in self.sites.items():
            try:
                kind = layout.site_kind(site)
            except layout.LayoutError as err:
                self._fail(site, str(err))
            names = FF_TENSORS if kind == "ff" else RES_TENSORS
            optional = FF_OPTIONAL if kind == "ff" else ()
            if not set(names) <= set(t) <= set(names) | set(optional):
                self._fail(site, f"{kind} site needs tensors {names}" + (f" (optional {optional})" if optional else "")
                           + f", found {sorted(t)}")
            for name, v in t.items():
                if not torch.is_floating_point(v):
                    self._fail(f"{site}.{name}", f"dtype {v.dtype} is not floating point")
            self.check_values(site, t)
            if kind == "ff":
                r, m = t["down_value"].shape if t["down_value"].ndim == 2 else (-1, -1)
                expect = {"down_value": (r, m), "down_gate": (r, m), "up": (m, r)}
                if "up_bias" in t:
                    expect["up_bias"] = (m,)
            else:
                r, m = t["down"].shape if t["down"].ndim == 2 else (-1, -1)
                expect = {"down": (r, m), "norm.weight": (r,), "norm.bias": (r,), "up": (m, r)}
            if r < 1:
                self._fail(f"{site}.{names[0]}", f"expected a 2-D [rank, width] matrix, got {tuple(t[names[0]].shape)}")
            for name, shp in expect.items():
                if tuple(t[name].shape) != shp:
                    self._fail(f"{site}.{name}", f"shape {tuple(t[name].shape)}, expected {shp} (rank {r}, width {m})")
            if r > m:
                self._fail(f"{site}.{names[0]}", f"rank {r} exceeds the width {m}")
            if kind == "res" and r % self.groups(site):
                self._fail(f"sdslim.norm_groups[{site}]", f"{self.groups(site)} GroupNorm groups do not divide rank {r}")
        unknown = set(self.norm_groups) - set(self.sites)
        if unknown:
            self._fail("sdslim.norm_groups", f"names sites without adapters: {sorted(unknown)[:3]}")

    def check_values(self, site: str, tensors: Mapping[str, torch.Tensor]):
        """Raise AdapterError if a tensor of ``site`` holds NaN or Inf (tensors without values are skipped)."""
        for name, v in tensors.items():
            if _has_values(v) and not all_finite(v):
                self._fail(f"{site}.{name}", "contains NaN or Inf")

    def check_model(self, weights_or_shapes: Mapping, family: str | None = None):
        """Raise AdapterError unless every site exists in the model with the adapter's widths."""
        if family and family != self.family:
            self._fail("sdslim.family", f"adapters are for {self.family}, the model is {family}")
        model_sites = {s.name: s for s in layout.sites(weights_or_shapes)}
        for site in self.sites:
            if site not in model_sites:
                self._fail(site, "no such site in this model (adapters made for another architecture?)")
            t = self.sites[site]
            width = (t["down_value"] if "down_value" in t else t["down"]).shape[1]
            if width != model_sites[site].width:
                self._fail(site, f"adapter width {width} does not match the model's {model_sites[site].width}")

    # --------------------------------------------------------------------- file
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{s}.{n}": v for s, t in self.sites.items() for n, v in t.items()}

    def stored_as(self, dtype: torch.dtype) -> "AdapterSet":
        """A copy holding the tensors as a file written with ``dtype`` holds them (on the CPU); AdapterError
        naming the tensor when a value does not fit ``dtype``'s range."""
        return AdapterSet(self.family, {s: narrowed(t, dtype, self.source, f"{s}.") for s, t in self.sites.items()},
                          self.norm_groups, self.metadata, self.source)

    def save(self, path, dtype: torch.dtype | None = None) -> Path:
        """Write the adapter file; ``dtype``: the tensors' storage dtype (None: as held, e.g. training state)."""
        meta = dict(self.metadata)
        version = VERSION if any("up_bias" in t for t in self.sites.values()) else 1
        meta.update({"sdslim.format": FORMAT, "sdslim.version": str(version), "sdslim.family": self.family})
        groups = {s: g for s, g in self.norm_groups.items() if g != rank_policy.DEFAULT_GROUPS}
        if groups:
            meta["sdslim.norm_groups"] = groups
        tensors = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        return save_file_atomic(tensors if dtype is None else narrowed(tensors, dtype, str(path)), path, meta)

    @classmethod
    def load(cls, path, lazy: bool = False) -> "AdapterSet":
        """Read and validate an adapter file. ``lazy``: from the header alone, tensors on ``meta`` (shapes, groups
        and metadata validated; read the values per site and pass them to :meth:`check_values`)."""
        if lazy:
            entries, meta = read_header(path)
            tensors = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in entries.items()}
        else:
            tensors, meta = load_file(path)
        src = str(path)

        def need(key):
            if key not in meta:
                raise AdapterError(f"{src}: missing metadata {key!r}: not an sdslim adapter file")
            return meta[key]
        if need("sdslim.format") != FORMAT:
            raise AdapterError(f"{src}: sdslim.format is {meta['sdslim.format']!r}, expected {FORMAT!r}")
        version = need("sdslim.version")
        if version not in READ_VERSIONS:
            raise AdapterError(f"{src}: sdslim.version {version!r} is not supported by this sdslim (reads "
                               f"versions {', '.join(READ_VERSIONS)}); update sdslim")
        extra = {}
        for key, value in meta.items():
            if key in ("sdslim.format", "sdslim.version", "sdslim.family", "sdslim.norm_groups"):
                continue
            try:
                extra[key] = json.loads(value)
            except json.JSONDecodeError:
                extra[key] = value
        try:
            groups = json.loads(meta.get("sdslim.norm_groups", "{}"))
        except json.JSONDecodeError:
            raise AdapterError(f"{src}: sdslim.norm_groups is not JSON") from None
        return cls.from_state_dict(need("sdslim.family"), tensors, groups, extra, source=src)

    @classmethod
    def from_state_dict(cls, family: str, tensors: Mapping[str, torch.Tensor], norm_groups: dict | None = None,
                        metadata: dict | None = None, source: str = "<memory>") -> "AdapterSet":
        """The validated inverse of :meth:`state_dict` (``<site>.<tensor>`` keys)."""
        sites: dict[str, dict] = {}
        for key, v in tensors.items():
            site, name = _split_tensor_key(key, source)
            sites.setdefault(site, {})[name] = v
        return cls(family, sites, norm_groups, metadata, source)

    # ------------------------------------------------------------- construction
    @classmethod
    def shaped_like(cls, shapes: Mapping[str, tuple], family: str, ratio: float,
                    ranks: Mapping[str, int] | None = None) -> "AdapterSet":
        """Adapters of the right shapes for every site of a UNet (its canonical key → shape map) at ``ratio`` (or
        for the sites and ``ranks`` given), keeping the first r units of each site with a unit bottleneck norm: no
        weights or data needed. For memory, speed and shape work only."""
        site_list = layout.sites(shapes)
        sites, groups = {}, {}
        for site, r in (ranks if ranks is not None else rank_policy.ranks_for_ratio(site_list, ratio)).items():
            kind = next(s for s in site_list if s.name == site)
            sel = torch.eye(kind.width)[:r]
            if kind.kind == "ff":
                sites[site] = {"down_value": sel, "down_gate": sel.clone(), "up": sel.t().contiguous()}
            else:
                sites[site] = {"down": sel, "norm.weight": torch.ones(r), "norm.bias": torch.zeros(r),
                               "up": sel.t().contiguous()}
                if rank_policy.res_groups(kind.width, r) != rank_policy.DEFAULT_GROUPS:
                    groups[site] = rank_policy.res_groups(kind.width, r)
        return cls(family, sites, groups)

    @classmethod
    def init_select(cls, weights: Mapping[str, torch.Tensor], ranks: Mapping[str, int], family: str,
                    metadata: dict | None = None) -> "AdapterSet":
        """Data-free initialisation: keep the ``r`` hidden units/channels with the largest weight norms.

        With full ranks this is the exact identity (the folded model equals the original). The trainer's
        activation-aware initialisation replaces it where it does better.
        """
        by_name = {s.name: s for s in layout.sites(weights)}
        ff, res = layout.FF_LAYERS, layout.RES_LAYERS["ldm"]
        sites, groups = {}, {}
        dt = torch.promote_types(next(iter(weights.values())).dtype, torch.float32)
        for site, r in ranks.items():
            s = by_name[site]
            if s.kind == "ff":
                wp = weights[f"{site}.{ff['proj']}.weight"].to(dt)
                wo = weights[f"{site}.{ff['out']}.weight"].to(dt)
                score = wo.norm(dim=0) * (wp[:s.width].norm(dim=1) + wp[s.width:].norm(dim=1))
                sel = _selection(score, r).to(dt)
                sites[site] = {"down_value": sel.clone(), "down_gate": sel.clone(), "up": sel.t().contiguous()}
            else:
                w1 = weights[f"{site}.{res['conv1']}.weight"].to(dt)
                w2 = weights[f"{site}.{res['conv2']}.weight"].to(dt)
                score = w1.flatten(1).norm(dim=1) * w2.transpose(0, 1).flatten(1).norm(dim=1)
                sel = _selection(score, r).to(dt)
                idx = sel.argmax(dim=1)
                g = rank_policy.res_groups(s.width, r)
                sites[site] = {"down": sel, "norm.weight": weights[f"{site}.{res['norm2']}.weight"].to(dt)[idx],
                               "norm.bias": weights[f"{site}.{res['norm2']}.bias"].to(dt)[idx],
                               "up": sel.t().contiguous()}
                if g != rank_policy.DEFAULT_GROUPS:
                    groups[site] = g
        return cls(family, sites, groups, metadata)


def file_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :data:`FILE_DTYPES` name (``fp16``, ``bf16``, ``fp32``); ValueError naming the choices."""
    try:
        return FILE_DTYPES[name]
    except KeyError:
        raise ValueError(f"adapter file dtype must be one of {', '.join(FILE_DTYPES)}, got {name!r}") from None


def narrowed(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, source: str,
             prefix: str = "") -> dict[str, torch.Tensor]:
    """``tensors`` cast to ``dtype`` on the CPU; AdapterError naming ``source`` and the key (``prefix + key``) when a
    finite value overflows ``dtype`` (fp16 stops at 65504)."""
    out = {}
    for key, v in tensors.items():
        cast = v.detach().to("cpu", dtype)
        if _has_values(v) and not all_finite(cast) and all_finite(v):
            wider = [n for n, d in FILE_DTYPES.items() if torch.finfo(d).max > torch.finfo(dtype).max]
            raise AdapterError(f"{source}: {prefix}{key}: values up to {float(v.abs().max()):.4g} do not fit "
                               f"{str(dtype).replace('torch.', '')}; write the file as {' or '.join(wider)}")
        out[key] = cast
    return out


def _has_values(t: torch.Tensor) -> bool:
    """False for meta and fake tensors (shape-only runs such as the VRAM estimator)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def _selection(score: torch.Tensor, r: int) -> torch.Tensor:
    """An r×n 0/1 matrix selecting the r highest scores, kept in their original order."""
    idx = torch.sort(torch.topk(score, r).indices).values
    sel = torch.zeros(r, score.numel(), device=score.device)
    sel[torch.arange(r, device=score.device), idx] = 1.0
    return sel


def _split_tensor_key(key: str, src: str) -> tuple[str, str]:
    for name in ("norm.weight", "norm.bias", "down_value", "down_gate", "down", "up_bias", "up"):
        if key.endswith("." + name):
            return key[:-len(name) - 1], name
    raise AdapterError(f"{src}: unknown tensor {key!r} (expected <site>.down_value/down_gate/up[/up_bias] or "
                       "<site>.down/norm.weight/norm.bias/up)")


def is_adapter_file(path) -> bool:
    """True when ``path``'s safetensors header says it is an sdslim adapter file (no tensor is read)."""
    try:
        return read_header(path)[1].get("sdslim.format") == FORMAT
    except (OSError, ValueError):
        return False
