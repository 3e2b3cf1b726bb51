"""The ladder of training recipes (``sdslim train --recipe``) and the refit of a derivative (``--from``).

- ``data-free``: weights only, no calibration, seconds at any ratio: every site at the uniform ranks of
  ``--ratio`` (or the per-kind values), initialised by :meth:`AdapterSet.init_select` (largest weight norms). The
  cheapest file and the least faithful one (bench/RESULTS.md, "Recipes").
- ``quick``: the training-free recipe: a light calibration (:data:`LIGHT_CALIBRATION`), the default (anchored)
  rank allocation with one whole-UNet anchor per site instead of two (at the site's target rank: half the
  allocation's UNet forwards, its largest cost at real size) and the activation-aware initialisation measured
  among :data:`QUICK_INIT` (not PCA or the weight SVD: eigendecompositions of the widest sites); no stage 1 or 2.
- ``full``: everything (:class:`TrainConfig`'s defaults).
- ``--from BASE_ADAPTERS`` (:data:`REFIT`): the base file's sites and ranks (no allocation), each site started
  from the base adapter or re-initialised from the derivative's activations where that measures better, then a
  short stage 2.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping

from .. import layout
from ..io.adapters import AdapterSet, file_dtype
from ..io.files import refuse_existing
from ..ops import fingerprint
from .config import TrainConfig
from .ranks import ratio_ranks, slim_param_count
from .teacher import teacher_weights

RECIPES = ("data-free", "quick", "full")
DEFAULT_RECIPE = "full"
CHOICES = RECIPES[::-1]          # as hosts offer them: the most faithful (the default) first
LIGHT_CALIBRATION = {"n_trajectories": 8}
QUICK_INIT = ("obs", "act_select", "select")     # the methods that win (bench/RESULTS.md), not the PCA/SVD ones
SETTINGS = {"data-free": {}, "quick": dict(LIGHT_CALIBRATION, alloc_anchors=1, init_methods=QUICK_INIT,
                                           stage1_steps=0, stage2_steps=0),
            "full": {}}
REFIT = dict(LIGHT_CALIBRATION, stage1_steps=0, stage2_steps=200)


def settings(recipe: str, start_from: bool = False) -> dict:
    """The :class:`TrainConfig` fields ``recipe`` sets (``start_from``: those of a ``--from`` refit)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    if start_from:
        if recipe == "data-free":
            raise ValueError("--from refits trained adapters on the derivative's data: it has no data-free recipe")
        return dict(REFIT)
    return dict(SETTINGS[recipe])


def host_overrides(recipe: str, steps: int = 0, start_from=None) -> dict:
    """``train_adapters`` keyword overrides for a host's Train form: ``recipe``'s settings (``start_from``: the
    refit's, from that adapter file); ``steps`` (0: the recipe's own) sets both stages of ``full`` and the stage 2 of
    a refit (``quick`` trains no stage)."""
    out = settings(recipe, bool(start_from))
    if start_from:
        out["start_from"] = str(start_from)
        if steps:
            out["stage2_steps"] = int(steps)
    elif steps and recipe == "full":
        out["steps"] = int(steps)
    return out


def data_free_text(aset: AdapterSet, out, seconds: float) -> str:
    """What the data-free recipe tells the user: what was made, and what it costs in fidelity."""
    return (f"data-free adapters for {len(aset.sites)} sites (uniform ranks, largest weight norms) in {seconds:.1f} s"
            f" → {out}\n  no calibration and no training: expect the lowest fidelity of the three recipes "
            "(bench/RESULTS.md, Recipes); the quick recipe measures the model first")


def base_metadata(weights: Mapping, cfg: layout.UNetConfig, aset: AdapterSet, teacher_fp: str) -> dict:
    """The ``sdslim.base`` entry of an adapter file made for the model ``weights`` (canonical): family, a short
    hash, the parameter count and the sketches of every tensor the sites' folds read (``ops/fingerprint.py``)."""
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    return {"family": cfg.family, "fingerprint": teacher_fp, "params": slim_param_count(shapes, {}),
            "sketches": fingerprint.sketches(((s, aset.kind(s)) for s in aset.sites), weights.get)}


def data_free(unet, cfg: layout.UNetConfig | None = None, train_cfg: TrainConfig | None = None,
              out_path=None, overwrite: bool = True) -> tuple[AdapterSet, float]:
    """The ``data-free`` recipe: adapters at the uniform ranks of ``train_cfg``'s ratio (or per-kind values) from
    the weights alone, as stored in ``train_cfg.adapter_dtype`` and written to ``out_path`` (with the base
    fingerprint) when given, and the seconds it took; ``unet`` as for :func:`~sdslim_core.train.train_adapters`; an
    existing ``out_path`` is refused unless ``overwrite``."""
    t0 = time.perf_counter()
    weights, cfg = teacher_weights(unet, cfg)
    tc = train_cfg or TrainConfig()
    aset = data_free_set(weights, cfg, tc).stored_as(file_dtype(tc.adapter_dtype))
    if out_path is not None:
        refuse_existing(out_path, overwrite)
        aset.save(out_path)
    return aset, time.perf_counter() - t0


def data_free_set(weights: Mapping, cfg: layout.UNetConfig, tc: TrainConfig) -> AdapterSet:
    """:func:`data_free` on canonical ``weights``, nothing written."""
    from .session import teacher_fingerprint
    if tc.budget is not None or tc.start_from is not None:
        raise ValueError("the data-free recipe measures nothing, so it cannot allocate a --budget or refit --from: "
                         "give --ratio (every site at that width) or use --recipe quick")
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    ranks = ratio_ranks(layout.sites(shapes), tc)
    if not ranks:
        raise ValueError("no site would be slimmed with these settings (every rank is the full width)")
    aset = AdapterSet.init_select(weights, ranks, cfg.family)
    aset.metadata = {
        "sdslim.train": {"recipe": "data-free", "init_method": "select",
                         "ranks": {"ratio": tc.ratio, "ff_ratio": tc.ff_ratio, "ff_rank": tc.ff_rank,
                                   "res_ratio": tc.res_ratio, "uniform": True}},
        "sdslim.base": base_metadata(weights, cfg, aset, teacher_fingerprint(weights))}
    return aset


@dataclasses.dataclass
class Ladder:
    """Recipes priced side by side from one warm-up: ``plans`` name → :class:`~.plan.Plan`; ``data_free``: the
    data-free recipe's measured seconds and RAM (None when it is not offered, e.g. with ``--from``)."""
    plans: dict
    data_free: dict | None = None

    def to_dict(self) -> dict:
        return {"recipes": {n: p.to_dict() for n, p in self.plans.items()}, "data-free": self.data_free}

    def text(self) -> str:
        from ..io.files import format_bytes
        from .memory import gib
        from .plan import duration
        names = (["data-free"] if self.data_free else []) + list(self.plans)
        phases = list(dict.fromkeys(p.name for plan in self.plans.values() for p in plan.phases))
        rows = []
        for ph in phases:
            cells = ["–"] if self.data_free else []
            for plan in self.plans.values():
                got = [p for p in plan.phases if p.name == ph and (p.units or p.seconds)]
                cells.append(f"{got[0].units:,} {got[0].unit} ~{duration(got[0].seconds)}" if got else "–")
            rows.append((ph, cells))
        df = self.data_free or {}
        head = [f"~{duration(df['seconds'])}"] if df else []
        rows.append(("time", head + [f"~{duration(p.eta_s)}" for p in self.plans.values()]))
        rows.append(("RAM", ([f"~{gib(df['ram_bytes'])}" if df.get("ram_bytes") else "?"] if df else [])
                     + [f"~{gib(p.ram_bytes)}" if p.ram_bytes else "(VRAM: see the estimate)"
                        for p in self.plans.values()]))
        rows.append(("work folder", (["none"] if df else []) + [f"~{format_bytes(p.work_bytes)}"
                                                                for p in self.plans.values()]))
        width = max(14, *(len(c) for _, cells in rows for c in cells)) + 2
        lines = ["plan by recipe (from one warm-up on this device; stage counts assume every site slimmed):",
                 "  " + f"{'':<12}" + "".join(f"{n:<{width}}" for n in names)]
        lines += ["  " + f"{name:<12}" + "".join(f"{c:<{width}}" for c in cells) for name, cells in rows]
        if self.data_free:
            lines.append("  data-free: weights only (uniform ranks, largest weight norms), no calibration; the "
                         "least faithful file (bench/RESULTS.md, Recipes): use it to try sdslim, then quick")
        return "\n".join(lines)


def plan_ladder(session, variants: dict, data_free_cfg: TrainConfig | None = None) -> Ladder:
    """One warm-up of ``session`` (the most demanding recipe's settings), then every ``variants`` name →
    :class:`TrainConfig` priced from it, and the data-free recipe (``data_free_cfg``) timed for real."""
    from .memory import ram_need
    from .plan import bank_size, price, warm_up, _stage2_inputs
    w = warm_up(session, _stage2_inputs(session, bank_size(session)))
    plans = {name: price(session, tc, w) for name, tc in variants.items()}
    df = None
    if data_free_cfg is not None:
        t0 = time.perf_counter()
        data_free_set(session.weights, session.cfg, data_free_cfg)
        need = ram_need(session, 0) if session.device.type == "cpu" else None
        df = {"seconds": time.perf_counter() - t0, "ram_bytes": need.teacher // 2 if need else None}
    return Ladder(plans, df)
