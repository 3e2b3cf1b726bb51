"""Stage 2, BERT-of-Theseus: the full UNet with every site replaced by its student with probability
p(t) = min(1, p0 + k·t) (k such that p = 1 at ``p_full_at`` of the steps), trained on the UNet output against
the teacher's (recorded during calibration, so no teacher pass and no grad for it here).

What users plug in is part of the objective: steps train on the two halves of a CFG call and add a loss on the
guided ε (guidance amplifies errors), and a share of steps adds random ControlNet-like residuals and/or random
LoRA-like weight deltas (:mod:`augment`), with the teacher run on the same augmented input as the target.

A bypassed site runs the teacher's own module (exact); gate decisions are drawn before each step from a
generator keyed by (seed, step), so they are identical on every process and under gradient-checkpoint
recomputation. Data-parallel over processes: each takes its slice of the global batch and gradients are averaged.
Early stopping: the all-student UNet error on held-out inputs is measured 8 times (and at the start); the best
adapters are kept (so stage 2 never ends worse than stage 1 on that measure, which also selects the stop).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from . import checkpoint
from ..io.adapters import AdapterSet
from ..io.files import atomic_path
from ..io.tensors import load_file, save_file_atomic
from ..modules import swap
from ..modules.layers import set_module
from .augment import Augmenter
from .calibration import InputBank, _gen, unet_call
from .fit import FitLoop
from .ranks import adapter_param_count, param_count
from .sites import FeatureRecorder, gated_tree, set_gates
from .stage1 import batch_ids


def normalised_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over samples of ‖out − target‖² / ‖target‖² (per sample, so the data-parallel average of per-process
    losses equals the single-process loss of the whole batch)."""
    dims = tuple(range(1, out.dim()))
    return ((out - target).pow(2).mean(dims) / target.pow(2).mean(dims).clamp_min(1e-12)).mean()


def guided(eps: torch.Tensor, guidance: float) -> torch.Tensor:
    """CFG combination of a batch laid out as [unconditional halves; conditional halves]."""
    e_u, e_c = eps.chunk(2)
    return e_u + guidance * (e_c - e_u)


def p_replace(step: int, total: int, p0: float, p_full_at: float) -> float:
    k = (1.0 - p0) / max(1.0, p_full_at * total)
    return min(1.0, p0 + k * step)


@torch.no_grad()
def unet_error(tree, gates, bank: InputBank, ids: torch.Tensor, device, dtype, amp, batch: int = 8) -> float:
    """Relative error of the all-student UNet against the teacher's recorded outputs on rows ``ids``."""
    set_gates(gates, True)
    num = den = 0.0
    for i in range(0, ids.numel(), batch):
        b = ids[i:i + batch]
        with amp():
            out = unet_call(tree, bank.batch(b, device, dtype)).float()
        ref = bank.eps[b].to(device)
        num += float((out - ref).double().pow(2).sum())
        den += float(ref.double().pow(2).sum())
    return (num / max(den, 1e-30)) ** 0.5


def subset(aset: AdapterSet, sites) -> AdapterSet:
    sites = list(sites)
    return AdapterSet(aset.family, {s: aset.sites[s] for s in sites},
                      {s: g for s, g in aset.norm_groups.items() if s in sites})


def split_groups(site_order: list, size: dict, n_groups: int) -> list[list[str]]:
    """``n_groups`` contiguous groups of the sites in ``size`` (UNet order), balanced by ``size`` (adapter
    parameters per site)."""
    sites = [s for s in site_order if s in size]
    n_groups = max(1, min(n_groups, len(sites)))
    total = sum(size.values())
    groups, cur, acc = [], [], 0.0
    for i, s in enumerate(sites):
        cur.append(s)
        acc += size[s]
        left_groups = n_groups - len(groups) - 1
        left_sites = len(sites) - i - 1
        if left_groups > 0 and (acc >= total * (len(groups) + 1) / n_groups or left_sites == left_groups):
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return groups


def largest_group(session, ranks: dict, n_groups: int) -> list[str]:
    """The sites of the largest (by adapter parameters) of the ``n_groups`` groups stage 2 trains ``ranks`` in."""
    sizes = {s.name: adapter_param_count([s], ranks) for s in session.site_list if s.name in ranks}
    return max(split_groups(session.site_order, sizes, n_groups), key=lambda g: sum(sizes[s] for s in g))


def build(session, aset: AdapterSet, group: list | None = None, done=()):
    """The stage-2 module: ``group``'s sites (default all) gated between the teacher and trainable train-time
    adapters; the ``done`` sites (earlier groups) replaced by their folded students, whose teacher layers leave
    the device; every other site is the teacher."""
    # a "mixed" teacher has earlier groups' layers off the device already: keep them there
    teacher = session.placement.as_placed()
    group = [s for s in session.site_order if s in aset.sites] if group is None else list(group)
    done = [s for s in session.site_order if s in set(done)]
    slim = None
    if done:
        done_set = subset(aset, done)
        slim = swap.slim_module(teacher, done_set)
    tree, adapters, gates = gated_tree(teacher, subset(aset, group), session.cfg)   # adapters on the group's device
    for site in done:
        path = swap.site_path(teacher, site, session.cfg)
        session.placement.offload_site(site)
        # after the offload: layers the folded site shares with the teacher (norm1, skip) come back to the device
        set_module(tree, path, session.placement.run_on_device(slim.get_submodule(path)))
    tree.requires_grad_(False)
    for a in adapters.values():
        a.requires_grad_(True)
    tree.eval()
    return tree, adapters, gates


@torch.no_grad()
def measure(session, aset: AdapterSet, bank: InputBank) -> float:
    """All-student UNet error in the folded (slim) form: no adapter tensors on the device."""
    teacher = session.placement.on_device()
    slim = session.placement.run_on_device(swap.slim_module(teacher, aset).eval())
    ids = bank.eval_ids()
    num = den = 0.0
    for i in range(0, ids.numel(), 8):
        b = ids[i:i + 8]
        with session.amp():
            out = unet_call(slim, bank.batch(b, session.device, session.compute_dtype)).float()
        ref = bank.eps[b].to(session.device)
        num += float((out - ref).double().pow(2).sum())
        den += float(ref.double().pow(2).sum())
    del slim
    session.free_device_memory()
    return (num / max(den, 1e-30)) ** 0.5


def auto_groups(teacher_bytes: int, adapter_params: int, optimizer: str, total_bytes: int, n_sites: int,
                margin: float = 1.5 * 2 ** 30) -> int:
    """Fewest stage-2 groups whose adapters (fp32), gradients, optimizer states and bf16 autocast copies fit next
    to the teacher and ``margin`` bytes in 92% of ``total_bytes``."""
    import math
    per = 4 + 4 + (2 if optimizer == "adamw8bit" else 8) + 2
    avail = 0.92 * total_bytes - teacher_bytes - margin
    if adapter_params * per <= avail:
        return 1
    if avail <= 0:
        return n_sites
    return max(1, min(n_sites, math.ceil(adapter_params * per / avail)))


def physical_memory() -> int:
    """Bytes of RAM on this machine (psutil: also on Windows, which has no ``os.sysconf``)."""
    import psutil
    return psutil.virtual_memory().total


def resolve_groups(session, ranks: dict) -> int:
    """``stage2_groups``, with ``auto``: on CUDA, the fewest groups whose stage-2 device peak the VRAM estimator
    predicts within this GPU's memory, with what the GPU holds outside torch now as its context (the check
    ``--plan-only`` prints, :mod:`.device_fit`); where the estimator gives nothing, and in RAM, the fewest groups
    whose adapters, gradients, optimizer states and bf16 copies fit next to the teacher (finished groups run
    folded, their teacher layers off the device, so the teacher is the most the other sites ever take) in 92% of
    the memory the run trains in, less a margin: on a GPU 1.5 GiB (activations of the checkpointed UNet at batch
    1, CUDA context, allocator slack), in RAM a quarter of it (the activations, the system and the checkpoint's
    file pages)."""
    tc, device = session.tc, session.device
    if tc.stage2_groups != "auto":
        return int(tc.stage2_groups)
    if device.type == "cuda":
        n = _estimated_groups(session, ranks)
        if n is not None:
            return n
    teacher = param_count(session.shapes) * torch.finfo(session.teacher_dtype).bits // 8
    if device.type == "cuda":
        total, margin = torch.cuda.get_device_properties(device).total_memory, 1.5 * 2 ** 30
    else:
        total = physical_memory()
        margin = max(1.5 * 2 ** 30, total / 4)
    return auto_groups(teacher, adapter_param_count(session.site_list, ranks), session.optimizer_name, total,
                       len(ranks), margin)


def _estimated_groups(session, ranks: dict) -> int | None:
    """The fewest stage-2 groups whose predicted device peak fits this CUDA device (the fewest at the lowest peak
    when none does), said once per ranks; None where the estimator gives nothing."""
    from .device_fit import fit_key, own_device_fit
    fit = own_device_fit(session, ranks, session.placement.offload)
    by_groups = fit.get("stage2_gib_by_groups")
    n = None if not by_groups else next((g for g, v in by_groups.items() if v <= fit["device_gib"]),
                                        fit["needs_groups"])
    said = session.__dict__.setdefault("_groups_said", set())
    if fit_key(session, ranks) not in said:
        said.add(fit_key(session, ranks))
        if n is None:
            session.say(f"stage 2 groups by the memory rule ({fit['text']})")
        else:
            session.say(f"stage 2 in {n} group{'s' if n > 1 else ''}: predicted device peak {by_groups[n]:.2f} GiB "
                        f"of this GPU's {fit['device_gib']:.2f} GiB (its context now {fit['context_gib']:.2f} GiB)"
                        + ("; more than it has: stage 2 may run out of memory"
                           if by_groups[n] > fit["device_gib"] else ""))
    return n


def phase_steps(total: int, n_groups: int) -> list[int]:
    return [total // n_groups + (1 if i < total % n_groups else 0) for i in range(n_groups)]


def group_path(session, g: int):
    return session.work_dir / "stage2" / f"group-{g:03d}.safetensors"


SPLIT_FILE = "groups.json"


def recorded_split(session, groups: list) -> list:
    """The groups stage 2 trains in: in a resumed run the split it started with (``stage2/groups.json``; on CUDA
    ``auto`` follows what else the GPU holds, which can change between the two runs, and its group files and
    checkpoints are per group), else ``groups``, recorded there. The same on every process."""
    path = session.work_dir / "stage2" / SPLIT_FILE
    if session.topo.main:
        if session.resume and path.exists():
            try:
                old = json.loads(path.read_text(encoding="utf-8"))["groups"]
                if sorted(s for g in old for s in g) != sorted(s for g in groups for s in g):
                    raise ValueError("its sites are not this run's")
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
                raise ValueError(f"the work folder's stage-2 split {path} is damaged ({err}): delete the work "
                                 f"folder {session.work_dir} to start over (or, in the CLI, run without --resume)"
                                 ) from None
            if old != groups:
                session.say(f"stage 2 resumes in the {len(old)} group{'s' if len(old) > 1 else ''} it started in")
            groups = old
        else:
            with atomic_path(path) as tmp:
                Path(tmp).write_text(json.dumps({"groups": groups}, indent=1), encoding="utf-8")
    return session.topo.broadcast_object(groups)


def fit_group(session, loop: FitLoop, aset: AdapterSet, bank: InputBank, groups: list, g: int, offset: int, total: int,
              got: tuple | None) -> tuple[dict, float, float]:
    """Train group ``g`` of ``groups`` (``aset``: the current tensors of all sites) for stage steps
    [``offset``, ``offset + total``); returns ({site: best tensors} of the group, their error, the error before)."""
    tc = session.tc
    group = groups[g]
    done_sites = [s for gg in groups[:g] for s in gg]
    tree, adapters, gates = build(session, aset, group, done_sites)
    params = [p for s in group for p in adapters[s].parameters()]
    named = {f"{s}/{n}": p for s in group for n, p in adapters[s].named_parameters()}
    if session.use_grad_ckpt(len(groups)) and hasattr(tree, "enable_gradient_checkpointing"):
        tree.enable_gradient_checkpointing()
    feature = None
    if tc.feature_loss:
        feature = FeatureRecorder()
        for site in group:
            gates[site].feature = feature
    opt = session.make_optimizer(params, tc.lr2)
    resume = None
    if got is not None and got[1].get("phase", 0) == g:
        resume = (got[0], got[1], int(got[1]["step"]) - offset)
    fit = bank.fit_ids()
    pairs = bank.cfg_pairs(fit) if tc.guided_loss and tc.guidance != 1.0 else torch.empty(0, 2)
    aug = None
    if len(groups) == 1 and (tc.control_prob or tc.lora_prob):     # the gates-off tree must be the teacher
        aug = Augmenter(session.placement.on_device(), bank, group, session.cfg, tc.seed, tc.control_prob, tc.lora_prob,
                        tc.lora_scale, device=session.device, dtype=session.compute_dtype, amp=session.amp)
    world, rank = session.topo.world, session.topo.rank
    gbs = tc.stage2_batch * world

    def step(i):
        gstep = offset + i
        p = p_replace(i, total, tc.p0, tc.p_full_at)
        u = torch.rand(len(group), generator=_gen(tc.seed, 71, gstep))
        decisions = {s: bool(u[j] < p) for j, s in enumerate(group)}
        if not any(decisions.values()):        # an all-teacher step trains nothing: replace the likeliest site
            decisions[group[int(u.argmin())]] = True
        if len(pairs):
            chosen = pairs[batch_ids(len(pairs), gbs, gstep, (tc.seed, 72))]
            chosen = chosen[rank * tc.stage2_batch:(rank + 1) * tc.stage2_batch] if world > 1 else chosen
            mine = torch.cat([chosen[:, 0], chosen[:, 1]])
        else:
            rows = fit[batch_ids(fit.numel(), gbs, gstep, (tc.seed, 72))]
            mine = rows[rank * tc.stage2_batch:(rank + 1) * tc.stage2_batch] if world > 1 else rows
        inputs = bank.batch(mine, session.device, session.compute_dtype)
        control, perturb = aug.draw(gstep) if aug is not None else (False, False)
        with aug.weight_deltas(gstep) if perturb else contextlib.nullcontext():
            if control:
                inputs.update(aug.residuals(gstep, mine.numel(), session.device, session.compute_dtype))
            if control or perturb:
                set_gates(gates, False)
                with torch.no_grad(), session.amp():
                    target = unet_call(tree, inputs).float()
            else:
                target = bank.eps[mine].to(session.device)
            set_gates(gates, decisions)
            if feature is not None:
                feature.start()
            with session.amp():
                out = unet_call(tree, inputs)
            loss = normalised_mse(out.float(), target)
            if len(pairs):
                loss = loss + tc.guided_loss * normalised_mse(guided(out.float(), tc.guidance),
                                                              guided(target, tc.guidance))
            if feature is not None:
                feature.stop()
                losses = feature.losses()
                if losses:
                    loss = loss + tc.feature_loss * torch.stack(losses).mean()
                feature.pairs = []
            loss.backward()
        session.topo.all_reduce_mean_([q.grad for q in params if q.grad is not None])
        return {"stage": 2, "loss": float(loss.detach()), "p": round(p, 3)}

    def state(done):
        gdone = offset + done
        return {"stage": 2, "phase": g, "step": gdone,
                "cursor": {"phase": g, "step": gdone, "p": p_replace(done - 1, total, tc.p0, tc.p_full_at)}}

    def evaluate():
        return unet_error(tree, gates, bank, bank.eval_ids(), session.device, session.compute_dtype, session.amp)

    best, err, before = loop.fit(named, opt, total, step, evaluate, state, offset=offset, resume=resume)
    return {s: {n: best[f"{s}/{n}"].clone() for n in adapters[s].tensors()} for s in group}, err, before


def run_stage2(session, aset: AdapterSet, bank: InputBank, n_groups: int,
               shown: int = 0) -> tuple[dict, float, float]:
    """Returns ({site: tensors}, UNet error before, UNet error after) (errors on the eval split).

    ``shown``: the progress already shown (stage 1's steps). With ``n_groups`` G > 1 (memory: only one group's
    adapters and optimizer state live at a time) the sites are split into G contiguous groups trained one after
    another, each for its share of the steps with its own replacement curriculum; finished groups stay replaced by
    their folded students (their teacher layers leave the device), later groups stay teacher. Early stopping in a
    group measures the model as it stands (students up to this group); after the last group that is the
    all-student UNet.
    """
    tc = session.tc
    sizes = {s: sum(v.numel() for v in t.values()) for s, t in aset.sites.items()}
    groups = recorded_split(session, split_groups(session.site_order, sizes, n_groups))
    if tc.stage2_groups == "auto" and len(groups) == len(sizes) > 1:
        session.say(f"stage 2: the teacher nearly fills this {'GPU' if session.device.type == 'cuda' else 'RAM'}; "
                    "training one site at a time")
    steps = phase_steps(tc.stage2_steps, len(groups))
    offsets = [sum(steps[:g]) for g in range(len(groups))]
    current = {s: dict(t) for s, t in aset.sites.items()}
    got = checkpoint.latest(session.ckpt_dir, "s2") if session.resume else None
    before_all = None
    after = None
    session.progress.start_stage("stage 2", tc.stage2_steps, unit="step")
    loop = FitLoop(tc.lr2, tc.grad_clip, session.ckpt_dir, "s2", tc.checkpoint_every, tc.keep_checkpoints,
                   session.progress, shown=shown, save=session.topo.main, save_last=True)
    for g, group in enumerate(groups):
        path = group_path(session, g)
        if session.resume and path.exists():
            tensors, meta = load_file(path)
            info = json.loads(meta["sdslim.stage2"])
            if info.get("sites", group) != group:        # a split recorded before groups.json existed
                raise ValueError(f"{path} holds another split's group: delete the work folder "
                                 f"{session.work_dir} to start over (or, in the CLI, run without --resume)")
            for key, v in tensors.items():
                site, name = key.split("/", 1)
                current[site][name] = v
            before_all = info["error_before"] if before_all is None else before_all
            after = info["best_error"]
            session.progress.skip(offsets[g] + steps[g])
            continue
        tensors, best_err, before = fit_group(session, loop, AdapterSet(aset.family, current, aset.norm_groups), bank,
                                              groups, g, offsets[g], steps[g], got)
        current.update(tensors)
        before_all = before if before_all is None else before_all
        if session.topo.main:
            save_file_atomic({f"{s}/{n}": v for s in group for n, v in current[s].items()}, path,
                             {"sdslim.stage2": {"group": g, "sites": group, "error_before": before,
                                                "best_error": best_err}})
        session.topo.barrier()
        after = best_err
        session.free_device_memory()
    session.progress.end_stage()
    session.timing["stage2_s_per_step"] = loop.s_per_step
    session.timing["stage2_groups"] = len(groups)
    return current, before_all, after
