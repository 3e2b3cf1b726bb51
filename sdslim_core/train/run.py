"""The training run: calibration → initialisation (→ budget ranks) → stage 1 → stage 2 → adapter file + report.

Every phase leaves its result in the work dir (calibration shards, ``init/``, ``stage1/``, checkpoints), so a
killed run continues with ``resume=True`` where it stopped and ends with the same adapters as an uninterrupted
one (on the same device and software; CUDA kernels are not all bit-deterministic). Each phase is a function of
its own module taking the run's :class:`~.session.Session`; :func:`execute` calls them in order.
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from typing import Callable, NamedTuple

import torch

from . import calibration as cal, ranks as ranks_mod, report as report_mod, stage1, stage2
from .. import layout
from ..io.adapters import AdapterSet, file_dtype
from ..io.files import refuse_existing
from .config import TrainConfig
from .device_fit import place_teacher
from .init import initialise
from .plan import make_plan, replan, warm_ranks
from .recipes import base_metadata
from .session import Session
from .sites import site_errors
from .teacher import teacher_weights
from .vram import predict_for


class TrainResult(NamedTuple):
    """``(adapters, report)``; unpacks as a tuple, ``.report`` prints as the text report."""
    adapters: AdapterSet
    report: report_mod.TrainReport


def _measure(session: Session, aset: AdapterSet, bank: cal.InputBank) -> float | None:
    """Whole-UNet held-out error of ``aset`` folded (main process only; None elsewhere)."""
    if not session.topo.main:
        return None
    err = stage2.measure(session, aset, bank)
    session.placement.release()
    return err


def _stage1(session: Session, store, aset_init: AdapterSet, err_init: dict, bank) -> tuple[AdapterSet, dict, dict]:
    """Stage 1 (or its result in the work dir): (adapters, {site: error}, {"init"/"stage1": UNet error})."""
    stage1_file = session.work_dir / "stage1.safetensors"
    if session.resume and stage1_file.exists():
        aset_s1 = session.ordered(AdapterSet.load(stage1_file))
        info = aset_s1.metadata["sdslim.stage1"]
        return aset_s1, {k: float(v) for k, v in info["site_error"].items()}, dict(info["unet_error"])
    unet_err = {"init": _measure(session, aset_init, bank)}
    if not session.tc.stage1_steps:               # nothing to train: the init is stage 1's result
        return aset_init, dict(err_init), dict(unet_err, stage1=unet_err["init"])
    tensors, err_s1 = stage1.run_stage1(session, store, aset_init, err_init)
    aset_s1 = session.ordered(AdapterSet(session.cfg.family, tensors, aset_init.norm_groups))
    unet_err["stage1"] = _measure(session, aset_s1, bank)
    aset_s1.metadata["sdslim.stage1"] = {"site_error": err_s1, "unet_error": unet_err}
    if session.topo.main:
        aset_s1.save(stage1_file)
    session.topo.barrier()
    if session.topo.main:                                 # stage1.safetensors holds every site's result now
        shutil.rmtree(session.work_dir / "stage1", ignore_errors=True)
    return aset_s1, err_s1, unet_err


def execute(session: Session) -> TrainResult:
    """Run every phase of ``session``'s training and write its adapter file (and the error plot)."""
    tc = session.tc
    started = time.perf_counter()
    fp = session.fingerprint()
    session.prepare_work_dir(fp)
    vram_info = {}
    if tc.allocates():
        r0 = warm_ranks(session)                   # the plan's: uniform at the same parameter count
    else:
        r0 = session.base.ranks() if session.base is not None else ranks_mod.ratio_ranks(session.site_list, tc)
    place_teacher(session, r0)                     # before anything is put on the device
    if tc.vram_estimate and not tc.allocates() and session.topo.main:
        vram_info = predict_for(session, r0, stage2.resolve_groups(session, r0))
    plan = plan_info = None
    if tc.plan and session.topo.main:
        plan = make_plan(session)
        plan_info = plan.to_dict()
        session.say(plan.text())
    bank, store = cal.calibrate(session, fp)
    t_ranks, orders0 = time.perf_counter(), session.timing.get("obs_orders_s", 0.0)
    ranks, budget_info = ranks_mod.choose_ranks(session, bank, store)
    if tc.allocates():              # the allocation's own time: without the OBS orders the init needs anyway
        session.timing["ranks_s"] = time.perf_counter() - t_ranks - (session.timing.get("obs_orders_s", 0.0)
                                                                    - orders0)
        if plan is not None:
            after = replan(session, plan, ranks)
            plan_info = dict(plan_info, after_ranks=after.to_dict())
            stages = ", ".join(f"{p.name} ~{p.seconds:.0f} s" for p in after.phases if p.name.startswith("stage"))
            session.say(f"after rank allocation ({len(ranks)} sites slimmed): {stages}; ETA of the whole run "
                        f"~{after.eta_s:.0f} s")
    if not ranks:
        raise ValueError("no site would be slimmed with these settings (every rank is the full width)")
    if tc.vram_estimate and tc.allocates() and session.topo.main:
        vram_info = predict_for(session, ranks, stage2.resolve_groups(session, ranks))
    aset_init, table, err_init = initialise(session, store, ranks)
    report = report_mod.TrainReport(family=session.cfg.family, ranks=dict(aset_init.ranks()), init_table=table,
                                    vram=vram_info, budget={k: v for k, v in budget_info.items() if k != "curves"},
                                    work_dir=str(session.work_dir), plan=plan_info)
    stage1_total = tc.stage1_steps * len(session.owned_sites(aset_init.sites))
    session.progress.total = stage1_total + tc.stage2_steps
    t_stage = time.perf_counter()
    aset_s1, err_s1, unet_err = _stage1(session, store, aset_init, err_init, bank)
    session.timing["stage1_s"] = time.perf_counter() - t_stage
    if tc.stage2_steps > 0:
        t_stage = time.perf_counter()
        groups = session.topo.broadcast_object(                   # the estimator runs once
            stage2.resolve_groups(session, aset_init.ranks()) if session.topo.main else None)
        tensors2, _, after = stage2.run_stage2(session, aset_s1, bank, groups, shown=stage1_total)
        session.timing["stage2_s"] = time.perf_counter() - t_stage
        final = session.ordered(AdapterSet(session.cfg.family, tensors2, aset_init.norm_groups))
        unet_err["stage2"] = after
        site_err = site_errors(session, store, final)
    else:
        final, site_err = aset_s1, err_s1
    session.placement.release()
    report.site_error = {"init": err_init, "stage1": err_s1}
    if tc.stage2_steps > 0:
        report.site_error["final"] = site_err
    report.unet_error = {k: v for k, v in unet_err.items() if v is not None}
    report.steps = {"stage1_per_site": tc.stage1_steps, "stage2": tc.stage2_steps}
    session.timing["total_s"] = time.perf_counter() - started
    report.timing = dict(session.timing)
    shapes = session.shapes
    report.params = {"original": ranks_mod.slim_param_count(shapes, {}),
                     "slim": ranks_mod.slim_param_count(shapes, final.ranks()),
                     "adapters": ranks_mod.adapter_param_count(session.site_list, final.ranks())}
    report.calibration = dict(session.calib.description, n_inputs=len(bank), n_eval=int(bank.is_eval.sum()),
                              latent_size=session.latent_size, trajectories=tc.n_trajectories
                              if session.calib.latents is None else None, sample_steps=tc.sample_steps,
                              guidance=tc.guidance)
    final.metadata = {"sdslim.train": report_mod.train_metadata(report, session, site_err, table),
                      "sdslim.base": base_metadata(session.weights, session.cfg, final, fp["teacher"])}
    final = final.stored_as(file_dtype(tc.adapter_dtype))       # what the file holds; the work dir keeps float32
    report.out = str(session.out_path)
    if session.topo.main:
        refuse_existing(session.out_path, session.overwrite)   # one may have appeared while training ran
        final.save(session.out_path)
        plot = session.out_path.with_name(session.out_path.stem + ".errors.png")
        try:
            report.plot = str(report_mod.plot_site_errors(report, plot))
        except Exception as err:  # a plot must never lose a finished training
            session.say(f"plot failed: {err}")
    session.topo.barrier()
    return TrainResult(final, report)


def plan_run(unet, cfg: layout.UNetConfig | None = None, calib: cal.Calibration | None = None,
             train_cfg: TrainConfig | None = None, out_path="adapters.safetensors"):
    """The cost plan of ``train_adapters(unet, cfg, calib, train_cfg, out_path)`` (warm-up included) without
    training; nothing is written."""
    weights, cfg = teacher_weights(unet, cfg)
    session = Session(weights, cfg, train_cfg or TrainConfig(), calib, out_path, None, False)
    return make_plan(session)


def train_adapters(unet, cfg: layout.UNetConfig | None = None, calib: cal.Calibration | None = None,
                   train_cfg: TrainConfig | None = None, out_path=None, progress: Callable | None = None,
                   resume: bool | str = False, *, out=None, contexts=None, overwrite: bool = True,
                   **overrides) -> TrainResult:
    """Distil slim adapters from a teacher UNet; returns ``TrainResult(adapters, report)``.

    ``unet``: a diffusers ``UNet2DConditionModel`` or LDM ``UNetModel``, a UNet state dict in any naming, or an
    opened checkpoint (:func:`sdslim_core.modules.unet.open_checkpoint`); it is never modified. ``cfg``: its
    :class:`~sdslim_core.layout.UNetConfig` (read from the weights when omitted). ``calib``: a
    :class:`~sdslim_core.train.calibration.Calibration` (default: unconditional; ``contexts=[tensor, …]``
    is a shortcut for :meth:`Calibration.from_contexts`). ``train_cfg``: a :class:`TrainConfig`; keyword
    ``overrides`` replace its fields (``steps=N`` sets both stages). ``out_path`` (or ``out=``): the adapter
    file to write. ``progress(done, total, info)`` is called after every optimizer step (info: stage, loss, site
    or p) and may raise to stop; ``resume=True`` continues from the work dir's checkpoints (a work dir made with
    other settings is an error), ``resume="auto"`` continues when the work dir matches and starts over otherwise.
    ``overwrite=False``: an adapter file already at ``out_path`` when training ends is refused (``OutputExists``)
    and the work dir kept; a caller checks it before training too.
    """
    tc = train_cfg or TrainConfig()
    steps = overrides.pop("steps", None)
    if overrides:
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"train_adapters: unknown options {unknown}")
        fields = {f.name: getattr(tc, f.name) for f in dataclasses.fields(TrainConfig)}
        fields.update(overrides)
        rank_opts = ("ratio", "ff_ratio", "ff_rank", "res_ratio", "budget")
        if any(k in overrides for k in rank_opts):
            for k in rank_opts:                      # the overrides say everything about ranks
                fields[k] = overrides.get(k)
            if fields["budget"] is not None:         # a budget allocates ranks itself: it wins over ratios
                fields.update(ratio=None, ff_ratio=None, ff_rank=None, res_ratio=None)
        if isinstance(fields.get("device"), torch.device):
            fields["device"] = str(fields["device"])
        tc = TrainConfig(**fields)
    if steps is not None:
        tc = tc.with_steps(int(steps))
    out_path = out_path if out_path is not None else out
    if out_path is None:
        raise ValueError("train_adapters needs out_path (the adapter file to write)")
    if contexts is not None and calib is None:
        calib = cal.Calibration.from_contexts(contexts)
    weights, cfg = teacher_weights(unet, cfg)
    return execute(Session(weights, cfg, tc, calib, out_path, progress, resume, overwrite))
