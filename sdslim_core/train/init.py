"""Initialisation of the adapters from captured teacher activations, measured against data-free baselines.

Methods (rank r, width m/c; each one gives the site's adapter tensors):

- ``obs``: correlation-aware selection (structured Optimal Brain Surgeon): hidden units (FF) or whole ``norm2``
  groups (Res) are removed greedily, each time the one whose removal raises the least-squares reconstruction error
  of the next layer's output least, accounting for what the kept units can still predict (Schur complement of the
  activation Gram matrix, weighted by the next layer: W_oᵀW_o, or conv2's Gram over its taps); U is the
  least-squares map from the kept units back to all of them. FF fits an intercept c (``up_bias``, folded exactly
  into the ``net.2`` bias). Res keeps whole groups with a GroupNorm over them, so the kept channels are normalised
  exactly as in the teacher and z = a_S holds exactly.
- ``act_select``: activation-aware unit/channel selection. Importance of hidden unit j = ‖column j of the
  following weight (W_o, or conv2 over its input channel)‖ · rms of that unit's activation; the r most
  important are selected (A_v = A_g = D = selection) and U is the least-squares map from the selected
  bottleneck activations to the full hidden activations (so W_o·U·h_S is the best linear prediction of the
  teacher's output from h_S). Res: GroupNorm' keeps the selected channels' γ/β.
- ``act_pca``: PCA of the hidden activations (FF: h = v ⊙ gelu(g); Res: the pre-norm2 activations);
  A_v = A_g = D = top-r principal directions, U by least squares as above (GroupNorm' γ = 1, β = 0).
- ``weight_svd``: plain SVD of the following weight (W_o, or conv2 as c × (c_out·9)): the weak baseline.
- ``select``: :meth:`AdapterSet.init_select` (data-free, largest weight norms).
- ``random``: Gaussian matrices (only to show what initialisation buys; never picked unless it is best).
- ``base`` (``--from`` only): the base model's trained adapter of the site, measured on the derivative's data
  next to the methods above, so a site the derivative changed is re-initialised from its own activations.

Every method's relative error is measured on the held-out split and the best is kept per site.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from typing import TYPE_CHECKING, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .. import layout
from ..io import adapters
from ..io.tensors import load_file, save_file_atomic
from ..layout import rank_policy
from ..modules import swap
from .report import finite
from .sites import SiteData

if TYPE_CHECKING:
    from .calibration import ActivationStore
    from .session import Session

_RIDGE = 1e-6


def _ls(cross: torch.Tensor, gram: torch.Tensor, n: int, prior: torch.Tensor | None = None) -> torch.Tensor:
    """Least squares U = argmin ‖U z − a‖² + λ‖U − prior‖² from moments (cross = Σ a zᵀ [m, r], gram = Σ z zᵀ
    [r, r], n samples), in their dtype. λ grows with r/n, so few samples shrink U toward the prior (the data-free
    choice, e.g. the selection's own transpose) instead of overfitting."""
    r = gram.shape[0]
    scale = float(gram.diagonal().mean().clamp_min(1e-12))
    lam = scale * (_RIDGE + r / max(n, 1))
    rhs = cross + (lam * prior if prior is not None else 0.0)
    return torch.linalg.solve((gram + lam * torch.eye(r, dtype=gram.dtype, device=gram.device)).T, rhs.T).T


def linalg_place(device) -> tuple[torch.device, torch.dtype]:
    """Where the initialisation's linear algebra runs: float64 on the CPU, float32 on an accelerator (covariances
    of 5120-wide SDXL FeedForwards and their eigendecompositions take minutes in float64 on a CPU)."""
    device = torch.device(device)
    return (device, torch.float64) if device.type == "cpu" else (device, torch.float32)


def _selection(idx: torch.Tensor, m: int, like: torch.Tensor) -> torch.Tensor:
    sel = torch.zeros(idx.numel(), m, dtype=like.dtype, device=like.device)
    sel[torch.arange(idx.numel(), device=like.device), idx.to(like.device)] = 1.0
    return sel


def _top(score: torch.Tensor, r: int) -> torch.Tensor:
    return torch.sort(torch.topk(score, r).indices).values


def obs_order(cov: torch.Tensor, weight_gram: torch.Tensor, group: int = 1) -> torch.Tensor:
    """Blocks of ``group`` consecutive units in the order greedy backward OBS removes them (all but the last).

    Minimises, one removal at a time, tr(M (Σ − Σ_{:,S} Σ_SS⁻¹ Σ_{S,:})) over the kept set S, M = ``weight_gram``
    (the next layer's Gram, symmetric), Σ = ``cov``: removing block B costs tr(C_Bᵀ M C_B (Σ_S⁻¹)_BB⁻¹), C the
    current least-squares map from the kept units to all units. After each removal C, Σ_S⁻¹ and the numerators
    C_Bᵀ M C_B are updated in place by rank-g downdates, and every so often the matrices shrink to the kept blocks
    (memory traffic, not arithmetic, bounds this on a CPU). Greedy sets are nested, so one order serves every rank
    (:func:`obs_keep`)."""
    m, g = cov.shape[0], group
    if m % g:
        raise ValueError(f"obs_order: {m} units do not split into blocks of {g}")
    cov, weight_gram = cov.double(), weight_gram.double()      # thousands of rank-g downdates: float64 on any device
    eye = torch.eye(m, dtype=cov.dtype, device=cov.device)
    h_inv = torch.linalg.inv(cov + _RIDGE * float(cov.diagonal().mean().clamp_min(1e-30)) * eye)   # Σ_S⁻¹
    c = eye                                           # m × |S|: removed columns become zero until the next shrink
    ids = torch.arange(m // g, device=cov.device)     # the block of each column block of c (and of Σ_S⁻¹)
    num = weight_gram.view(m // g, g, m // g, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1).clone()  # C_Bᵀ M C_B
    alive = torch.ones(ids.numel(), dtype=torch.bool, device=cov.device)
    order = []
    for _ in range(m // g - 1):
        a = ids.numel()
        gi = h_inv.view(a, g, a, g).diagonal(dim1=0, dim2=2).permute(2, 0, 1)             # (Σ_S⁻¹)_BB
        cost = torch.linalg.solve(gi[alive], num[alive]).diagonal(dim1=1, dim2=2).sum(1)
        k = int(torch.nonzero(alive)[int(torch.argmin(cost))])
        cols = slice(k * g, k * g + g)
        row = h_inv[cols].clone()                                                            # g × |S|
        p = torch.linalg.solve(row[:, cols], row)                                            # (Σ_S⁻¹)_kk⁻¹ row
        ck = c[:, cols].clone()
        t = (weight_gram @ ck).T @ c                                                         # C_kᵀ M C, g × |S|
        c.addmm_(ck, p, alpha=-1.0)
        h_inv.addmm_(row.T, p, alpha=-1.0)
        pb, tb = p.view(g, a, g).transpose(0, 1), t.view(g, a, g).transpose(0, 1)            # per block: g × g
        cross = pb.transpose(1, 2) @ tb
        num -= cross + cross.transpose(1, 2) - pb.transpose(1, 2) @ t[:, cols] @ pb
        alive[k] = False
        order.append(int(ids[k]))
        if 8 * int((~alive).sum()) >= a:                                                     # shrink to S
            keep = torch.nonzero(alive).flatten()
            cols_kept = (keep[:, None] * g + torch.arange(g, device=cov.device)).flatten()
            c, h_inv = c[:, cols_kept], h_inv[cols_kept][:, cols_kept]
            num, ids, alive = num[keep], ids[keep], alive[keep]
    return torch.tensor(order, dtype=torch.long)


def obs_keep(order: torch.Tensor, m: int, r: int, group: int = 1) -> torch.Tensor:
    """Sorted indices of the ``r`` units that remain after the first removals of an :func:`obs_order`."""
    n_blocks = m // group
    if r % group or not 0 < r <= m:
        raise ValueError(f"obs_keep: rank {r} is not a whole number of {group}-unit blocks of {m}")
    gone = set(order[:n_blocks - r // group].tolist())
    kept = [b for b in range(n_blocks) if b not in gone]
    return (torch.tensor(kept)[:, None] * group + torch.arange(group)).flatten()


class FFStats:
    """Fit-split statistics of one FF site: value/gate pre-activations and the hidden activations h."""

    def __init__(self, site_mod: nn.Module, data: SiteData, device, dtype, amp, max_tokens: int = 16384,
                 orders: dict | None = None):
        proj = site_mod.get_submodule(layout.FF_LAYERS["proj"])
        self.ladev, self.ladt = linalg_place(device)
        self.w_o = site_mod.get_submodule(layout.FF_LAYERS["out"]).weight.detach().to(self.ladev, self.ladt)
        self.m = self.w_o.shape[1]
        vs, gs = [], []
        with torch.no_grad():
            for i in range(0, min(data.n_fit(), max_tokens), 4096):
                x = data.fit_x[i:min(i + 4096, max_tokens)].to(device, dtype)
                with amp():
                    vg = proj(x).float()
                v, g = vg.chunk(2, dim=-1)
                vs.append(v.cpu())
                gs.append(g.cpu())
        self.v, self.g = torch.cat(vs), torch.cat(gs)
        self.n = self.v.shape[0]
        self.cov = torch.zeros(self.m, self.m, dtype=self.ladt, device=self.ladev)
        self.mean = torch.zeros(self.m, dtype=self.ladt, device=self.ladev)
        for h in self._hidden():
            self.cov += h.T @ h
            self.mean += h.sum(0)
        self.cov /= self.n
        self.mean /= self.n
        self._orders = {} if orders is None else orders       # OBS removal orders, shared across phases
        self.order_seconds = 0.0                              # time spent computing them here

    def _vg(self, i: int, chunk: int = 4096):
        return (self.v[i:i + chunk].to(self.ladev, self.ladt), self.g[i:i + chunk].to(self.ladev, self.ladt))

    def _hidden(self, chunk: int = 4096):
        for i in range(0, self.n, chunk):
            v, g = self._vg(i, chunk)
            yield v * F.gelu(g)

    def act_select(self, r: int) -> dict:
        score = self.w_o.norm(dim=0) * self.cov.diagonal().clamp_min(0).sqrt()
        idx = _top(score, r)
        sel = _selection(idx, self.m, self.cov)
        up = _ls(self.cov[:, idx] * self.n, self.cov[idx][:, idx] * self.n, self.n, prior=sel.T)
        return {"down_value": sel, "down_gate": sel.clone(), "up": up}

    def obs(self, r: int, intercept: bool = True, greedy: bool = True) -> dict:
        """OBS selection (``greedy=False``: today's independent top-r score) and least squares for U, with the
        intercept c = μ − U μ_S when ``intercept`` (U then fits the centred activations)."""
        cov = self.cov - torch.outer(self.mean, self.mean) if intercept else self.cov
        if greedy:
            if intercept not in self._orders:
                t0 = time.perf_counter()
                self._orders[intercept] = obs_order(cov, self.w_o.T @ self.w_o)
                self.order_seconds += time.perf_counter() - t0
            idx = obs_keep(self._orders[intercept], self.m, r).to(cov.device)
        else:
            idx = _top(self.w_o.norm(dim=0) * self.cov.diagonal().clamp_min(0).sqrt(), r)
        sel = _selection(idx, self.m, self.cov)
        up = _ls(cov[:, idx] * self.n, cov[idx][:, idx] * self.n, self.n, prior=sel.T)
        out = {"down_value": sel, "down_gate": sel.clone(), "up": up}
        if intercept:
            out["up_bias"] = self.mean - up @ self.mean[idx]
        return out

    def act_pca(self, r: int) -> dict:
        _, evecs = torch.linalg.eigh(self.cov)
        p = evecs[:, -r:].flip(1)                              # m × r, largest first
        r_ = p.shape[1]
        gram = torch.zeros(r_, r_, dtype=self.ladt, device=self.ladev)
        cross = torch.zeros(self.m, r_, dtype=self.ladt, device=self.ladev)
        for i, h in zip(range(0, self.n, 4096), self._hidden()):
            v, g = self._vg(i)
            z = (v @ p) * F.gelu(g @ p)
            gram += z.T @ z
            cross += h.T @ z
        up = _ls(cross, gram, self.n, prior=p)
        return {"down_value": p.T.contiguous(), "down_gate": p.T.contiguous(), "up": up}

    def weight_svd(self, r: int) -> dict:
        _, _, vh = torch.linalg.svd(self.w_o, full_matrices=True)
        v = vh[:r].contiguous()                                # r × m
        return {"down_value": v, "down_gate": v.clone(), "up": v.T.contiguous()}


class ResStats:
    """Fit-split statistics of one Res site: pre-norm2 activations h1 and conv2 inputs a (per pixel)."""

    def __init__(self, site_mod: nn.Module, naming: str, data: SiteData, device, dtype, amp,
                 orders: dict | None = None):
        names = layout.RES_LAYERS[naming]
        self.site_mod, self.data = site_mod, data
        self.device, self.dtype, self.amp = device, dtype, amp
        self.norm2 = site_mod.get_submodule(names["norm2"])
        self.conv2 = site_mod.get_submodule(names["conv2"])
        self.c = self.conv2.weight.shape[1]
        self.ladev, self.ladt = linalg_place(device)
        la = dict(device=self.ladev, dtype=self.ladt)
        w2 = self.conv2.weight.detach().to(**la)
        self.w2_cols = w2.transpose(0, 1).flatten(1)           # c × (c_out·k·k)
        self.gamma = self.norm2.weight.detach().to(**la)
        self.beta = self.norm2.bias.detach().to(**la)
        self.eps = self.norm2.eps
        c = self.c
        self.cov_a = torch.zeros(c, c, **la)
        self.cov_h = torch.zeros(c, c, **la)
        self.mean_h = torch.zeros(c, **la)
        n = 0
        for h1, a in self._passes():
            self.cov_a += a.T @ a
            self.cov_h += h1.T @ h1
            self.mean_h += h1.sum(0)
            n += a.shape[0]
        self.n = n
        self.cov_a /= n
        self.mean_h /= n
        self.cov_h = self.cov_h / n - torch.outer(self.mean_h, self.mean_h)
        self._orders = {} if orders is None else orders       # OBS removal orders, shared across phases
        self.order_seconds = 0.0                              # time spent computing them here

    def _passes(self):
        """(h1, a) per fit batch as [pixels, c] (linear-algebra device/dtype), captured with hooks on norm2 and
        conv2."""
        got = {}
        hooks = [self.norm2.register_forward_pre_hook(lambda m, a: got.__setitem__("h1", a[0])),
                 self.conv2.register_forward_pre_hook(lambda m, a: got.__setitem__("a", a[0]))]
        try:
            with torch.no_grad():
                d = self.data
                for i in range(0, d.n_fit(), d.batch):
                    x = d.fit_x[i:i + d.batch].to(self.device, self.dtype)
                    emb = d.fit_emb[i:i + d.batch].to(self.device, self.dtype)
                    with self.amp():
                        self.site_mod(x, emb)
                    yield (got["h1"].transpose(0, 1).flatten(1).T.to(self.ladev, self.ladt),
                           got["a"].transpose(0, 1).flatten(1).T.to(self.ladev, self.ladt))
        finally:
            for h in hooks:
                h.remove()

    def _solve_up(self, down: torch.Tensor, groups: int, gamma: torch.Tensor, beta: torch.Tensor,
                  prior: torch.Tensor) -> torch.Tensor:
        """U by least squares from z = silu(GN'(D h1)) to a, per pixel (GN' statistics per map)."""
        r = down.shape[0]
        gram = torch.zeros(r, r, dtype=self.ladt, device=self.ladev)
        cross = torch.zeros(self.c, r, dtype=self.ladt, device=self.ladev)
        d = self.data
        for (h1, a), i in zip(self._passes(), range(0, d.n_fit(), d.batch)):
            b = min(d.batch, d.n_fit() - i)
            hw = h1.shape[0] // b
            hd = (h1 @ down.T).reshape(b, hw, r).transpose(1, 2)      # b × r × hw
            z = F.silu(F.group_norm(hd, groups, gamma, beta, self.eps)).transpose(1, 2).reshape(-1, r)
            gram += z.T @ z
            cross += a.T @ z
        return _ls(cross, gram, self.n, prior=prior)

    def obs(self, r: int, greedy: bool = True) -> dict:
        """Whole ``norm2`` groups kept by block OBS (``greedy=False``: the groups of highest summed act_select
        score); the bottleneck GroupNorm has one group per kept group, so z = a_S exactly and U is the least-squares
        map from a_S to a. Falls back to single channels when ``r`` is not a whole number of groups."""
        k = self.c // self.norm2.num_groups
        k = k if r % k == 0 else 1
        if greedy:
            if k not in self._orders:
                t0 = time.perf_counter()
                self._orders[k] = obs_order(self.cov_a, self.w2_cols @ self.w2_cols.T, k)
                self.order_seconds += time.perf_counter() - t0
            idx = obs_keep(self._orders[k], self.c, r, k).to(self.cov_a.device)
        else:
            score = (self.w2_cols.norm(dim=1) * self.cov_a.diagonal().clamp_min(0).sqrt()).pow(2)
            chosen = _top(score.view(-1, k).sum(1), r // k)
            idx = (chosen[:, None] * k + torch.arange(k, device=chosen.device)).flatten()
        sel = _selection(idx, self.c, self.cov_a)
        up = _ls(self.cov_a[:, idx] * self.n, self.cov_a[idx][:, idx] * self.n, self.n, prior=sel.T)
        return {"down": sel, "norm.weight": self.gamma[idx], "norm.bias": self.beta[idx], "up": up}

    def act_select(self, r: int) -> dict:
        score = self.w2_cols.norm(dim=1) * self.cov_a.diagonal().clamp_min(0).sqrt()
        idx = _top(score, r)
        sel = _selection(idx, self.c, self.cov_a)
        groups = _groups(r, self.c)
        gamma, beta = self.gamma[idx], self.beta[idx]
        return {"down": sel, "norm.weight": gamma, "norm.bias": beta,
                "up": self._solve_up(sel, groups, gamma, beta, sel.T)}

    def act_pca(self, r: int) -> dict:
        _, evecs = torch.linalg.eigh(self.cov_h)
        p = evecs[:, -r:].flip(1).T.contiguous()                      # r × c
        groups = _groups(r, self.c)
        gamma = torch.ones(r, dtype=self.ladt, device=self.ladev)
        beta = torch.zeros(r, dtype=self.ladt, device=self.ladev)
        return {"down": p, "norm.weight": gamma, "norm.bias": beta, "up": self._solve_up(p, groups, gamma, beta, p.T)}

    def weight_svd(self, r: int) -> dict:
        u, _, _ = torch.linalg.svd(self.w2_cols, full_matrices=True)
        q = u[:, :r].contiguous()                                     # c × r
        return {"down": q.T.contiguous(), "norm.weight": torch.ones_like(q[0]),
                "norm.bias": torch.zeros_like(q[0]), "up": q}


def _groups(r: int, width: int) -> int:
    return rank_policy.res_groups(width, r)


def random_tensors(kind: str, width: int, r: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if kind == "ff":
        return {"down_value": rnd(r, width) / math.sqrt(width), "down_gate": rnd(r, width) / math.sqrt(width),
                "up": rnd(width, r) / math.sqrt(r)}
    return {"down": rnd(r, width) / math.sqrt(width), "norm.weight": torch.ones(r, dtype=torch.float64),
            "norm.bias": torch.zeros(r, dtype=torch.float64), "up": rnd(width, r) / math.sqrt(r)}


def select_tensors(weights: Mapping[str, torch.Tensor], site: str, r: int, family: str) -> dict:
    own = {k: weights[k] for k in list(weights.keys()) if k.startswith(site + ".")}
    return adapters.AdapterSet.init_select(own, {site: r}, family).sites[site]


class SiteInit:
    """Candidate initialisations of one site at any rank, scored on the eval split."""

    def __init__(self, site: layout.Site, site_mod: nn.Module, naming: str, data: SiteData, weights: Mapping,
                 family: str, device, dtype, amp, seed: int = 0, orders: dict | None = None,
                 base: dict | None = None):
        self.site, self.site_mod, self.naming, self.data = site, site_mod, naming, data
        self.base = base               # the ``base`` method's tensors (``--from``), or None
        self.weights, self.family = weights, family
        self.device, self.dtype, self.amp, self.seed = device, dtype, amp, seed
        self._stats = None
        self._orders = orders          # the site's OBS orders from an earlier phase of the run (the same data)

    @property
    def order_seconds(self) -> float:
        """Seconds this site spent computing OBS removal orders (0 when they came from an earlier phase)."""
        return self._stats.order_seconds if self._stats is not None else 0.0

    @property
    def stats(self):
        if self._stats is None:
            if self.site.kind == "ff":
                self._stats = FFStats(self.site_mod, self.data, self.device, self.dtype, self.amp,
                                      orders=self._orders)
            else:
                self._stats = ResStats(self.site_mod, self.naming, self.data, self.device, self.dtype, self.amp,
                                       orders=self._orders)
        return self._stats

    def tensors(self, method: str, r: int) -> dict:
        if method == "base":
            t = self.base
        elif method == "select":
            t = select_tensors(self.weights, self.site.name, r, self.family)
        elif method == "random":
            t = random_tensors(self.site.kind, self.site.width, r, self.seed)
        else:
            t = getattr(self.stats, method)(r)
        return {k: v.float().cpu().contiguous() for k, v in t.items()}

    def error(self, tensors: dict, r: int) -> float:
        student, _ = swap.train_site(self.site_mod, self.site.name, self.site.kind, self.naming, tensors,
                                     _groups(r, self.site.width))
        err = self.data.eval_error(student, self.device, self.dtype, self.amp)
        return err if math.isfinite(err) else math.inf

    def best(self, r: int, methods) -> tuple[dict, str, dict]:
        """(tensors of the best method, its name, {method: error})."""
        errors, cands = {}, {}
        for method in methods:
            try:
                t = self.tensors(method, r)
            except (RuntimeError, torch.linalg.LinAlgError) as err:   # e.g. a singular least-squares system
                errors[method] = math.inf
                cands[method] = None
                _ = err
                continue
            cands[method] = t
            errors[method] = self.error(t, r)
        finite = {m: e for m, e in errors.items() if cands[m] is not None and m != "random"} or \
            {m: e for m, e in errors.items() if cands[m] is not None}
        name = min(finite, key=lambda m: (finite[m], list(methods).index(m)))
        return cands[name], name, errors

    def curve(self, ranks, method: str = "obs") -> dict[int, float]:
        """Site error vs rank for ``method``."""
        return {r: self.error(self.tensors(method, r), r) for r in ranks}


def site_init(session: "Session", store: "ActivationStore", site: str) -> SiteInit:
    """``site``'s :class:`SiteInit` on the session's device (its teacher layers and captured data)."""
    teacher_site = session.placement.site_on_device(site)
    return SiteInit(session.site_by_name[site], teacher_site, session.naming,
                    session.site_data(store, site, teacher_site), session.weights, session.cfg.family,
                    session.device, session.compute_dtype, session.amp, seed=session.tc.seed,
                    orders=session.obs_orders.setdefault(site, {}), base=base_tensors(session, site))


def base_tensors(session: "Session", site: str) -> dict | None:
    """``site``'s adapter in the ``--from`` file when it can start this run there (same norm groups), else None."""
    base = session.base
    if base is None or site not in base.sites:
        return None
    s = session.site_by_name[site]
    if s.kind == "res" and base.groups(site) != rank_policy.res_groups(s.width, base.rank(site)):
        return None
    return base.sites[site]


def init_methods(session: "Session", site: str) -> tuple:
    """The methods measured at ``site``: ``base`` first when ``--from`` gives one (it wins ties), then the run's."""
    return (("base",) if base_tensors(session, site) is not None else ()) + tuple(session.tc.init_methods)


def initialise(session: "Session", store: "ActivationStore", ranks: dict) -> tuple[adapters.AdapterSet, list, dict]:
    """The initialisation phase: each site's best method at its rank (``init/site-<index>.safetensors`` as it
    goes, then ``init.safetensors`` in their place); returns (adapters, the per-site table, {site: chosen error})."""
    init_file = session.work_dir / "init.safetensors"
    if session.resume and init_file.exists():
        aset = session.ordered(adapters.AdapterSet.load(init_file))
        meta = aset.metadata["sdslim.init"]
        return aset, meta["table"], {k: float(v) for k, v in meta["site_error"].items()}
    t0 = time.perf_counter()
    todo = session.owned_sites(ranks)
    session.progress.start_stage("init", len(todo), unit="site")
    for n, site in enumerate(todo):
        path = _site_file(session, site)
        if session.resume and path.exists():
            session.progress.advance(n + 1)
            continue
        si = site_init(session, store, site)
        tensors, chosen, errors = si.best(ranks[site], init_methods(session, site))
        session.timing["obs_orders_s"] = session.timing.get("obs_orders_s", 0.0) + si.order_seconds
        s = session.site_by_name[site]
        row = {"site": site, "kind": s.kind, "width": s.width, "rank": ranks[site], "errors": errors,
               "chosen": chosen}
        save_file_atomic({f"{site}/{k}": v for k, v in tensors.items()}, path, {"sdslim.init": {"row": finite(row)}})
        del si
        session.free_device_memory()
        session.progress.advance(n + 1)
    session.progress.end_stage()
    session.timing["init_s"] = time.perf_counter() - t0
    session.topo.barrier()
    sites, groups, table, errs = {}, {}, [], {}
    for site in session.site_order:
        if site not in ranks:
            continue
        tensors, meta = load_file(_site_file(session, site))
        row = json.loads(meta["sdslim.init"])["row"]
        row["errors"] = {k: (float("inf") if v is None else v) for k, v in row["errors"].items()}
        sites[site] = {k.split("/", 1)[1]: v for k, v in tensors.items()}
        if session.site_by_name[site].kind == "res":
            groups[site] = rank_policy.res_groups(session.site_by_name[site].width, ranks[site])
        table.append(row)
        errs[site] = row["errors"][row["chosen"]]
    aset = adapters.AdapterSet(session.cfg.family, sites, groups)
    aset.metadata["sdslim.init"] = {"table": finite(table), "site_error": errs}
    if session.topo.main:
        aset.save(init_file)
    session.topo.barrier()
    if session.topo.main:                                 # init.safetensors holds them all now
        shutil.rmtree(session.work_dir / "init", ignore_errors=True)
    return aset, table, errs


def _site_file(session: "Session", site: str):
    return session.work_dir / "init" / f"site-{session.site_order.index(site):04d}.safetensors"
