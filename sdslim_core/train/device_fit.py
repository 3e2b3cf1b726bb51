"""Which settings train within a device of a given size (an 8 GB card), by the predicted whole-device peak.

The predicted device peak of a phase is the VRAM estimator's caching-allocator reserve (``vram/allocator.py``)
plus the CUDA context (a measured, per-device input: ``vram.allocator.DEFAULT_CONTEXT_GIB`` unless given). Stage 2
is the knob: training its sites in more groups keeps fewer adapters (with their gradients, optimizer states and
train-time buffers) on the device at once. The estimator runs with every site in one group and, when that does
not fit, again with the largest of :data:`MAX_GROUPS` groups trained (:func:`stage2.largest_group`); a split into
``g`` groups is placed between the two, linear in the adapter parameters of its largest group.
Calibration (the teacher sampling 4 trajectories with CFG at once) and stage 1 (one site) have no such knob.
Offloading the teacher (``--offload-teacher``: its weights in CPU RAM, each layer's copied to the device for its
call) takes its weights out of every phase, at the cost of a copy of the model per forward: ``auto`` offloads only
where the run does not fit the GPU otherwise (:func:`place_teacher`).
"""
from __future__ import annotations

from .. import optional
from ..vram.allocator import DEFAULT_CONTEXT_GIB
from .ranks import adapter_param_count
from .stage2 import largest_group
from .vram import optimizer_bytes_per_param, predict

GIB = 2 ** 30
MAX_GROUPS = 8


def cuda_optimizer() -> str:
    """The optimizer a CUDA run uses by default here: 8-bit AdamW when bitsandbytes imports, else AdamW."""
    return "adamw" if optional.missing("bitsandbytes", "8-bit AdamW") else "adamw8bit"


def default_device_gib(device) -> float:
    """The device size ``--plan-only`` checks by default: a CUDA device's own memory (GiB), else 0 (no check)."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    return torch.cuda.get_device_properties(device).total_memory / GIB


def measured_context_gib(device) -> float | None:
    """What a CUDA device holds now beyond this process's torch reserve (its CUDA context and other programs'
    memory), in GiB: the context for checking that device as it is; None off CUDA or where it cannot be read."""
    import torch
    from ..vram.live import device_used
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    used = device_used(index)
    if used is None:
        return None
    return max(0.0, (used - torch.cuda.memory_reserved(index)) / GIB)


def _per_param_gib(session, ranks, optimizer, context, stage2_all, kept, offload) -> float | None:
    """GiB of stage 2's device peak per adapter parameter of the trained group, from a second estimator run with
    only the largest of :data:`MAX_GROUPS` groups trained (its sites' train-time buffers shrink with the group as
    well as their weights, gradients and optimizer states: SDXL at 0.5, 34.2 → 10.9 GiB where the states alone
    say 14.1); None when that run gives nothing usable."""
    few = predict(session.cfg, ranks, session.tc, session.latent_size, optimizer, grad_ckpt=True,
                  train_sites=largest_group(session, ranks, MAX_GROUPS), offload=offload)
    if few.get("peak_gib") is None:
        return None
    per = (stage2_all - few["estimator"]["stage2"]["reserved_gib"] - context) / (kept[1] - kept[MAX_GROUPS])
    return per if per > 0 else None


def device_fit(session, ranks: dict, device_gib: float = 8.0, context_gib: float | None = None,
               optimizer: str | None = None, offload: bool = False) -> dict:
    """The fewest stage-2 groups (up to :data:`MAX_GROUPS`) whose predicted device peak fits ``device_gib``, with
    each phase's predicted device peak; ``groups`` is None when no split fits (the text says which phase is over,
    and the smallest device the run fits: ``needs_gib`` with ``needs_groups``). ``offload``: with the teacher
    offloaded."""
    context = DEFAULT_CONTEXT_GIB if context_gib is None else context_gib
    optimizer = optimizer or (session.optimizer_name if session.device.type == "cuda" else cuda_optimizer())
    info = predict(session.cfg, ranks, session.tc, session.latent_size, optimizer, grad_ckpt=True, offload=offload)
    if info.get("peak_gib") is None:
        return {"device_gib": device_gib, "context_gib": context, "groups": None, "offload": offload,
                "text": f"{round(device_gib, 2):g} GB check: {info['text']}"}
    est = info["estimator"]
    stage2_all = est["stage2"]["reserved_gib"] + context
    calibration = est["calibration"]["reserved_gib"] + context
    stage1 = info["stages_gib"]["stage1"] + context
    kept = {g: adapter_param_count([s for s in session.site_list if s.name in largest_group(session, ranks, g)],
                                   ranks) for g in range(1, MAX_GROUPS + 1)}
    per_param = _per_param_gib(session, ranks, optimizer, context, stage2_all, kept, offload) \
        if stage2_all > device_gib and kept[MAX_GROUPS] < kept[1] else None
    if per_param is None:                      # the group's weights, gradients and optimizer states alone
        per_param = (4 + 4 + optimizer_bytes_per_param(optimizer)) / GIB
    by_groups = {g: stage2_all - (kept[1] - n) * per_param for g, n in kept.items()}
    fixed = max(calibration, stage1)
    groups = next((g for g, v in by_groups.items() if max(v, fixed) <= device_gib), None)
    least = min(by_groups, key=lambda g: (round(by_groups[g], 3), g))    # the fewest groups at the lowest peak
    needs = max(fixed, by_groups[least])
    what = (f"predicted device peak (allocator reserve + {context:.2f} GiB CUDA context; "
            f"{'teacher offloaded, ' if offload else ''}{optimizer}, grad ckpt, "
            f"batch {session.tc.stage2_batch}): calibration {calibration:.2f}, stage 1 {stage1:.2f}, stage 2 "
            + ", ".join(f"{g} group{'s' if g > 1 else ''} {v:.2f}" for g, v in list(by_groups.items())[:4]) + " GiB")
    size = f"{round(device_gib, 2):g}"        # a card's own memory reads e.g. 7.79
    if groups is not None:
        verdict = f"fits {size} GiB with {'--offload-teacher on and ' if offload else ''}--stage2-groups {groups}"
    elif fixed > device_gib:
        verdict = (f"does not fit {size} GiB: {'calibration' if calibration >= stage1 else 'stage 1'} alone "
                   f"needs {fixed:.2f} GiB")
    else:
        verdict = f"does not fit {size} GiB with up to {MAX_GROUPS} stage-2 groups"
    if groups is None:
        verdict += f" (it needs a device of {needs:.1f} GiB, with --stage2-groups {least})"
    return {"device_gib": device_gib, "context_gib": context, "optimizer": optimizer, "groups": groups,
            "offload": offload,
            "needs_gib": needs, "needs_groups": least,
            "calibration_gib": calibration, "stage1_gib": stage1, "stage2_gib_by_groups": by_groups,
            "allocated": {"calibration": est["calibration"]["peak_gib"], "stage2_all": est["stage2"]["peak_gib"]},
            "text": f"{verdict}; {what}"}


def _as_asked(session, whole, offloaded) -> dict:
    """The check for the placements ``--offload-teacher`` allows: ``on``, the teacher offloaded (``offloaded()``);
    ``off``, on the device (``whole()``); ``auto``, on the device and, where no split fits, offloaded beside it (as
    ``offloaded``, its verdict on a second line of the text)."""
    want = session.tc.offload_teacher
    if want is True:
        return offloaded()
    fit = whole()
    if want is False or fit.get("groups") is not None or "needs_gib" not in fit:
        return fit
    off = offloaded()
    return dict(fit, offloaded=off, text=f"{fit['text']}\nwith the teacher offloaded: {off['text']}")


def checked(session, ranks: dict, device_gib: float, context_gib: float | None = None) -> dict:
    """:func:`device_fit` for the placements the run's ``offload_teacher`` allows (:func:`_as_asked`)."""
    return _as_asked(session, lambda: device_fit(session, ranks, device_gib, context_gib),
                     lambda: device_fit(session, ranks, device_gib, context_gib, offload=True))


def fit_key(session, ranks: dict) -> tuple:
    """What the check depends on beyond the model: the ranks and the stage-2 step's settings."""
    return tuple(sorted(ranks.items())), session.tc.stage2_batch, session.latent_size, session.optimizer_name


def own_device_fit(session, ranks: dict, offload: bool = False) -> dict:
    """:func:`device_fit` for the session's own CUDA device as it is (its memory; as context what it holds outside
    torch), once per ranks and placement in a session: the check ``--plan-only`` prints and the groups
    ``stage2_groups=auto`` trains in on CUDA."""
    key = fit_key(session, ranks) + (offload,)
    known = session.__dict__.setdefault("_own_device_fit", {})
    if key not in known:
        known[key] = device_fit(session, ranks, default_device_gib(session.device),
                                measured_context_gib(session.device), offload=offload)
    return known[key]


def own_check(session, ranks: dict) -> dict:
    """:func:`checked` for the session's own CUDA device (the cached :func:`own_device_fit` checks)."""
    return _as_asked(session, lambda: own_device_fit(session, ranks),
                     lambda: own_device_fit(session, ranks, offload=True))


def place_teacher(session, ranks: dict) -> bool:
    """Whether the run offloads its teacher (``--offload-teacher``): as asked; ``auto``: on CUDA, when the check
    for this GPU finds no stage-2 split that fits with the teacher on the device and offloading needs less (it
    fits, or comes closer). Sets it on the session's placement (the same on every process) and says why, once per
    session: later calls (the plan's warm-up, on the main process only) keep that decision."""
    if "_teacher_placed" in session.__dict__:
        return session.placement.offload
    session._teacher_placed = True
    want = session.tc.offload_teacher
    if want == "auto":
        want = False
        if session.device.type == "cuda" and session.topo.main:
            fit = own_check(session, ranks)
            off = fit.get("offloaded")
            want = off is not None and off.get("needs_gib", float("inf")) < fit["needs_gib"]
            if want:
                session.say("the teacher is offloaded (its weights stay in RAM, each layer copied to the GPU for "
                            "its call; slower): " + (off["text"].split(";")[0] if off.get("groups") else
                                                     "it does not fit this GPU either way, and needs less so"))
        want = session.topo.broadcast_object(want)
    session.placement.set_offload(bool(want))
    return session.placement.offload
