"""Ranks per site: uniform ratios with per-kind overrides, or a parameter/byte budget allocated greedily from
measured error-vs-rank curves (spend parameters where they cut error most per parameter).

Res ranks are whole ``norm2`` groups and the adapter's norm keeps them (``rank_policy.res_groups``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from . import sensitivity
from .. import layout
from ..io.adapters import AdapterSet
from ..io.files import atomic_path
from ..layout import rank_policy
from ..ops import fold
from .config import TrainConfig, parse_budget
from .init import site_init
from .workdir import RANKS

if TYPE_CHECKING:
    from .calibration import ActivationStore, InputBank
    from .session import Session


def param_count(shapes: Mapping[str, tuple]) -> int:
    """Parameters of tensors with these shapes."""
    return sum(math.prod(s) for s in shapes.values())


def adapter_param_count(site_list, ranks: dict) -> int:
    """Trainable adapter parameters of the sites in ``site_list`` at ``ranks``."""
    n = 0
    for s in site_list:
        r = ranks.get(s.name)
        if r is None:
            continue
        n += 3 * r * s.width if s.kind == "ff" else 2 * r * s.width + 2 * r
    return n


def site_keys(shapes: Mapping[str, tuple], site: str) -> dict:
    return {k: v for k, v in shapes.items() if k.startswith(site + ".")}


def params_per_rank(shapes: Mapping[str, tuple], site: layout.Site) -> int:
    """Slim UNet parameters added per unit of rank at ``site`` (the slim count is linear in r)."""
    own = site_keys(shapes, site.name)
    return param_count(fold.slim_shapes(own, {site.name: 2})) - param_count(fold.slim_shapes(own, {site.name: 1}))


def slim_param_count(shapes: Mapping[str, tuple], ranks: Mapping[str, int]) -> int:
    """Parameters of the whole slim UNet (canonical shapes of the original, ranks per slimmed site)."""
    return param_count(fold.slim_shapes(shapes, ranks))


def ratio_ranks(site_list: Iterable[layout.Site], tc: TrainConfig) -> dict[str, int]:
    """Ranks for ``--ratio`` / ``--ff-ratio`` / ``--ff-rank`` / ``--res-ratio`` (sites of a kind without a
    value are not slimmed; a full-width rank means the site is left as it is)."""
    site_list = list(site_list)
    ranks = rank_policy.ranks_for_ratio(site_list, tc.ratio, tc.ff_ratio, tc.res_ratio)
    if tc.ff_rank is not None:
        for s in site_list:
            if s.kind == "ff":
                ranks[s.name] = min(s.width, tc.ff_rank)
    return {s.name: ranks[s.name] for s in site_list if s.name in ranks and ranks[s.name] < s.width}


def rank_grid(site: layout.Site, fractions: Iterable[float]) -> list[int]:
    """Candidate ranks of one site (increasing, below the full width)."""
    out = sorted({rank_policy.rank_for_ratio(site.width, f, site.kind) for f in fractions if 0 < f < 1})
    return [r for r in out if r < site.width]


def budget_params(tc: TrainConfig, site_list: Iterable[layout.Site] = (), shapes: Mapping | None = None) -> int:
    """The whole-UNet parameter budget: ``--budget``, or the slim parameter count of uniform ``--ratio``."""
    if tc.budget is not None:
        return parse_budget(tc.budget, tc.budget_bytes_per_param)[2]
    ranks = rank_policy.ranks_for_ratio(list(site_list), tc.ratio)
    return slim_param_count(shapes, {s: r for s, r in ranks.items()})


def uniform_total(site_list: Iterable[layout.Site], ratio: float, full: float, per_rank: Mapping[str, float]) -> float:
    """A linear resource (e.g. FLOPs) of the slim UNet at uniform ``ratio``: the budget ``--budget-by flops`` uses."""
    return full - sum(per_rank[s.name] * (s.width - r) for s in site_list
                      for r in [rank_policy.rank_for_ratio(s.width, ratio, s.kind)] if s.name in per_rank)


def allocate(site_list: Iterable[layout.Site], shapes: Mapping[str, tuple], curves: Mapping[str, Mapping[int, float]],
             budget: int, per_rank: Mapping[str, float] | None = None, full: float | None = None,
             unit: str = "params") -> tuple[dict[str, int], dict]:
    """Greedy allocation under a whole-UNet budget of parameters (default) or of another resource that is linear in
    the ranks (``per_rank``: its amount per unit of rank at each site, ``full``: the original model's total, e.g.
    forward FLOPs), minimising the sum of the sites' costs.

    ``curves[site][rank]`` is the measured cost of slimming ``site`` to ``rank`` (e.g. the squared whole-UNet
    error with that site slimmed alone, which adds up across sites; rank = width costs 0). Every site starts at
    its smallest candidate rank; then, while the total stays within ``budget``, the move (a site to any larger
    candidate rank) with the largest cost reduction per added unit of budget is taken (moves past flat stretches of a
    curve included, so a plateau does not hide the gain behind it). Sites that end at full width are left out (not
    slimmed). Returns (ranks, info).
    """
    site_list = [s for s in site_list if s.name in curves]
    if per_rank is None:
        full = param_count(shapes)
        per_rank = {s.name: params_per_rank(shapes, s) for s in site_list}
    ladder, cost = {}, {}
    for s in site_list:
        ladder[s.name] = sorted(int(r) for r in curves[s.name] if int(r) < s.width) + [s.width]
        cost[s.name] = {**{int(r): float(e) for r, e in curves[s.name].items()}, s.width: 0.0}
    pos = {n: 0 for n in ladder}
    total = full - sum(per_rank[n] * (ladder[n][-1] - ladder[n][0]) for n in ladder)
    floor = total
    if floor > budget:
        raise ValueError(f"budget {budget / 1e6:.1f}M {unit} is below the smallest slim UNet this rank grid can "
                         f"make ({floor / 1e6:.1f}M; the original has {full / 1e6:.1f}M)")
    while True:
        best, best_gain = None, 0.0
        for n in ladder:
            r0 = ladder[n][pos[n]]
            for j in range(pos[n] + 1, len(ladder[n])):
                extra = per_rank[n] * (ladder[n][j] - r0)
                if total + extra > budget:
                    break
                gain = (cost[n][r0] - cost[n][ladder[n][j]]) / max(extra, 1)
                if gain > best_gain:
                    best, best_gain = (n, j), gain
        if best is None:
            break
        n, j = best
        total += per_rank[n] * (ladder[n][j] - ladder[n][pos[n]])
        pos[n] = j
    ranks = {n: ladder[n][pos[n]] for n in pos if ladder[n][pos[n]] < ladder[n][-1]}
    info = {"unit": unit, f"budget_{unit}": budget, f"slim_{unit}": total, f"original_{unit}": full,
            f"min_{unit}": floor, "predicted_cost_sum": sum(cost[n][ladder[n][pos[n]]] for n in pos)}
    if unit != "params":
        info["slim_params"] = slim_param_count(shapes, ranks)
    return ranks, info


def anchor_ranks(grid: list[int], target: int, n: int) -> list[int]:
    """The ``n`` (1 or 2) grid ranks an anchored curve is measured end to end at: the one nearest ``target`` and,
    for two, the one nearest half of it (else the next one down or up)."""
    if not grid:
        return []
    first = min(grid, key=lambda r: (abs(r - target), r))
    if n == 1 or len(grid) == 1:
        return [first]
    others = [r for r in grid if r != first]
    second = min(others, key=lambda r: (abs(r - first / 2), r))
    return sorted({first, second})


def anchored_curve(local: dict[int, float], measured: dict[int, float]) -> dict[int, float]:
    """Squared end-to-end error at every rank of ``local`` (the site's own relative error per rank), from the
    squared end-to-end errors ``measured`` at one or two anchor ranks: e2e² = k·local^(2a), with a = 1 for one
    anchor and fitted in log space for two (clamped to [0.5, 2]); the anchors keep their measured values."""
    pts = [(local[r], e) for r, e in measured.items() if local.get(r, 0) > 0 and e > 0]
    if not pts:
        return {r: measured.get(r, 0.0) for r in local}
    a = 1.0
    if len(pts) == 2 and pts[0][0] != pts[1][0]:
        (l0, e0), (l1, e1) = pts
        a = min(2.0, max(0.5, (math.log(e1) - math.log(e0)) / (2 * (math.log(l1) - math.log(l0)))))
    k = math.exp(sum(math.log(e) - 2 * a * math.log(loc) for loc, e in pts) / len(pts))
    return {r: measured[r] if r in measured else (k * local[r] ** (2 * a) if local[r] > 0 else 0.0) for r in local}


def _target_rank(site: layout.Site, tc: TrainConfig) -> int:
    return rank_policy.rank_for_ratio(site.width, tc.ratio if tc.ratio is not None else 0.5, site.kind)


def choose_ranks(session: "Session", bank: "InputBank", store: "ActivationStore") -> tuple[dict, dict]:
    """Ranks per site: explicit (``--uniform``, per-kind values) or allocated under the parameter budget
    (``--budget``, or the parameters of uniform ``--ratio``) from measured cost-vs-rank curves (one
    ``init/curve-<index>.json`` per site, kept for a resumed run until the initialisation ends; the result in
    ``ranks.json``, which a resumed run reads instead of allocating again); returns (ranks, allocation info).

    Curves by ``tc.allocation``: ``e2e`` measures the whole-UNet error at every grid rank; ``anchored`` (default)
    measures it at ``tc.alloc_anchors`` ranks and scales the site's own error curve to them
    (:func:`anchored_curve`); ``site`` uses the site's own error alone. With ``start_from`` (``--from``): the base
    file's ranks, nothing measured."""
    tc, site_list = session.tc, session.site_list
    if session.base is not None:
        session.say(f"starting from {tc.start_from}: {len(session.base.sites)} sites at its ranks (no allocation)")
        return dict(session.base.ranks()), {"start_from": tc.start_from}
    if not tc.allocates():
        return ratio_ranks(site_list, tc), {}
    recorded = _recorded(session)
    if recorded is not None:
        return recorded
    fractions = tuple(tc.rank_grid) + ((tc.ratio,) if tc.ratio is not None else ())
    grids = {s.name: rank_grid(s, fractions) for s in site_list}
    method = tc.init_methods[0]
    ids = sensitivity.probe_ids(bank, tc.alloc_inputs, tc.seed)
    local = {}
    todo = session.owned_sites([s for s in session.site_order if grids[s]])
    session.progress.start_stage("rank curves", len(todo), unit="site")
    for site in todo:
        path = session.work_dir / "init" / f"curve-{session.site_order.index(site):04d}.json"
        if session.resume and path.exists():
            curve = {int(k): v for k, v in json.loads(path.read_text()).items()}
        else:
            si = site_init(session, store, site)
            if tc.allocation == "site":
                curve = {r: e * e for r, e in si.curve(grids[site], method).items()}
            else:
                teacher = session.placement.on_device()

                def e2e(r):
                    one = AdapterSet(session.cfg.family, {site: si.tensors(method, r)},
                                     {site: rank_policy.res_groups(si.site.width, r)} if si.site.kind == "res"
                                     else {})
                    return sensitivity.e2e_error(teacher, one, bank, ids, session.device, session.compute_dtype,
                                                 session.amp) ** 2
                if tc.allocation == "e2e":
                    curve = {r: e2e(r) for r in grids[site]}
                else:
                    anchors = anchor_ranks(grids[site], _target_rank(si.site, tc), tc.alloc_anchors)
                    curve = anchored_curve(si.curve(grids[site], method), {r: e2e(r) for r in anchors})
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(curve))
            tmp.replace(path)
            session.timing["obs_orders_s"] = session.timing.get("obs_orders_s", 0.0) + si.order_seconds
            del si
            session.free_device_memory()
        local[site] = curve
        session.progress.advance(len(local))
    session.progress.end_stage()
    session.placement.release()
    curves = session.gather(local)
    if tc.budget_by == "flops":
        full, per_rank = sensitivity.flops_per_rank(session.placement.on_device(), session.cfg, site_list, bank,
                                                    session.device, session.compute_dtype, session.amp)
        session.placement.release()
        budget = uniform_total(site_list, tc.ratio, full, per_rank)
        ranks, info = allocate(site_list, session.shapes, curves, budget, per_rank, full, "flops")
    else:
        budget = budget_params(tc, site_list, session.shapes)
        ranks, info = allocate(site_list, session.shapes, curves, budget)
    unit = info["unit"]
    info.update(allocation=tc.allocation, method=method,
                curves={s: {str(r): e for r, e in c.items()} for s, c in curves.items()})
    what = f"budget {tc.budget}" if tc.budget is not None else f"the {unit} of uniform ratio {tc.ratio}"
    session.say(f"{what}: {info[f'slim_{unit}'] / 1e6:.2f}M of {budget / 1e6:.2f}M {unit} used, "
                f"{len(ranks)} sites slimmed (allocated by {tc.allocation} error)")
    if session.topo.main:
        with atomic_path(session.work_dir / RANKS) as tmp:
            Path(tmp).write_text(json.dumps({"ranks": ranks, "info": info}))
    session.topo.barrier()
    return ranks, info


RECORD_ERRORS = (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError)


def read_allocation(path) -> tuple[dict, dict]:
    """(ranks, allocation info) from an allocation's ``ranks.json``; one of :data:`RECORD_ERRORS` when it cannot
    be read."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    return {str(k): int(v) for k, v in raw["ranks"].items()}, dict(raw["info"])


def _recorded(session: "Session") -> tuple[dict, dict] | None:
    """(ranks, allocation info) a resumed run's allocation recorded in ``<work dir>/ranks.json``; None when there
    is none (a new run, or one stopped before the allocation ended: its curves are in ``init/``)."""
    path = session.work_dir / RANKS
    if not (session.resume and path.exists()):
        return None
    try:
        ranks, info = read_allocation(path)
    except RECORD_ERRORS as err:
        raise ValueError(f"the work folder's rank allocation {path} is damaged ({err}): delete the work folder "
                         f"{session.work_dir} to start over (or, in the CLI, run without --resume)") from None
    session.say(f"rank allocation: {len(ranks)} sites slimmed, as recorded in {path} (not measured again)")
    return ranks, info
