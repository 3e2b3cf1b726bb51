"""The GPU suite's trainer parts: ``train_adapters`` on CUDA with a random full-size teacher, every phase reached.

Per family, in one part:

1. the trainer's plan (``train.recipes.plan_ladder``: one warm-up on this GPU, the quick and full recipes priced
   from it) and, beside it on the CPU, its 8 GB check (``train.device_fit``: the fewest stage-2 groups whose
   predicted device peak fits 8 GiB, from the VRAM estimator with the caching-allocator model and the context the
   environment part measured);
2. a run at tiny step counts with the default recipe's ranks (SD1.5: the anchored allocation at ratio 0.5, as by
   default; SDXL: every site at uniform 0.5, the same parameter count without the allocation's ~100 extra UNet
   forwards) and the stage-2 groups of step 1, under an 8 GiB device limit (with the teacher offloaded where
   step 1 says only that fits: SDXL), or where step 1 says the run does not fit 8 GiB either way, the device size
   it names (:func:`run_device`; ``torch.cuda.set_per_process_memory_fraction`` at that
   size less the measured context: the allocator then frees and fails as on a card of that size); per phase
   torch's allocated/reserved peak and the derived device peak (reserved + context), steps/s of both stages, next to the prediction of step 1 and the plan's step costs.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from pathlib import Path

import torch

from gpu_parts import GIB, Context, unet_config
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.train import Calibration, TrainConfig, train_adapters
from sdslim_core.train import recipes
from sdslim_core.train.device_fit import checked
from sdslim_core.train.plan import warm_ranks
from sdslim_core.train.ranks import RECORD_ERRORS, read_allocation
from sdslim_core.train.session import Session
from sdslim_core.train.teacher import teacher_weights
from sdslim_core.train.workdir import RANKS
from sdslim_core.vram.allocator import DEFAULT_CONTEXT_GIB
from sdslim_core.vram.live import measure_peak

DEVICE_GIB = 8.0


def run_config(family: str, dry: bool, work, log, groups: int, offload: bool = False) -> TrainConfig:
    """The run: small data and step counts, cheap init methods (the allocation and every phase still run), the
    trainer's CUDA defaults otherwise (fp16 teacher, bf16 autocast, 8-bit AdamW when bitsandbytes imports,
    gradient checkpointing)."""
    size = dict(n_trajectories=4, sample_steps=2, ff_inputs=16, tokens_per_sample=32, ff_tokens=512, res_maps=16,
                latent_size=8, stage1_steps=2, stage2_steps=6, alloc_inputs=8) if dry else \
        dict(n_trajectories=4, sample_steps=3, ff_inputs=16, tokens_per_sample=64, ff_tokens=2048, res_maps=12,
             stage1_steps=2, stage2_steps=12, alloc_inputs=8)
    ranks = dict(ratio=0.5) if family == "sd15" else dict(ratio=0.5, uniform=True)
    return TrainConfig(**size, **ranks, init_methods=("act_select", "select"), stage2_groups=groups, guidance=7.5,
                       offload_teacher=offload,
                       checkpoint_every=1000, vram_estimate=False, plan=False, device="cpu" if dry else "cuda",
                       work_dir=str(work / f"train-{family}"), log=log, seed=0)


class PhasePeaks:
    """torch's allocated/reserved peak per phase of the run (cut at the first progress call of the next phase, so
    a phase's first unit counts with the one before), NVML's reading at each cut, and step times per stage."""

    def __init__(self, cuda: bool):
        self.cuda, self.phase, self.gib, self.steps = cuda, "setup", {}, {}

    def cut(self, next_phase: str):
        if self.cuda:
            from sdslim_core.vram.live import device_used
            torch.cuda.synchronize()
            used = device_used(0)
            now = {"allocated": torch.cuda.max_memory_allocated() / GIB,
                   "reserved": torch.cuda.max_memory_reserved() / GIB,
                   "nvml_at_end": None if used is None else used / GIB}
            before = self.gib.get(self.phase, {})         # a phase met again (e.g. "stage 1" and its steps)
            self.gib[self.phase] = {k: max(v, before.get(k) or v) if v is not None else before.get(k)
                                    for k, v in now.items()}
            torch.cuda.reset_peak_memory_stats()
        self.phase = next_phase

    def __call__(self, done, total, info):
        label = info["stage"] if isinstance(info["stage"], str) else f"stage{info['stage']}"
        label = label.replace("stage ", "stage")
        if label != self.phase:
            self.cut(label)
        if "of" not in info:
            self.steps.setdefault(label, []).append(time.perf_counter())


def _rate(times: list) -> float | None:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 and times[-1] > times[0] else None


def trainer(ctx: Context, family: str) -> dict:
    cuda = ctx.device == "cuda"
    cfg = unet_config(family, ctx.dry)
    context = ctx.context_gib() if cuda else None
    torch.manual_seed(0)   # built on the device (fast init), then handed over on the CPU as a user's model is
    unet = build_diffusers_unet(cfg, device=ctx.device, dtype=torch.float16 if cuda else torch.float32)
    unet = unet.to("cpu").eval()
    g = torch.Generator().manual_seed(1)
    pooled = {"pooled": torch.randn(4, cfg.adm_in_channels - 6 * 256, generator=g)} if cfg.adm_in_channels else {}
    calib = Calibration.from_contexts(torch.randn(4, 77, cfg.context_dim, generator=g), **pooled)
    out = {"family": family, "context_gib": context}

    # 1. the plan, with the 8 GB check beside it on the CPU
    weights, _ = teacher_weights(unet, cfg)
    # on CUDA one stage-2 group and the teacher on the device, what auto gives on a large GPU, without its estimator
    # run inside this part's cap
    dev = dict(device=ctx.device, stage2_groups=1, offload_teacher=False) if not ctx.dry else \
        dict(device="cpu", latent_size=8, n_trajectories=4, sample_steps=2, ff_tokens=512, res_maps=16)
    full = TrainConfig(**dev, log=ctx.log)
    variants = {"quick": TrainConfig(**{**dev, **recipes.settings("quick")}, log=ctx.log), "full": full}
    session = Session(weights, cfg, full, calib, ctx.work / f"plan-{family}.safetensors", None, False)
    fit = {}
    fit_thread = threading.Thread(target=lambda: fit.update(_fit(session, context)), daemon=True)
    fit_thread.start()
    t0 = time.time()
    ladder = recipes.plan_ladder(session, variants)
    w = ladder.plans["full"].warmup
    out["plan"] = {"seconds": time.time() - t0, "eta_s": {n: p.eta_s for n, p in ladder.plans.items()},
                   "phases": {n: {ph.name: ph.seconds for ph in p.phases} for n, p in ladder.plans.items()},
                   "stage2_step_s": w["stage2_step_s"],
                   "stage1_step_s_median": _median(list(w["stage1_step_s"].values())),
                   "text": ladder.text()}
    if family == "sd15" and cuda:
        out["offload_cost"] = offload_cost(session)
    ctx.partial(out)
    fit_thread.join(timeout=max(1.0, ctx.remaining() - 30))
    out["fit_8gb"] = {k: v for k, v in fit.items() if k != "raw"} or {"error": "the 8 GB check did not finish"}
    session.placement.release()
    del session
    ctx.partial(out)

    # 2. the run, under the device limit the check names
    device_gib, groups, offload = run_device(fit, family)
    tc = run_config(family, ctx.dry, ctx.work, ctx.log, groups, offload)
    peaks = PhasePeaks(cuda)
    limit = None
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        limit = device_gib * GIB - (context if context is not None else DEFAULT_CONTEXT_GIB) * GIB
        torch.cuda.set_per_process_memory_fraction(limit / total)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    out["run"] = {"stage2_groups": groups, "offload_teacher": offload, "device_gib": device_gib,
                  "limit_gib": None if limit is None else limit / GIB,
                  "config": {k: getattr(tc, k) for k in ("ratio", "uniform", "stage1_steps", "stage2_steps",
                                                         "n_trajectories", "sample_steps", "init_methods",
                                                         "alloc_inputs")}}
    t0 = time.time()

    def save():
        ctx.partial(dict(out, run=dict(out["run"], phases_gib=dict(peaks.gib), wall_s=time.time() - t0)))

    def progress(done, total, info):
        peaks(done, total, info)
        if family == "sd15" and out.get("ranks") is None and peaks.phase not in EARLY_PHASES:
            out["ranks"] = allocation(tc.work_dir)          # for the speed part, even if the cap stops this run
            if out["ranks"]:
                save()
        if "of" not in info and done % 5 == 0:
            save()
    try:
        with measure_peak(ctx.device) as monitor:
            result = train_adapters(unet, cfg, calib, tc, ctx.work / f"adapters-{family}.safetensors",
                                    progress=progress)
        peaks.cut("end")
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    run = out["run"]
    rep = result.report.to_dict()
    run.update(wall_s=time.time() - t0, phases_gib=peaks.gib, timing=rep["timing"], unet_error=rep["unet_error"],
               sites=len(result.adapters.sites),
               steps_per_s={k: _rate(v) for k, v in peaks.steps.items()},
               finite_adapters=all(bool(torch.isfinite(t).all()) for site in result.adapters.sites.values()
                                   for t in site.values()),
               device_peak_nvml_gib=None if monitor.result.device_peak_used_bytes is None
               else monitor.result.device_peak_used_bytes / GIB)
    if family == "sd15":
        out["ranks"] = dict(result.adapters.ranks())
    if cuda and context is not None:
        run["device_derived_gib"] = {k: v["reserved"] + context for k, v in peaks.gib.items()}
        run["fits_device"] = max(run["device_derived_gib"].values()) <= device_gib
    s1, s2 = run["steps_per_s"].get("stage1"), run["steps_per_s"].get("stage2")
    run["plan_vs_measured"] = {"stage1_step_s": [out["plan"]["stage1_step_s_median"], 1 / s1 if s1 else None],
                               "stage2_step_s": [out["plan"]["stage2_step_s"], 1 / s2 if s2 else None]}
    if not cuda:
        out["skipped"] = ["dry run: no CUDA allocator counters or device limit on the CPU (phase peaks n/a)"]
    return out


EARLY_PHASES = ("setup", "calibration", "capture", "rank curves")      # the phases before ranks.json exists


def allocation(work_dir) -> dict | None:
    """The ranks a run allocated, from its work folder's ``ranks.json`` (written when the allocation ends)."""
    try:
        return read_allocation(Path(work_dir) / RANKS)[0]
    except RECORD_ERRORS:
        return None


def run_device(fit: dict, family: str) -> tuple[float, int, bool]:
    """(device GiB, stage-2 groups, teacher offloaded) the run is limited to: 8 GiB and the check's groups where it
    fits, with the teacher on the device or else offloaded; else the device the check says the run needs with the
    teacher on it, with 0.5 GiB to spare, rounded up to a whole GiB, and its groups; 8 GiB and a default split when
    the check gave nothing."""
    if fit.get("groups"):
        return DEVICE_GIB, fit["groups"], False
    if (fit.get("offloaded") or {}).get("groups"):
        return DEVICE_GIB, fit["offloaded"]["groups"], True
    if fit.get("needs_gib"):
        return float(math.ceil(fit["needs_gib"] + 0.5)), fit["needs_groups"], False
    return DEVICE_GIB, 3 if family == "sdxl" else 1, False


def offload_cost(session) -> dict:
    """What ``--offload-teacher`` costs on this GPU: seconds of a no-grad teacher forward at batch 8 and of one
    stage-2 step (every site trained, the warm-up's ranks, gradient checkpointing) with the teacher on the device and
    offloaded, the same session and inputs (the plan's own timers: a GPU call is timed on its second run)."""
    from sdslim_core.train import plan
    ranks = warm_ranks(session)
    out = {}
    for where, offloaded in (("on_device", False), ("offloaded", True)):
        g = torch.Generator().manual_seed(0)
        inputs = plan._random_inputs(session, 8, g)
        session.placement.set_offload(offloaded)
        teacher = session.placement.on_device()

        def forward():
            with torch.no_grad(), session.amp():
                plan.unet_call(teacher, inputs)
            plan._sync(session.device)
        out[where] = {"forward_batch8_s": plan._timed(forward, session.device),
                      "stage2_step_s": plan._stage2_step(session, ranks, 1, g)}
        session.placement.release()
    session.placement.set_offload(False)
    out["ratio"] = {k: out["offloaded"][k] / out["on_device"][k] for k in out["on_device"]}
    return out


def _median(xs):
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    return xs[len(xs) // 2] if xs else None


def _fit(session, context):
    """The 8 GB check for both placements (the plan's session keeps the teacher on this large GPU)."""
    view = copy.copy(session)
    view.tc = dataclasses.replace(session.tc, offload_teacher="auto")
    try:
        return checked(view, warm_ranks(session), DEVICE_GIB, context)
    except Exception as err:  # recorded; the run goes on with the default groups
        return {"error": f"{type(err).__name__}: {err}"}

