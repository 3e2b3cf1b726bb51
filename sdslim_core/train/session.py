"""What every phase of one training run shares: the settings, the teacher and where it sits, the device, dtypes
and processes, the work dir, progress and messages. The phases (calibration, rank choice, initialisation, the two
stages) are functions of their own modules that take a :class:`Session`; :mod:`.run` calls them in order."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from . import calibration as cal, dist
from .. import layout, optional
from ..io.adapters import AdapterSet
from ..modules.unet import load_diffusers_unet
from .config import TrainConfig
from .progress import Progress, write
from .report import TRAIN_META_VERSION
from .sites import SiteData
from .teacher import TeacherPlacement, free_device_memory
from .workdir import WorkDir

DEFAULT_LATENT = {"sd15": 64, "sd2": 96, "sdxl": 128}


def fingerprint_tensors(items) -> str:
    """A short hash of (name, tensor) pairs: names, shapes and each tensor's first 1024 values."""
    h = hashlib.sha256()
    for k, v in items:
        h.update(k.encode())
        if v is None:
            continue
        t = v.detach().reshape(-1)[:1024].to("cpu", torch.float32).contiguous()
        h.update(str(tuple(v.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:24]


def teacher_fingerprint(canon: Mapping) -> str:
    """The ``fingerprint`` of a teacher's canonical weights recorded in its adapter files (every 7th tensor)."""
    return fingerprint_tensors((k, canon[k]) for k in sorted(canon)[::7])


def torch_dtype(name: str, default: torch.dtype) -> torch.dtype:
    """``--teacher-dtype`` and friends as a torch dtype (``auto``: ``default``)."""
    if name in ("auto", None):
        return default
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}")
    return table[name]


def optimizer_kind(device: torch.device, requested: str, say: Callable[[str], None]) -> str:
    """adamw8bit (bitsandbytes, CUDA only) when asked for, or for ``auto`` when it imports; else adamw."""
    if device.type != "cuda" or requested == "adamw":
        return "adamw"
    if requested == "adamw8bit":
        optional.require("bitsandbytes", "--optimizer adamw8bit")
        return "adamw8bit"
    try:
        optional.require("bitsandbytes", "8-bit AdamW (--optimizer auto)")
    except optional.MissingDependency as err:
        say(f"{err}; using AdamW")
        return "adamw"
    return "adamw8bit"


class Session:
    """One run's shared state. ``weights``: the teacher's canonical weights (never modified); the teacher module
    is built from them once, kept on the CPU between phases (:attr:`placement`)."""

    def __init__(self, weights: Mapping, cfg: layout.UNetConfig, tc: TrainConfig, calib: cal.Calibration | None,
                 out_path, callback: Callable | None, resume: bool | str, overwrite: bool = True):
        self.tc, self.cfg, self.weights = tc, cfg, weights
        self.topo = dist.topology(tc.device)
        self.device = self.topo.device
        cuda = self.device.type == "cuda"
        self.teacher_dtype = torch_dtype(tc.teacher_dtype, torch.float16 if cuda else torch.float32)
        self.compute_dtype = self.teacher_dtype
        if tc.amp == "auto":
            self.amp_dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else None
        else:
            self.amp_dtype = {"off": None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[tc.amp]
        self.naming = "diffusers"
        teacher = load_diffusers_unet(weights, cfg, dtype=self.teacher_dtype, device="cpu")
        teacher.eval().requires_grad_(False)
        self.placement = TeacherPlacement(teacher, cfg, self.device)
        canon_params, _, _ = layout.to_canonical(dict(teacher.state_dict()))
        self.shapes = {k: tuple(v.shape) for k, v in canon_params.items()}
        self.teacher_fp = teacher_fingerprint(canon_params)
        del canon_params
        self.site_list = layout.sites(self.shapes)
        self.site_order = [s.name for s in self.site_list]
        self.site_by_name = {s.name: s for s in self.site_list}
        self.out_path = Path(out_path)
        self.work_dir = Path(tc.work_dir) if tc.work_dir else self.out_path.with_name(self.out_path.name + ".work")
        self.work = WorkDir(self.work_dir, self.topo, self.say)
        self.ckpt_dir = self.work.checkpoints
        self.resume = resume
        self.overwrite = overwrite                    # False: an adapter file at out_path is refused, not replaced
        self.calib = calib or cal.Calibration.unconditional()
        self.latent_size = tc.latent_size or DEFAULT_LATENT.get(cfg.family, 64)
        self.progress = Progress(callback if self.topo.main or callback is None else None, tc.progress_bar and
                                 self.topo.main)
        self.timing: dict = {}
        self.plan_tokens: dict | None = None          # site → H·W of its input, from the plan's warm-up
        self.obs_orders: dict = {}                    # site → its OBS removal orders (rank curves → init)
        self.optimizer_name = optimizer_kind(self.device, tc.optimizer, self.say)
        self.base = self._base_adapters()             # ``start_from``'s adapters (their sites and ranks), or None

    def _base_adapters(self) -> AdapterSet | None:
        """The ``start_from`` adapter file, checked against this model (family, sites, widths)."""
        if self.tc.start_from is None:
            return None
        path = Path(self.tc.start_from)
        if not path.is_file():
            raise FileNotFoundError(f"the adapters to start from, {path}: no such file")
        aset = AdapterSet.load(path)
        aset.check_model(self.shapes, family=self.cfg.family)         # the message names the file
        return self.ordered(aset)

    def say(self, text: str):
        if self.topo.main:
            if self.tc.log is not None:
                self.tc.say(text)
            elif self.tc.progress_bar:
                write(text)

    def use_grad_ckpt(self, stage2_groups: int) -> bool:
        """Gradient checkpointing in stage 2: as asked, or (``auto``) on CUDA and whenever the memory makes stage 2
        train in groups."""
        if self.tc.grad_ckpt != "auto":
            return bool(self.tc.grad_ckpt)
        return self.device.type == "cuda" or stage2_groups > 1

    def amp(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def free_device_memory(self):
        free_device_memory(self.device)

    def site_data(self, store: cal.ActivationStore, site: str, teacher_site: nn.Module) -> SiteData:
        """``site``'s captured fit/eval data from ``store``, batched for its kind."""
        kind = self.site_by_name[site].kind
        return SiteData(site, kind, store.site(site, "fit"), store.site(site, "eval"), teacher_site,
                        self.device, self.compute_dtype, self.amp, batch=4096 if kind == "ff" else 8)

    def make_optimizer(self, params, lr: float):
        if self.optimizer_name == "adamw8bit":
            import bitsandbytes as bnb
            return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        kw = {"fused": True} if self.device.type == "cuda" else {}
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, **kw)

    def ordered(self, aset: AdapterSet) -> AdapterSet:
        """``aset`` with its sites in the model's order (files list tensors alphabetically)."""
        order = [s for s in self.site_order if s in aset.sites]
        return AdapterSet(aset.family, {s: aset.sites[s] for s in order}, aset.norm_groups, aset.metadata,
                          aset.source)

    def owned_sites(self, names) -> list[str]:
        """The sites of ``names`` this process trains, in the model's order."""
        names = set(names)
        return [s for i, s in enumerate(self.site_order) if s in names and self.topo.owns(i)]

    def gather(self, local: dict) -> dict:
        """Every process's ``local`` results merged (a copy of ``local`` in a single process)."""
        if not self.topo.distributed:
            return dict(local)
        parts = [None] * self.topo.world
        torch.distributed.all_gather_object(parts, local)
        out = {}
        for p in parts:
            out.update(p)
        return out

    def fingerprint(self) -> dict:
        """What the work dir's results depend on (a resumed run must match it)."""
        c = self.calib
        calib_fp = fingerprint_tensors([("contexts", c.contexts), ("uncond", c.uncond), ("pooled", c.pooled),
                                        ("uncond_pooled", c.uncond_pooled), ("latents", c.latents)]
                                       + ([("time_ids", c.time_ids)] if c.time_ids is not None else []))
        device = {"type": self.device.type}
        if self.device.type == "cuda" and self.tc.stage2_groups == "auto":
            props = torch.cuda.get_device_properties(self.device)
            device.update(name=props.name, memory=props.total_memory)
        base = None if self.base is None else fingerprint_tensors(sorted(self.base.state_dict().items()))
        return {"version": TRAIN_META_VERSION, "run": self.tc.run_fields(), "teacher": self.teacher_fp,
                "start_from": base,
                "device": device,
                "calibration": calib_fp, "schedule": dataclasses.asdict(c.schedule), "family": self.cfg.family,
                "latent_size": self.latent_size, "world": self.topo.world}

    def prepare_work_dir(self, fp: dict):
        """Create or check the work dir for fingerprint ``fp``; sets :attr:`resume` to what it decided."""
        self.resume = self.work.prepare(fp, self.resume)
