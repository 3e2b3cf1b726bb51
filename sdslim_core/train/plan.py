"""What a training run will cost, said before it starts: UNet forwards and backwards per phase, the work folder's
size, and an ETA from a short warm-up on the run's own device.

Counts follow the settings exactly where the phases are fixed by them (trajectories, rank-curve measurements,
held-out evaluations, optimizer steps) and approximately where random subsets overlap (the capture's inputs).
The warm-up runs, on random inputs of the run's shapes: one teacher forward at batch 8 (with hooks recording
each site's input shape), one stage-2 step (the UNet with train-time adapters at uniform ``ratio`` on the sites
of the largest group stage 2 trains at once, with its gradient checkpointing: forward, backward, AdamW), one
stage-1 step for each distinct site shape, and for the narrowest and the (lower) median
site of each kind the site-local work the phases repeat per site (reading its data, the OBS order, the
initialisation methods, a rank curve's scoring), extrapolated to wider sites by the power law through the two.
A held-out scoring of a site during a fit costs a third of a step per batch of held-out data. The counts assume
every site is slimmed; an allocation that leaves sites at full width trains fewer.

On a CPU the warm-up first says what RAM it needs (:mod:`.memory`) next to what is free: when its stage-2 step
does not fit it measures the step at one input and scales it, or leaves stage 2 unpriced, and it refuses (an
error saying both numbers) when not even a forward fits. :func:`price` prices other settings (the recipes of
:mod:`.recipes`, side by side) from the same warm-up.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..io.adapters import AdapterSet
from ..io.files import format_bytes
from ..layout import rank_policy
from ..modules import swap
from .calibration import _store_dtype, unet_call
from .device_fit import place_teacher
from .fit import eval_interval
from .memory import available_ram, gib, ram_need
from .ranks import adapter_param_count
from .sites import call_site
from .stage2 import largest_group, resolve_groups

if TYPE_CHECKING:
    from .session import Session

BATCH = 8                    # the batch of every held-out / capture / rank-curve UNet call
SCORE_PASS = 1 / 3           # a forward-only scoring batch, in stage-1-step equivalents


@dataclasses.dataclass
class Phase:
    """One phase: ``units`` of ``unit``, the UNet forwards/backwards it runs (per input) and its estimated seconds."""
    name: str
    units: int
    unit: str
    forwards: int = 0
    backwards: int = 0
    seconds: float = 0.0


@dataclasses.dataclass
class Plan:
    """The phases of a run, its work folder's size and what the warm-up measured."""
    phases: list
    work_bytes: int
    warmup: dict
    ram_bytes: int | None = None          # the run's RAM peak (CPU runs), from :mod:`.memory`

    @property
    def eta_s(self) -> float:
        return sum(p.seconds for p in self.phases)

    def to_dict(self) -> dict:
        def num(v):
            return None if isinstance(v, float) and math.isnan(v) else v
        return {"phases": [{k: num(v) for k, v in dataclasses.asdict(p).items()} for p in self.phases],
                "work_bytes": self.work_bytes, "eta_s": num(self.eta_s), "ram_bytes": self.ram_bytes,
                "warmup": dict(self.warmup)}

    def text(self) -> str:
        lines = ["plan (UNet forwards / backwards per input, from a warm-up on this device):"]
        for p in self.phases:
            fb = f"{p.forwards:,} fwd" + (f" + {p.backwards:,} bwd" if p.backwards else "") if p.forwards else "local"
            lines.append(f"  {p.name:<16} {p.units:>7,} {p.unit:<6} {fb:<24} ~{duration(p.seconds)}")
        ram = f"RAM ~{gib(self.ram_bytes)}; " if self.ram_bytes else ""
        lines.append(f"  work folder ~{format_bytes(self.work_bytes)}; {ram}ETA ~{duration(self.eta_s)} "
                     f"(warm-up {self.warmup['seconds']:.1f} s; counted with every site slimmed: an allocation that "
                     "leaves sites at full width trains fewer, and the stages are re-estimated once it has)")
        return "\n".join(lines)


def duration(s: float) -> str:
    if math.isnan(s):
        return "? (not measured)"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


# ------------------------------------------------------------------------------------------------ counting

@dataclasses.dataclass(frozen=True)
class Inputs:
    """The calibration bank a run will record: inputs, held-out inputs, inputs per UNet call, CFG."""
    n: int
    n_eval: int
    call_batch: int
    cfg: bool


def bank_size(session: "Session") -> Inputs:
    tc, calib = session.tc, session.calib
    cfg = calib.contexts is not None and calib.latents is None and tc.guidance != 1.0
    mult = 2 if cfg else 1
    if calib.latents is None:
        n, groups, per_group = tc.n_trajectories * tc.sample_steps * mult, tc.n_trajectories, tc.sample_steps * mult
        call = min(4, tc.n_trajectories) * mult
    else:
        m = calib.latents.shape[0]
        n = tc.n_noised
        groups = m if m > 1 else n
        per_group, call = n / groups, 8
    held = min(max(1, round(groups * tc.eval_fraction)), max(1, groups - 1))
    return Inputs(n, max(1, int(held * per_group)), call, cfg)


def _capture_inputs(tc, n: int) -> int:
    """Expected size of the union of the FF and Res capture subsets (drawn independently)."""
    n_ff, n_res = max(2, min(n, tc.ff_inputs)), min(n, tc.res_maps)
    return int(round(min(n, n_ff + n_res - n_ff * n_res / max(n, 1))))


def _stage2_inputs(session: "Session", bank: Inputs) -> int:
    tc = session.tc
    return tc.stage2_batch * (2 if tc.guided_loss and tc.guidance != 1.0 and bank.cfg else 1)


def _curve_measurements(session: "Session") -> tuple[int, int]:
    """(sites with a rank curve, whole-UNet measurements per site) of the rank-allocation phase."""
    tc = session.tc
    if not tc.allocates():
        return 0, 0
    from .ranks import rank_grid
    fractions = tuple(tc.rank_grid) + ((tc.ratio,) if tc.ratio is not None else ())
    grids = [rank_grid(s, fractions) for s in session.site_list]
    sites = sum(1 for g in grids if g)
    per = {"e2e": max((len(g) for g in grids), default=0), "anchored": tc.alloc_anchors, "site": 0}[tc.allocation]
    return sites, per


def work_folder_bytes(session: "Session", bank: Inputs) -> int:
    """Bytes the work folder will hold at its largest: the input bank, the captured activations (per-site token
    counts from the warm-up's shapes), the init, stage-1 and stage-2 adapter files and the optimizer checkpoints of
    the largest stage-2 group (adapters at uniform ``ratio``; an allocation that leaves sites at full width stores
    less)."""
    tc, cfg = session.tc, session.cfg
    dt = _store_dtype(tc.calib_dtype, session.teacher_dtype).itemsize
    latent = cfg.in_channels * session.latent_size ** 2
    contexts = (session.calib.contexts.shape[0] if session.calib.contexts is not None else 1) + 1
    out = bank.n * (2 * latent * 4 + 21) + contexts * 77 * cfg.context_dim * 4
    n_ff = max(2, min(bank.n, tc.ff_inputs))
    tokens = session.plan_tokens or {}
    for s in session.site_list:
        if s.kind == "ff":
            per_input = min(tc.tokens_per_sample, tokens.get(s.name, tc.tokens_per_sample), -(-tc.ff_tokens // n_ff))
            out += n_ff * per_input * s.in_dim * dt
        else:
            out += min(tc.res_maps, bank.n) * (s.in_dim * tokens.get(s.name, session.latent_size ** 2) + s.emb_dim) * dt
    ranks = rank_policy.ranks_for_ratio(session.site_list, tc.ratio or 0.5)
    n_groups = resolve_groups(session, ranks)
    group = set(largest_group(session, ranks, n_groups))
    adapter = 4 * adapter_param_count(session.site_list, ranks)
    out += adapter * 3                                        # init, stage1 and stage2/ (the per-site files go)
    # stage 2 checkpoints every `checkpoint_every` steps and at each group's end, the newest `keep_checkpoints`
    # kept, each one group's adapters, best adapters and two AdamW moments (a stage-1 one holds one site)
    kept = min(tc.keep_checkpoints, tc.stage2_steps // tc.checkpoint_every + n_groups) if tc.stage2_steps else 0
    out += 4 * 4 * adapter_param_count([s for s in session.site_list if s.name in group], ranks) * kept
    return int(out)


# how a site-local cost grows with the site's width when two widths were not measured: the OBS order and
# the covariances' eigendecompositions are cubic, reading the data and the least-squares fits about quadratic
DEFAULT_EXPONENT = {"order_s": 3.0, "data_s": 2.0, "curve_s": 2.0, "init_s": 2.5}


def site_local_cost(local: dict, site, what: str) -> float:
    """Seconds of site-local work ``what`` at ``site``, from the warm-up's measured sites of its kind (two widths:
    the power law through them, exponent clamped to [1, 3.5]; one: :data:`DEFAULT_EXPONENT`)."""
    measured = local[site.kind]
    ref = measured[-1]
    if len(measured) == 2 and measured[0][what] > 0 and ref[what] > 0 and ref["width"] != measured[0]["width"]:
        p = math.log(ref[what] / measured[0][what]) / math.log(ref["width"] / measured[0]["width"])
        p = min(3.5, max(1.0, p))
    else:
        p = DEFAULT_EXPONENT[what]
    return ref[what] * (site.width / ref["width"]) ** p


def _evaluations(steps: int) -> int:
    """Held-out evaluations of a fit of ``steps`` steps (before the first step, then every interval and at the end)."""
    return 1 + math.ceil(steps / eval_interval(steps)) if steps else 0


# ------------------------------------------------------------------------------------------------ warm-up

def _random_inputs(session: "Session", n: int, g: torch.Generator) -> dict:
    cfg = session.cfg
    size = session.latent_size
    out = {"sample": torch.randn(n, cfg.in_channels, size, size, generator=g),
           "timestep": torch.randint(1, 999, (n,), generator=g).float(),
           "encoder_hidden_states": torch.randn(n, 77, cfg.context_dim, generator=g)}
    if cfg.adm_in_channels:
        px = float(size * 8)
        out["added_cond_kwargs"] = {"text_embeds": torch.randn(n, cfg.adm_in_channels - 6 * 256, generator=g),
                                    "time_ids": torch.tensor([[px, px, 0, 0, px, px]]).repeat(n, 1)}
    dev, dt = session.device, session.compute_dtype

    def mv(t):
        return t.to(dev, dt) if t.is_floating_point() else t.to(dev)
    out = {k: ({kk: mv(vv) for kk, vv in v.items()} if isinstance(v, dict) else mv(v)) for k, v in out.items()}
    out["timestep"] = out["timestep"].to(dev)
    return out


def _timed(fn, device: torch.device, repeat_below: float = 2.0) -> float:
    """Seconds of ``fn()``: a second run when the first (which pays for allocations) was quick, and always on a GPU,
    whose first call also loads its kernels and picks their algorithms (seconds no later step pays: the first GPU
    run priced a stage-2 step of SD1.5 at 12.6 s from it)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first >= repeat_below and device.type == "cpu":
        return first
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PlanMemoryError(MemoryError):
    """The warm-up cannot run in this machine's free RAM (the message says how much it needs and has)."""


def warm_ranks(session: "Session") -> dict:
    """The ranks the warm-up measures at: the ``--from`` file's, else every site at uniform ``ratio``."""
    if session.base is not None:
        return dict(session.base.ranks())
    return rank_policy.ranks_for_ratio(session.site_list, session.tc.ratio or 0.5)


def fit_in_ram(session: "Session", ranks: dict, stage2_inputs: int) -> int:
    """The inputs the warm-up's stage-2 step can take in this machine's free RAM (said up front): all of them,
    one (the step is then scaled), or 0 (stage 2 stays unpriced); raises :class:`PlanMemoryError` when not even a
    forward fits. Accelerators: all (their memory is the VRAM estimator's)."""
    if session.device.type != "cpu":
        return stage2_inputs
    group = largest_group(session, ranks, resolve_groups(session, ranks))
    need = ram_need(session, adapter_param_count([session.site_by_name[s] for s in group], ranks))
    free = available_ram()
    step = f"one stage-2 step at {stage2_inputs} input(s), " if stage2_inputs else ""
    session.say(f"warm-up: a teacher forward at batch 8, {step}one stage-1 step per site shape and the per-site "
                f"work on 2 sites of each kind, on random inputs; RAM beyond the loaded teacher "
                f"({gib(need.teacher)}): ~{gib(need.warm_up(stage2_inputs))}, {gib(free)} free")
    if need.warm_up(stage2_inputs) <= free:
        return stage2_inputs
    if stage2_inputs > 1 and need.warm_up(1) <= free:
        session.say(f"warm-up: shrunk to fit the free RAM: the stage-2 step is measured at 1 input "
                    f"(~{gib(need.warm_up(1))}) and scaled to {stage2_inputs}")
        return 1
    if need.forward <= free:
        session.say(f"warm-up: one stage-2 step needs ~{gib(need.warm_up(1))} of RAM and {gib(free)} is free: "
                    "stage 2 is left unpriced (it would not train here as it stands: free memory, or train with "
                    "--stage2-groups N; --recipe quick needs no stage 2)")
        return 0
    raise PlanMemoryError(f"the plan's warm-up needs ~{gib(need.forward)} of free RAM for one teacher forward at "
                          f"batch 8 beyond the loaded teacher ({gib(need.teacher)}), and {gib(free)} is free: "
                          "close other programs or use a machine with more memory (--no-plan skips the plan; "
                          "the run itself needs at least as much)")


def warm_up(session: "Session", stage2_inputs: int) -> dict:
    """Measured unit costs on random inputs of the run's shapes (see the module docstring), with a progress line
    per part on the session's bars."""
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    ranks = warm_ranks(session)
    place_teacher(session, ranks)
    if not session.tc.stage2_steps:                  # a run without stage 2 (quick) needs no stage-2 step
        stage2_inputs = 0
    measured_inputs = fit_in_ram(session, ranks, stage2_inputs)
    progress = session.progress
    progress.start_stage("warm-up", None, unit="part")
    done = [0]

    def tick(what: str, total: int | None = None):
        done[0] += 1
        progress.advance(done[0], total, note=what)
    teacher = session.placement.on_device()
    shapes, hooks = {}, []
    for s in session.site_list:
        mod = teacher.get_submodule(swap.site_path(teacher, s.name, session.cfg))

        def hook(module, args, kwargs, _name=s.name):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_tensor"))
            shapes[_name] = tuple(x.shape[1:])
        hooks.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    inputs = _random_inputs(session, BATCH, g)
    try:
        with torch.no_grad():
            def forward():
                with session.amp():
                    unet_call(teacher, inputs)
                _sync(session.device)
            t_fwd = _timed(forward, session.device)
    finally:
        for h in hooks:
            h.remove()
    session.plan_tokens = {k: math.prod(v[1:]) if len(v) == 3 else v[0] for k, v in shapes.items()}  # H·W
    local_sites = {}
    for kind in ("ff", "res"):
        of_kind = sorted((s for s in session.site_list if s.kind == kind and s.name in ranks),
                         key=lambda s: s.width)
        if of_kind:
            low, mid = of_kind[0], of_kind[(len(of_kind) - 1) // 2]
            local_sites[kind] = list({low.name: low, mid.name: mid}.values())
    total = 2 + len(set(_step1_keys(session, ranks, shapes).values())) + sum(len(v) for v in local_sites.values())
    tick("teacher forward at batch 8", total)
    t_step2, t_step1 = _train_steps(session, ranks, stage2_inputs, shapes, g, measured_inputs, tick)
    site_local = {}
    for kind, sites in local_sites.items():
        site_local[kind] = []
        for site in sites:
            site_local[kind].append(_site_init(session, site, shapes, g))
            tick(f"{kind} site {site.width} wide: data, init, rank curve")
    progress.end_stage()
    session.placement.release()
    session.free_device_memory()
    return {"forward_batch8_s": t_fwd, "stage2_step_s": t_step2, "stage2_inputs_measured": measured_inputs,
            "stage1_step_s": t_step1, "site": site_local,
            "shapes": {k: list(v) for k, v in shapes.items()}, "seconds": time.perf_counter() - t_start}


def _step1_keys(session: "Session", ranks: dict, shapes: dict) -> dict:
    """{site: the key of its stage-1 step's cost} (sites of one key cost the same)."""
    return {s.name: (s.kind, s.width, s.in_dim, s.out_dim, shapes.get(s.name), ranks[s.name])
            for s in session.site_list if s.name in ranks}


def _train_steps(session: "Session", ranks: dict, stage2_inputs: int, shapes: dict, g, measured_inputs: int,
                 tick=None) -> tuple[float, dict]:
    """(seconds of one stage-2 step, {site: seconds of one stage-1 step}) at ``ranks``. The stage-2 step trains
    the largest of the groups stage 2 will train in (every site when it trains them at once), with the run's
    gradient checkpointing, so that the warm-up needs no more memory than the run; it runs at
    ``measured_inputs`` of the ``stage2_inputs`` and is scaled to them (0: not run, NaN seconds). ``tick(what)``
    after each part."""
    tick = tick or (lambda what: None)
    if not measured_inputs:
        t_step2 = math.nan
        tick("stage-2 step: skipped (RAM)" if stage2_inputs else "no stage 2")
    else:
        t_step2 = _stage2_step(session, ranks, measured_inputs, g) * stage2_inputs / measured_inputs
        tick(f"stage-2 step at {measured_inputs} input(s)")
    t_step1, seen = {}, {}
    for name, key in _step1_keys(session, ranks, shapes).items():
        if key not in seen:
            s = session.site_by_name[name]
            one = AdapterSet.shaped_like(session.shapes, session.cfg.family, 0.5, {name: ranks[name]})
            seen[key] = _site_step(session, one, s, shapes.get(name), g)
            tick(f"stage-1 step, {s.kind} site {s.width} wide")
        t_step1[name] = seen[key]
    return t_step2, t_step1


def _stage2_step(session: "Session", ranks: dict, stage2_inputs: int, g) -> float:
    """Seconds of one stage-2 step at ``stage2_inputs`` inputs (see :func:`_train_steps`)."""
    n_groups = resolve_groups(session, ranks)
    group = largest_group(session, ranks, n_groups)
    teacher = session.placement.on_device()
    aset = AdapterSet.shaped_like(session.shapes, session.cfg.family, 0.5, {s: ranks[s] for s in group})
    student, adapters = swap.attach_train_adapters(teacher, aset)
    if session.use_grad_ckpt(n_groups) and hasattr(student, "enable_gradient_checkpointing"):
        student.enable_gradient_checkpointing()
    params = [p for a in adapters.values() for p in a.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-6)
    batch2 = {k: (v[:stage2_inputs] if torch.is_tensor(v) else {kk: vv[:stage2_inputs] for kk, vv in v.items()})
              for k, v in _random_inputs(session, max(stage2_inputs, 1), g).items()}

    def step2():
        with session.amp():
            out = unet_call(student.train(), batch2)
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(session.device)
    return _timed(step2, session.device)


def _site_init(session: "Session", site, shapes: dict, g) -> dict:
    """Seconds of the site-local work the phases repeat per site, measured on one site with random data of the
    run's size: reading its data and statistics (``data_s``: the teacher site's outputs, the activation
    covariances), the OBS removal order (``order_s``: once per run; 0 when ``obs`` is not an init method), a rank
    curve's local scoring (``curve_s``) and the initialisation (``init_s``: every method at the uniform rank;
    ``init_method_s``: each one's seconds)."""
    from .init import SiteInit
    from .ranks import rank_grid
    from .sites import SiteData
    tc = session.tc
    bank = bank_size(session)
    shape = shapes.get(site.name)
    if site.kind == "ff":
        n_ff = max(2, min(bank.n, tc.ff_inputs))
        n = min(tc.ff_tokens, n_ff * min(tc.tokens_per_sample, shape[0] if shape else tc.tokens_per_sample))
        data = {"x": torch.randn(n, site.in_dim, generator=g)}
    else:
        n = min(tc.res_maps, bank.n)
        spatial = shape[1:] if shape else (session.latent_size, session.latent_size)
        data = {"x": torch.randn(n, site.in_dim, *spatial, generator=g), "emb": torch.randn(n, site.emb_dim,
                                                                                            generator=g)}
    n_eval = max(1, round(n * tc.eval_fraction))
    fit = {k: v[n_eval:] for k, v in data.items()}
    ev = {k: v[:n_eval] for k, v in data.items()}
    teacher_site = session.placement.site_on_device(site.name)
    t0 = time.perf_counter()
    site_data = SiteData(site.name, site.kind, fit, ev, teacher_site, session.device, session.compute_dtype,
                         session.amp, batch=4096 if site.kind == "ff" else 8)
    t_data = time.perf_counter() - t0
    si = SiteInit(site, teacher_site, session.naming, site_data, session.weights, session.cfg.family,
                  session.device, session.compute_dtype, session.amp, seed=tc.seed)
    rank = rank_policy.rank_for_ratio(site.width, tc.ratio or 0.5, site.kind)
    t0 = time.perf_counter()
    si.stats
    t_stats = time.perf_counter() - t0
    t_order = 0.0
    if "obs" in tc.init_methods:                         # the OBS removal order (kept for the rest of the run)
        t0 = time.perf_counter()
        si.tensors("obs", rank)
        t_order = time.perf_counter() - t0
    fractions = tuple(tc.rank_grid) + ((tc.ratio,) if tc.ratio is not None else ())
    t0 = time.perf_counter()
    si.curve(rank_grid(site, fractions), tc.init_methods[0])
    t_curve = time.perf_counter() - t0
    methods = {}
    for method in tc.init_methods:                       # each method on its own: recipes measure fewer
        t0 = time.perf_counter()
        si.best(rank, (method,))
        methods[method] = time.perf_counter() - t0
    return {"site": site.name, "width": site.width, "data_s": t_data + t_stats, "order_s": t_order,
            "curve_s": t_curve, "init_s": sum(methods.values()), "init_method_s": methods}


def _site_step(session: "Session", aset: AdapterSet, site, shape, g) -> float:
    """Seconds of one stage-1 step of ``site`` (forward, backward, AdamW) on random data of its captured shape."""
    tc = session.tc
    teacher_site = session.placement.site_on_device(site.name)
    student, adapter = swap.train_site(teacher_site, site.name, site.kind, session.naming, aset.sites[site.name],
                                       aset.groups(site.name))
    opt = torch.optim.AdamW(list(adapter.parameters()), lr=1e-6)
    dev, dt = session.device, session.compute_dtype
    if site.kind == "ff":
        x, emb = torch.randn(tc.ff_batch_tokens, site.in_dim, generator=g).to(dev, dt), None
    else:
        spatial = shape[1:] if shape else (session.latent_size, session.latent_size)
        x = torch.randn(tc.res_batch, site.in_dim, *spatial, generator=g).to(dev, dt)
        emb = torch.randn(tc.res_batch, site.emb_dim, generator=g).to(dev, dt)

    def step():
        with session.amp():
            out = call_site(student, site.kind, x, emb)
        F.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float32)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
    return _timed(step, session.device, repeat_below=0.5)


# ------------------------------------------------------------------------------------------------- the plan

def make_plan(session: "Session") -> Plan:
    """Count the run's phases, warm up on its device and estimate each phase's seconds (every site slimmed at
    uniform ``ratio``)."""
    w = warm_up(session, _stage2_inputs(session, bank_size(session)))
    return price(session, session.tc, w)


def price(session: "Session", tc, w: dict) -> Plan:
    """The plan of ``session``'s run with the settings ``tc`` instead of its own, from the warm-up ``w`` (same
    model, device and calibration source; ``tc`` may change the counts, not the shapes)."""
    view = copy.copy(session)
    view.tc = tc
    bank = bank_size(view)
    b2 = _stage2_inputs(view, bank)
    work = work_folder_bytes(view, bank)
    w = _for_methods(w, tc.init_methods)
    ram = None
    if session.device.type == "cpu":
        ranks = warm_ranks(view)
        group = largest_group(view, ranks, resolve_groups(view, ranks))
        need = ram_need(view, adapter_param_count([session.site_by_name[s] for s in group], ranks))
        ram = need.run(b2 if tc.stage2_steps else 0, min(int(tc.ram_budget_gb * 1e9), work))
    return Plan(_phases(view, w, bank, b2), work, w, ram)


def replan(session: "Session", plan: Plan, ranks: dict) -> Plan:
    """``plan`` for the ranks the allocation chose: the training steps measured again for those sites and ranks
    (one stage-2 step, one stage-1 step per distinct site shape); the rest as warmed up before."""
    bank = bank_size(session)
    b2 = _stage2_inputs(session, bank)
    shapes = {k: tuple(v) for k, v in plan.warmup["shapes"].items()}
    t0 = time.perf_counter()
    t_step2, t_step1 = _train_steps(session, ranks, b2, shapes, torch.Generator().manual_seed(1),
                                    plan.warmup["stage2_inputs_measured"])
    session.placement.release()
    w = dict(plan.warmup, stage2_step_s=t_step2, stage1_step_s=t_step1,
             seconds=plan.warmup["seconds"] + time.perf_counter() - t0)
    return Plan(_phases(session, w, bank, b2), plan.work_bytes, w)


def _for_methods(w: dict, methods) -> dict:
    """The warm-up ``w`` with each measured site's ``init_s`` the sum over ``methods`` (those it measured)."""
    site = {kind: [dict(m, init_s=sum(t for k, t in m["init_method_s"].items() if k in methods))
                   if set(methods) <= set(m.get("init_method_s", {})) else m for m in entries]
            for kind, entries in w["site"].items()}
    return dict(w, site=site)


def _phases(session: "Session", w: dict, bank: Inputs, b2: int) -> list[Phase]:
    tc = session.tc
    per_input = w["forward_batch8_s"] / BATCH
    step1 = w["stage1_step_s"]
    n_sites = len(step1)
    ff_eval = tc.ff_tokens * tc.eval_fraction / tc.ff_batch_tokens
    res_eval = tc.res_maps * tc.eval_fraction / tc.res_batch
    score = {s: SCORE_PASS * t * max(1.0, ff_eval if session.site_by_name[s].kind == "ff" else res_eval)
             for s, t in step1.items()}                        # one held-out scoring of a site's adapter
    local = w["site"]

    def per_site(what, names=step1):
        return sum(site_local_cost(local, session.site_by_name[s], what) for s in names
                   if session.site_by_name[s].kind in local)
    phases = []
    call_s = per_input * bank.call_batch if session.device.type == "cpu" else w["forward_batch8_s"]
    phases.append(Phase("calibration", tc.n_trajectories if session.calib.latents is None else bank.n,
                        "traj" if session.calib.latents is None else "input", bank.n, 0,
                        math.ceil(bank.n / bank.call_batch) * call_s))
    cap = _capture_inputs(tc, bank.n)
    phases.append(Phase("capture", cap, "input", cap, 0, math.ceil(cap / BATCH) * w["forward_batch8_s"]))
    sites, measured = _curve_measurements(session)
    every = [s.name for s in session.site_list]
    if sites:
        probe = min(tc.alloc_inputs, bank.n_eval)
        phases.append(Phase("rank curves", sites, "site", sites * measured * probe, 0,
                            sites * measured * math.ceil(probe / BATCH) * w["forward_batch8_s"]
                            + per_site("data_s", every) + per_site("curve_s", every)))
    # the OBS removal orders: computed once per site, in the rank-curve pass when there is one (it needs them
    # first), else in the init; counted here, with the init, either way
    held = math.ceil(bank.n_eval / BATCH) * w["forward_batch8_s"]           # one held-out UNet error
    init_s = per_site("data_s") + per_site("init_s") + per_site("order_s", every if sites else step1)
    if not tc.stage1_steps:                      # no stage 1: the init's UNet error is measured, then the file
        phases.append(Phase("init", n_sites, "site", bank.n_eval, 0, init_s + held))
    else:
        phases.append(Phase("init", n_sites, "site", 0, 0, init_s))
        evals_s1 = _evaluations(tc.stage1_steps)
        stage1_s = sum(t * tc.stage1_steps + score[s] * evals_s1 for s, t in step1.items()) + per_site("data_s")
        phases.append(Phase("stage 1", tc.stage1_steps * n_sites, "step", 2 * bank.n_eval, 0, stage1_s + 2 * held))
    if tc.stage2_steps:
        evals = _evaluations(tc.stage2_steps)
        extra = 1 - (1 - tc.control_prob) * (1 - tc.lora_prob)      # steps whose target the teacher recomputes
        seconds = tc.stage2_steps * (w["stage2_step_s"] + extra * per_input * b2) + evals * held + \
            sum(score.values()) + per_site("data_s")                           # the final per-site errors
        phases.append(Phase("stage 2", tc.stage2_steps, "step",
                            int(tc.stage2_steps * b2 * (1 + extra)) + evals * bank.n_eval,
                            tc.stage2_steps * b2, seconds))
    return phases
