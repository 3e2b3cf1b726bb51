"""Peak VRAM of a training run, predicted before it starts.

Two sources:

- **analytic** (always): what is resident per stage, exactly counted from the shapes: frozen teacher weights
  (fp16 on CUDA), adapter parameters (fp32), their gradients, optimizer states (AdamW 8 B/param, bitsandbytes
  8-bit AdamW ≈ 2 B/param), plus for stage 1 one site's data batch and activations; and the whole-UNet error
  measured before and after stage 1 (``stage2.measure``: the teacher on the device beside the folded layers of
  every site, a batch of 8 like calibration's teacher calls), which is stage 1's peak at full size (the first GPU
  run: 2.93 GiB allocated for SD1.5, where one site's training needs 0.7).
- **estimator**: the stage-2 step (full UNet with every site
  replaced, gradient checkpointing, bf16 autocast, MSE on the output, optimizer step) and the calibration
  sampling step are run on fake tensors by the VRAM estimator (:mod:`sdslim_core.vram.estimate`) with the
  trainer's own modules (``estimator_model``/``teacher_model`` below: the frozen teacher as fp16 buffers, as the
  trainer holds it on CUDA), which counts live bytes including activations.
"""
from __future__ import annotations

import json
import math
import os

import torch

from .. import layout
from ..io.adapters import AdapterSet
from ..layout.rank_policy import res_groups
from ..modules import offload, swap
from ..modules.layers import set_module
from ..modules.unet import build_diffusers_unet
from ..ops.fold import site_keys, slim_shapes
from ..vram import harness
from ..vram.estimate import estimate_many
from ..vram.settings import Settings
from .ranks import adapter_param_count, param_count
from .sites import SiteGate
from .stage2 import largest_group

GIB = 2 ** 30
_ENV = "SDSLIM_TRAIN_ESTIMATE_RANKS"
CALIBRATION_BATCH = 8     # 4 trajectories × (cond + uncond) per teacher call


def optimizer_bytes_per_param(optimizer: str) -> float:
    return 2.0 if optimizer == "adamw8bit" else 8.0


def analytic(cfg, ranks: dict, tc, latent_size: int, optimizer: str, teacher_bytes: int = 2,
             train_sites=None, offload: bool = False) -> dict:
    """Resident bytes per stage (GiB), from shapes only (stage 2: the ``train_sites`` group's adapters; with
    ``offload`` the teacher's weights are not resident)."""
    unet = build_diffusers_unet(cfg, device="meta")
    canon, _, _ = layout.to_canonical({k: tuple(v.shape) for k, v in unet.state_dict().items()})
    site_list = layout.sites(canon)
    n_teacher = param_count(canon)
    n_adapt = adapter_param_count(site_list, ranks)
    ob = optimizer_bytes_per_param(optimizer)
    teacher = 0 if offload else n_teacher * teacher_bytes
    # stage 1: the largest site's layers + its adapter (param, grad, optimizer) + a batch of activations
    s1 = 0
    level = {}
    for s in site_list:
        r = ranks.get(s.name)
        if r is None:
            continue
        own = {k: v for k, v in canon.items() if k.startswith(s.name + ".")}
        layers = param_count(own) * teacher_bytes
        a = (3 * r * s.width if s.kind == "ff" else 2 * r * s.width + 2 * r) * (4 + 4 + ob)
        if s.kind == "ff":
            tokens = tc.ff_batch_tokens
            act = tokens * (s.in_dim * 3 + 2 * s.width * 2 + 6 * r) * 4 * 2
        else:
            hw = _site_pixels(s.name, cfg, latent_size, level)
            act = tc.res_batch * hw * (s.in_dim * 3 + s.width * 3 + 6 * r + s.out_dim * 2) * 4 * 2
        s1 = max(s1, layers + a + act)
    train = set(train_sites or ranks)
    n_group = adapter_param_count([s for s in site_list if s.name in train], ranks)
    # stage-2 groups: the first group is the peak (finished groups run folded with their teacher layers off the
    # device, later groups are plain teacher)
    s2_static = teacher + n_group * (4 + 4 + ob)
    slim = slim_shapes(canon, {s.name: ranks[s.name] for s in site_list if s.name in ranks})
    folded = 0 if offload else sum(math.prod(slim[k]) for s in site_list if s.name in ranks
                                   for k in site_keys(s.name, s.kind) if k in slim) * teacher_bytes
    return {"teacher_params": n_teacher, "adapter_params": n_adapt, "stage2_group_adapter_params": n_group,
            "teacher_gib": teacher / GIB,
            "adapters_gib": n_group * 4 / GIB, "grads_gib": n_group * 4 / GIB, "optimizer_gib": n_group * ob / GIB,
            "stage1_gib": s1 / GIB, "stage2_static_gib": s2_static / GIB, "folded_gib": folded / GIB}


def _site_pixels(site: str, cfg, latent: int, cache: dict) -> int:
    """Spatial size of a Res site's maps: the level is read from the block index."""
    parts = site.split(".")
    nrb = cfg.num_res_blocks
    levels = cfg.levels
    if parts[0] == "input_blocks":
        lvl = (int(parts[1]) - 1) // (nrb + 1)
    elif parts[0] == "middle_block":
        lvl = levels - 1
    else:
        lvl = levels - 1 - int(parts[1]) // (nrb + 1)
    side = max(1, latent // 2 ** lvl)
    return side * side


def _empty_adapter_set(by_name: dict, ranks: dict):
    """An :class:`AdapterSet` of empty tensors (fake-tensor safe: its validation, which reads values, is skipped)."""
    tensors, groups = {}, {}
    for site, r in ranks.items():
        s = by_name[site]
        if s.kind == "ff":
            tensors[site] = {"down_value": torch.empty(r, s.width), "down_gate": torch.empty(r, s.width),
                             "up": torch.empty(s.width, r)}
        else:
            tensors[site] = {"down": torch.empty(r, s.width), "norm.weight": torch.empty(r),
                             "norm.bias": torch.empty(r), "up": torch.empty(s.width, r)}
            groups[site] = res_groups(s.width, r)
    aset = AdapterSet.__new__(AdapterSet)
    aset.family, aset.sites, aset.norm_groups, aset.metadata, aset.source = "sd15", tensors, groups, {}, "<estimate>"
    return aset


def _frozen_teacher(settings, offloaded: bool):
    """The estimated run's frozen teacher: fp16 buffers on the device, or (``offloaded``) in CPU RAM with each
    layer's copied to the device for its call, as :class:`~.teacher.TeacherPlacement` holds it (built on the CPU
    then, so nothing of it is ever on the device)."""
    if not offloaded:
        return _frozen_fp16(harness.original_unet(settings))
    device = torch.empty(0).device                 # the estimator's (fake) device: the context's default
    with torch.device("cpu"):
        unet = _frozen_fp16(harness.original_unet(settings))
    offload.attach(unet, device)
    return unet


def _spec() -> dict:
    spec = json.loads(os.environ.get(_ENV, "{}"))
    return {"ranks": spec.get("ranks", spec if "train" not in spec else {}), "train": spec.get("train"),
            "offload": bool(spec.get("offload"))}


def estimator_model(settings):
    """Model factory for the VRAM estimator: the stage-2 module.

    ``$SDSLIM_TRAIN_ESTIMATE_RANKS`` holds JSON ``{"ranks": {site: rank}, "train": [sites], "offload": bool}``: the
    ``train`` sites (default all; with stage-2 groups, the largest group) get gated trainable adapters; the frozen
    teacher is :func:`_frozen_teacher`.
    """
    spec = _spec()
    unet = _frozen_teacher(settings, spec["offload"])
    ranks = spec["ranks"]
    train = spec["train"] or list(ranks)
    canon, _, _ = layout.to_canonical(dict(unet.state_dict()))
    by_name = {s.name: s for s in layout.sites({k: tuple(v.shape) for k, v in canon.items()})}
    cfg = swap.tree_config(unet)
    train_set = _empty_adapter_set(by_name, {s: ranks[s] for s in train})
    tree, adapters = swap.attach_train_adapters(unet, train_set)       # adapters on the device the layers run on
    students = {s: tree.get_submodule(swap.site_path(unet, s, cfg)) for s in train}
    # with stage-2 groups, the first group is the peak: later sites are the teacher; finished groups (later on)
    # run folded with their teacher layers off the device, which only lowers the total
    for site, student in students.items():
        path = swap.site_path(unet, site, cfg)
        set_module(tree, path, SiteGate(site, by_name[site].kind, unet.get_submodule(path), student))
    return tree


def teacher_model(settings):
    """Model factory for the estimator's calibration step: the teacher as :func:`_frozen_teacher` holds it."""
    return _frozen_teacher(settings, _spec()["offload"])


def _frozen_fp16(unet):
    """``unet`` with every parameter turned into an fp16 buffer (one per parameter, however many modules share it):
    that is how the trainer holds the frozen teacher on CUDA, and the estimator's harness makes all *parameters*
    trainable (full fine-tune); the adapters attached afterwards are the only parameters."""
    made = {}
    for module in unet.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            del module._parameters[name]
            if id(p) not in made:
                made[id(p)] = p.detach().to(torch.float16)
            module.register_buffer(name, made[id(p)])            # in the state dict: layouts read it
    return unet


def estimate(cfg, ranks: dict, tc, latent_size: int, optimizer: str, grad_ckpt: bool, timeout: float = 900,
             train_sites=None, offload: bool = False) -> dict:
    """Stage-2 and calibration peaks from the VRAM estimator (GiB; an fp16 teacher, offloaded with ``offload``)."""
    arch = cfg.family if cfg.family in ("sd15", "sd2", "sdxl") else "sd15"
    base = dict(arch=arch, resolution=latent_size * 8, precision="amp-bf16", unet_config=layout.diffusers_config(cfg),
                model_factory="sdslim_core.train.vram:estimator_model")
    opt = {"adamw8bit": "adamw8bit", "adamw": "adamw-fused"}.get(optimizer, "adamw-fused")
    batch2 = max(1, tc.stage2_batch)
    want = {"stage2": batch2, "calibration": CALIBRATION_BATCH}
    jobs = [("stage2", Settings(optimizer=opt, grad_ckpt=grad_ckpt, **base), "stage2", (batch2,)),
            ("calibration", Settings(sampling=True, **dict(base, model_factory="sdslim_core.train.vram:teacher_model")),
             "calibration", (CALIBRATION_BATCH,))]                  # each job at its own batch only
    env = dict(os.environ, **{_ENV: json.dumps({"ranks": ranks, "train": list(train_sites or ranks),
                                                 "offload": offload})})
    results = estimate_many(jobs, timeout=timeout, env=env)
    out = {}
    for r in results:
        point = next(p for p in r.points if p["batch"] == want[r.name])
        out[r.name] = {"peak_gib": point["peak_gib"], "reserved_gib": point["reserved_gib"], "batch": want[r.name],
                       "phase": point["phase"],
                       "breakdown_gib": point["breakdown_gib"], "device_mode": r.device_mode,
                       "warnings": r.warnings}
    return out


def predict(cfg, ranks: dict, tc, latent_size: int, optimizer: str, grad_ckpt: bool, use_estimator: bool = True,
            timeout: float = 900, train_sites=None, offload: bool = False) -> dict:
    """Predicted peak per stage and overall (GiB) with a one-line ``text``; ``train_sites``: the largest
    stage-2 group when stage 2 runs in groups; ``offload``: the teacher offloaded (``--offload-teacher``)."""
    a = analytic(cfg, ranks, tc, latent_size, optimizer, train_sites=train_sites, offload=offload)
    result = {"analytic": a, "latent_size": latent_size, "optimizer": optimizer, "grad_ckpt": grad_ckpt,
              "offload": offload,
              "stage2_group_sites": len(train_sites) if train_sites else len(ranks)}
    est = None
    if use_estimator:
        try:
            est = estimate(cfg, ranks, tc, latent_size, optimizer, grad_ckpt, timeout=timeout,
                           train_sites=train_sites, offload=offload)
        except ImportError as err:
            result["estimator"] = f"unavailable ({err})"
        except Exception as err:  # the estimator is optional: never block training on it
            result["estimator"] = f"failed ({type(err).__name__}: {err})"
    else:
        result["estimator"] = "not run"
    if est:
        result["estimator"] = est
        s2 = est["stage2"]["peak_gib"]
        cal = est["calibration"]["peak_gib"]
        s1 = max(a["stage1_gib"], cal + a["folded_gib"])       # a site's training, or the UNet error measured
        result["stages_gib"] = {"calibration": cal, "stage1": s1, "stage2": s2}
        result["peak_gib"] = max(cal, s1, s2)
        result["text"] = (f"predicted peak {result['peak_gib']:.2f} GiB (stage 2 {s2:.2f}, calibration {cal:.2f}, "
                          f"stage 1 {s1:.2f}; VRAM estimator on fake tensors, fp16 teacher"
                          f"{' offloaded' if offload else ''}, "
                          f"{optimizer}, latent {latent_size}², batch {tc.stage2_batch}"
                          f"{', grad ckpt' if grad_ckpt else ''}"
                          f"{f', stage 2 in groups (largest {len(train_sites)} sites)' if train_sites else ''})")
    else:
        s2 = a["stage2_static_gib"]
        result["stages_gib"] = {"stage1": a["stage1_gib"], "stage2_without_activations": s2}
        result["peak_gib"] = None
        result["text"] = (f"VRAM estimator {result['estimator']}; resident without activations: stage 2 "
                          f"{s2:.2f} GiB (teacher {a['teacher_gib']:.2f} + adapters/grads/optimizer "
                          f"{s2 - a['teacher_gib']:.2f}), stage 1 {a['stage1_gib']:.2f} GiB")
    return result


def predict_for(session, ranks: dict, stage2_groups: int) -> dict:
    """:func:`predict` for a run's session at ``ranks`` with stage 2 in ``stage2_groups`` groups, said on the
    session's log."""
    tc, device = session.tc, session.device
    opt = session.optimizer_name if device.type == "cuda" else ("adamw8bit" if tc.optimizer == "adamw8bit" else "adamw")
    train_sites = largest_group(session, ranks, stage2_groups)
    session.say("predicting peak VRAM (the VRAM estimator runs the training step on fake tensors, ~1 min)…")
    info = predict(session.cfg, ranks, tc, session.latent_size, opt,
                   grad_ckpt=session.use_grad_ckpt(stage2_groups) or device.type != "cuda",
                   train_sites=train_sites if stage2_groups > 1 else None, offload=session.placement.offload)
    session.say("VRAM: " + info["text"])
    return info
