"""Site-level pieces of the trainer: the teacher's site modules, relative errors, and the Theseus gate (student or teacher, switched per step).

A site's *output* is what its adapter changes: the FeedForward's output for FF sites and the ResBlock's residual
branch (block output minus the skip path) for Res sites. Relative errors are ||student − teacher|| / ||teacher||
over these outputs.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .. import layout
from ..io.adapters import AdapterSet
from ..modules import swap
from ..modules.layers import set_module


def site_module(tree: nn.Module, site: str, cfg: layout.UNetConfig | None = None) -> nn.Module:
    return tree.get_submodule(swap.site_path(tree, site, cfg))


def res_skip(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The skip path of a ResBlock (diffusers ``conv_shortcut`` or LDM ``skip_connection``), already scaled."""
    if hasattr(block, "skip_connection"):
        return block.skip_connection(x)
    skip = block.conv_shortcut(x) if getattr(block, "conv_shortcut", None) is not None else x
    return skip / getattr(block, "output_scale_factor", 1.0)


def call_site(module: nn.Module, kind: str, x: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
    return module(x) if kind == "ff" else module(x, emb)


# --------------------------------------------------------------------------------------------- Theseus gate

class SiteGate(nn.Module):
    """Routes a site to its student (train-time adapters) or to the untouched teacher module.

    ``replaced`` is set before each step (never sampled inside ``forward``, so gradient-checkpoint recomputation
    takes the same branch). With ``replaced = False`` the call *is* the teacher's module: the bypass reproduces the
    teacher exactly. With ``feature`` set, a replaced site also records its output and the teacher site's output on
    the same input (no grad) in ``feature.pairs`` while ``feature.recording`` is on (so gradient-checkpoint
    recomputation during backward neither records twice nor runs different operations).
    """

    def __init__(self, site: str, kind: str, teacher: nn.Module, student: nn.Module):
        super().__init__()
        self.site, self.kind = site, kind
        self.teacher, self.student = teacher, student
        self.replaced = True
        self.feature = None

    def forward(self, *args, **kwargs):
        if not self.replaced:
            return self.teacher(*args, **kwargs)
        out = self.student(*args, **kwargs)
        f = self.feature
        if f is not None and f.recording and torch.is_grad_enabled():
            with torch.no_grad():
                ref = self.teacher(*args, **kwargs)
                x = args[0] if args else next(iter(kwargs.values()))
                if self.kind == "res":
                    ref_branch = ref - res_skip(self.teacher, x)
                else:
                    ref_branch = ref
                scale = ref_branch.float().pow(2).mean().clamp_min(1e-12)
            f.pairs.append((out, ref, scale))
        return out


class FeatureRecorder:
    """Collects (student output, teacher output, scale) per replaced site during one forward; the losses are
    computed after the forward (outside any gradient-checkpointed region, whose recomputation must repeat the
    forward's operations exactly)."""

    def __init__(self):
        self.recording = False
        self.pairs = []

    def start(self):
        self.pairs, self.recording = [], True

    def stop(self):
        self.recording = False

    def losses(self) -> list:
        return [(out.float() - ref.float()).pow(2).mean() / scale for out, ref, scale in self.pairs]


def gated_tree(teacher: nn.Module, aset: AdapterSet, cfg: layout.UNetConfig | None = None):
    """The stage-2 model: :func:`swap.attach_train_adapters` on ``teacher`` with a :class:`SiteGate` at every
    site. Returns (tree, {site: SiteAdapter}, {site: SiteGate}); the teacher tree itself is not modified."""
    tree, site_adapters = swap.attach_train_adapters(teacher, aset)
    gates = {}
    for site in aset.sites:
        path = swap.site_path(tree, site, cfg)
        gate = SiteGate(site, aset.kind(site), teacher.get_submodule(path), tree.get_submodule(path))
        set_module(tree, path, gate)
        gates[site] = gate
    return tree, site_adapters, gates


def set_gates(gates: Mapping[str, SiteGate], replaced: Mapping[str, bool] | bool):
    for site, gate in gates.items():
        gate.replaced = bool(replaced if isinstance(replaced, bool) else replaced[site])


def rel_err(num_sq: float, den_sq: float) -> float:
    return float((num_sq / max(den_sq, 1e-30)) ** 0.5)


# ------------------------------------------------------------------------------------------------ site data

class SiteData:
    """One site's captured inputs with the teacher's outputs (CPU, in the calibration storage dtype: fp16 for
    CUDA runs, so a big Res site's maps take half the RAM), split into fit and eval; batches are cast on the way.

    ``fit_scale`` is the mean square of the teacher's site output on the fit split (the stage-1 loss divides by
    it); ``eval_den`` the sum of squares on the eval split (relative errors divide by it).
    """

    def __init__(self, site: str, kind: str, fit: dict, ev: dict, teacher_site: nn.Module, device, dtype, amp,
                 batch: int):
        self.site, self.kind = site, kind
        self.fit_x, self.fit_emb = fit["x"], fit.get("emb")
        self.eval_x, self.eval_emb = ev["x"], ev.get("emb")
        if self.fit_x.shape[0] == 0 or self.eval_x.shape[0] == 0:
            raise ValueError(f"{site}: no calibration activations captured (fit {self.fit_x.shape[0]}, eval "
                             f"{self.eval_x.shape[0]})")
        self.batch = batch
        self.fit_y, fit_sq = self._targets(teacher_site, self.fit_x, self.fit_emb, device, dtype, amp)
        self.eval_y, self.eval_den = self._targets(teacher_site, self.eval_x, self.eval_emb, device, dtype, amp)
        self.fit_scale = max(fit_sq / max(1, self.fit_y.numel()), 1e-12)

    @torch.no_grad()
    def _targets(self, teacher_site, xs, embs, device, dtype, amp):
        ys, sq = [], 0.0
        for i in range(0, xs.shape[0], self.batch):
            x = xs[i:i + self.batch].to(device, dtype)
            emb = None if embs is None else embs[i:i + self.batch].to(device, dtype)
            with amp():
                y = call_site(teacher_site, self.kind, x, emb).float()
            branch = y - res_skip(teacher_site, x).float() if self.kind == "res" else y
            sq += float(branch.double().pow(2).sum())
            ys.append(y.to("cpu", xs.dtype))
        return torch.cat(ys), sq

    def n_fit(self) -> int:
        return self.fit_x.shape[0]

    def fit_batch(self, ids: torch.Tensor, device, dtype):
        x = self.fit_x[ids].to(device, dtype)
        emb = None if self.fit_emb is None else self.fit_emb[ids].to(device, dtype)
        return x, emb, self.fit_y[ids].to(device, torch.float32)

    @torch.no_grad()
    def eval_error(self, student: nn.Module, device, dtype, amp) -> float:
        """Relative error of ``student`` on the eval split."""
        num = 0.0
        for i in range(0, self.eval_x.shape[0], self.batch):
            x = self.eval_x[i:i + self.batch].to(device, dtype)
            emb = None if self.eval_emb is None else self.eval_emb[i:i + self.batch].to(device, dtype)
            with amp():
                y = call_site(student, self.kind, x, emb).float()
            num += float((y - self.eval_y[i:i + self.batch].to(device, torch.float32)).double().pow(2).sum())
        return rel_err(num, self.eval_den)


def site_errors(session, store, aset: AdapterSet) -> dict:
    """Held-out error of each of ``aset``'s sites on its own (all processes' sites, gathered)."""
    local = {}
    for site in session.owned_sites(aset.sites):
        teacher_site = session.placement.site_on_device(site)
        data = session.site_data(store, site, teacher_site)
        student, adapter = swap.train_site(teacher_site, site, aset.kind(site), session.naming, aset.sites[site],
                                           aset.groups(site))
        local[site] = data.eval_error(student, session.device, session.compute_dtype, session.amp)
        del data, student, adapter
    session.free_device_memory()
    return session.gather(local)
