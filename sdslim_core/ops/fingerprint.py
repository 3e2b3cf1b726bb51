"""How far a checkpoint's weights are from the base model an adapter file was trained on, without the base.

An adapter file keeps a sketch of every tensor its sites' folds read (``sdslim.base``.sketches): for a tensor W,
flattened to a matrix (its first dimension by the rest), ``S·W·G`` with fixed Gaussian matrices G (rest × PROBES)
and S (SKETCH × rows, scaled by 1/√SKETCH), drawn from a seed made of the tensor's key and shape, so any later
reader draws the same ones. For another model's tensor W', ``‖S(W' − W)G‖ / ‖S·W·G‖`` estimates the relative
distance ‖W' − W‖_F / ‖W‖_F (the squares are unbiased; the spread of the estimate is about 1/√(SKETCH·PROBES/2),
≈ 9 %, for changes spread over many directions, as fine-tunes are). A site's distance pools its tensors (squares
summed), the overall distance pools every site. The same model gives exactly 0. 256 numbers per tensor: about
0.2 MB of metadata for SD1.5, whatever the model's size; computing them is two thin matrix products per tensor.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import math
from typing import Callable, Iterable, Mapping

import numpy as np
import torch

from .fold import site_keys

VERSION = 1
SKETCH, PROBES = 32, 8
# overall distance past which `sdslim slim` and the hosts warn: on every derivative measured nearer than this, adapters
# trained on it kept no more than the base's (within 1 dB image PSNR); the nearest one where they kept over 2 dB more
# was 7.9 % away (bench/RESULTS.md, Derivatives)
WARN_DISTANCE = 0.07
WARN_TEXT = f"{WARN_DISTANCE:.0%}"          # the threshold as every host writes it


def percent(value: float) -> str:
    """A distance as every host writes it: a percentage with one decimal, or as many more as keep it visibly apart
    from :data:`WARN_TEXT` (``7.2%``, ``7.04%``: never a "7%" that reads as the threshold)."""
    for digits in range(1, 7):
        if round(100 * value, digits) != round(100 * WARN_DISTANCE, digits):
            break
    return f"{100 * value:.{digits}f}%"


def _generator(key: str, shape: tuple) -> torch.Generator:
    seed = int(hashlib.sha256(f"sdslim-sketch-{VERSION}:{key}:{tuple(shape)}".encode()).hexdigest()[:15], 16)
    return torch.Generator().manual_seed(seed)


def sketch(key: str, t: torch.Tensor) -> torch.Tensor:
    """The SKETCH × PROBES float64 sketch of the tensor ``t`` stored under canonical ``key`` (on the CPU)."""
    m = t.detach().reshape(t.shape[0], -1) if t.ndim > 1 else t.detach().reshape(-1, 1)
    dt = torch.float64 if m.dtype == torch.float64 else torch.float32
    gen = _generator(key, tuple(t.shape))
    g = torch.randn(m.shape[1], PROBES, generator=gen, dtype=torch.float32)
    s = torch.randn(SKETCH, m.shape[0], generator=gen, dtype=torch.float32) / math.sqrt(SKETCH)
    wg = (m.to(dt) @ g.to(m.device, dt)).to("cpu", torch.float64)
    return s.to(torch.float64) @ wg


def encode(s: torch.Tensor) -> str:
    return base64.b64encode(s.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")


def decode(text: str) -> torch.Tensor:
    a = np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float64)
    return torch.from_numpy(a.copy()).reshape(SKETCH, PROBES)


def sketches(sites: Iterable[tuple[str, str]], get: Callable[[str], torch.Tensor | None]) -> dict:
    """The ``sdslim.base``.sketches entry for ``sites`` [(site, kind)] of a model whose canonical tensors
    ``get(key)`` returns (None when absent)."""
    out = {}
    for site, kind in sites:
        for key in site_keys(site, kind):
            t = get(key)
            if t is not None:
                out[key] = encode(sketch(key, t))
    return {"version": VERSION, "shape": [SKETCH, PROBES], "tensors": out}


def exact_distance(base: Mapping, other: Mapping, keys: Iterable[str] | None = None) -> float:
    """The quantity a fingerprint estimates, computed exactly from both models: ‖other − base‖_F / ‖base‖_F pooled
    over ``keys`` (default: every key of ``base``), in float64."""
    keys = list(base) if keys is None else list(keys)
    num = sum(float((other[k].double() - base[k].double()).square().sum()) for k in keys)
    den = sum(float(base[k].double().square().sum()) for k in keys)
    return math.sqrt(num / den) if den else 0.0


class FingerprintError(ValueError):
    """A base fingerprint that this sdslim cannot read (the message says why)."""


@dataclasses.dataclass
class Distance:
    """Relative distance of a model's folded weights from the adapters' base: ``sites`` site → estimate,
    ``overall`` pooled over every site; ``compared`` tensors that had a sketch (``missing``: sites without)."""
    sites: dict
    overall: float
    compared: int
    missing: list

    @property
    def far(self) -> bool:
        """Past :data:`WARN_DISTANCE`, where the hosts warn."""
        return self.overall > WARN_DISTANCE

    def worst(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.sites.items(), key=lambda kv: -kv[1])[:n]

    def to_dict(self) -> dict:
        return {"overall": self.overall, "sites": self.sites, "compared": self.compared, "missing": self.missing}


class DistanceMeter:
    """Accumulates, site by site, how far the tensors a fold reads are from a base fingerprint (``sdslim.base``
    metadata of an adapter file). ``add(site, key, tensor)`` as the fold reads them, then :meth:`result`."""

    def __init__(self, base: Mapping):
        sk = base.get("sketches") if isinstance(base, Mapping) else None
        if not isinstance(sk, Mapping):
            raise FingerprintError("the adapter file has no base fingerprint (sdslim.base.sketches)")
        if sk.get("version") != VERSION or list(sk.get("shape") or []) != [SKETCH, PROBES]:
            raise FingerprintError(f"base fingerprint version {sk.get('version')!r} / shape {sk.get('shape')!r}: "
                                   f"this sdslim reads version {VERSION} ({SKETCH}x{PROBES}); update sdslim")
        self._base = sk["tensors"]
        self._num: dict[str, float] = {}
        self._den: dict[str, float] = {}
        self._missing: set[str] = set()
        self._seen: set[str] = set()

    def add(self, site: str, key: str, t: torch.Tensor | None) -> None:
        if t is None or key in self._seen:
            return
        self._seen.add(key)
        ref = self._base.get(key)
        if ref is None:
            self._missing.add(site)
            return
        b = decode(ref)
        mine = sketch(key, t).to(torch.float32).to(torch.float64)      # rounded as the stored sketch was
        self._num[site] = self._num.get(site, 0.0) + float(((mine - b) ** 2).sum())
        self._den[site] = self._den.get(site, 0.0) + float((b ** 2).sum())

    def result(self) -> Distance:
        sites = {s: math.sqrt(self._num[s] / self._den[s]) if self._den[s] else 0.0 for s in self._num}
        den = sum(self._den.values())
        overall = math.sqrt(sum(self._num.values()) / den) if den else 0.0
        return Distance(sites, overall, len(self._seen) - len(self._missing), sorted(self._missing - set(sites)))
