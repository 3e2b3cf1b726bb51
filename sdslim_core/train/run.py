"""The training run: calibration → initialisation (→ budget ranks) → stage 1 → stage 2 → adapter file + report.

Every phase leaves its result in the work dir (calibration shards, ``init/``, ``stage1/``, checkpoints), so a
killed run continues with ``resume=True`` where it stopped and ends with the same adapters as an uninterrupted
one (on the same device and software; CUDA kernels are not all bit-deterministic).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

import torch
from torch import nn

from . import calibration as cal, dist, ranks as ranks_mod, report as report_mod, sensitivity, stage1, stage2, vram
from .. import layout, optional
from ..io.adapters import AdapterSet
from ..io.tensors import load_file, save_file_atomic
from ..layout import rank_policy
from ..modules.unet import load_diffusers_unet
from .config import TrainConfig
from .init import SiteInit
from .sites import SiteData, build_student, make_site_adapter
from .teacher import TeacherPlacement, free_device_memory
from .vram import adapter_param_count
from .workdir import WorkDir

DEFAULT_LATENT = {"sd15": 64, "sd2": 96, "sdxl": 128}
TRAIN_META_VERSION = 1


class TrainResult(NamedTuple):
    """``(adapters, report)``; unpacks as a tuple, ``.report`` prints as the text report."""
    adapters: AdapterSet
    report: report_mod.TrainReport


# ------------------------------------------------------------------------------------------------ teacher

def _heads_from_diffusers(module) -> dict:
    conf = getattr(module, "config", None)
    if conf is None:
        return {}
    ahd = conf.get("attention_head_dim") if hasattr(conf, "get") else getattr(conf, "attention_head_dim", None)
    widths = list(conf.get("block_out_channels", ()) if hasattr(conf, "get") else ())
    if isinstance(ahd, int):
        return {"num_heads": ahd}
    if ahd and widths and len(ahd) == len(widths):
        per = {w // h for w, h in zip(widths, ahd) if h and w % h == 0}
        if len(per) == 1 and len(set(ahd)) > 1:
            return {"num_head_channels": per.pop()}
        if len(set(ahd)) == 1:
            return {"num_heads": int(ahd[0])}
    return {}


def teacher_weights(unet, cfg: layout.UNetConfig | None = None) -> tuple[Mapping, layout.UNetConfig]:
    """(canonical weights, UNetConfig) from a diffusers/LDM module, a state dict in any naming, or an
    :class:`~sdslim_core.modules.unet.CheckpointUNet`."""
    if hasattr(unet, "weights") and hasattr(unet, "config") and isinstance(getattr(unet, "config"),
                                                                          layout.UNetConfig):
        return unet.weights, cfg or unet.config
    if isinstance(unet, nn.Module):
        sd = {k: v.detach() for k, v in unet.state_dict().items()}
        canon, naming, _ = layout.to_canonical(sd)
        if cfg is None:
            if naming == "diffusers":
                heads = _heads_from_diffusers(unet)
            else:
                heads = {k: int(getattr(unet, k)) for k in ("num_heads", "num_head_channels")
                         if isinstance(getattr(unet, k, None), int) and getattr(unet, k) > 0}
            cfg = layout.config_from_state_dict(canon, heads)
        return canon, cfg
    if isinstance(unet, Mapping):
        canon, _, _ = layout.to_canonical(unet)
        return canon, cfg or layout.config_from_state_dict(canon)
    raise TypeError(f"cannot train from a {type(unet).__name__}: pass a UNet module, a state dict or an "
                    "opened checkpoint")


def _fingerprint_tensors(items) -> str:
    h = hashlib.sha256()
    for k, v in items:
        h.update(k.encode())
        if v is None:
            continue
        t = v.detach().reshape(-1)[:1024].to("cpu", torch.float32).contiguous()
        h.update(str(tuple(v.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:24]


# ---------------------------------------------------------------------------------------------- progress

class Progress:
    """tqdm bars (optional, stderr) plus the caller's ``callback(done, total, info)`` after every step; the
    callback may raise to stop the run (everything up to the last checkpoint is kept)."""

    def __init__(self, callback: Callable | None, bars: bool):
        self.callback, self.bars = callback, bars
        self.total = 0
        self.bar = None

    def start_stage(self, name: str, total: int, unit: str = "step", initial: int = 0):
        if self.bars:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=name, unit=unit, file=sys.stderr, dynamic_ncols=True,
                            leave=True)

    def skip(self, position: int):
        if self.bar is not None and position > self.bar.n:
            self.bar.update(position - self.bar.n)

    def step(self, done: int, info: dict):
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{info['loss']:.4g}"} if "loss" in info else {}
            if "site" in info:
                post["site"] = report_mod._short(info["site"])
            if "p" in info:
                post["p"] = info["p"]
            self.bar.set_postfix(post, refresh=False)
        if self.callback is not None:
            self.callback(done, self.total, info)

    def end_stage(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# --------------------------------------------------------------------------------------------------- run

class Run:
    def __init__(self, weights: Mapping, cfg: layout.UNetConfig, tc: TrainConfig, calib: cal.Calibration | None,
                 out_path, callback: Callable | None, resume: bool | str):
        self.tc, self.cfg, self.weights = tc, cfg, weights
        self.topo = dist.topology(tc.device)
        self.device = self.topo.device
        cuda = self.device.type == "cuda"
        self.teacher_dtype = _dtype(tc.teacher_dtype, torch.float16 if cuda else torch.float32)
        self.compute_dtype = self.teacher_dtype
        if tc.amp == "auto":
            self.amp_dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else None
        else:
            self.amp_dtype = {"off": None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[tc.amp]
        self.grad_ckpt = cuda if tc.grad_ckpt == "auto" else bool(tc.grad_ckpt)
        self.naming = "diffusers"
        self.teacher = load_diffusers_unet(weights, cfg, dtype=self.teacher_dtype, device="cpu")
        self.teacher.eval().requires_grad_(False)
        self.placement = TeacherPlacement(self.teacher, cfg, self.device)
        canon_params, _, _ = layout.to_canonical(dict(self.teacher.state_dict()))
        self.shapes = {k: tuple(v.shape) for k, v in canon_params.items()}
        self.teacher_fp = _fingerprint_tensors((k, canon_params[k]) for k in sorted(canon_params)[::7])
        del canon_params
        self.site_list = layout.sites(self.shapes)
        self.site_order = [s.name for s in self.site_list]
        self.site_by_name = {s.name: s for s in self.site_list}
        self.out_path = Path(out_path)
        self.work_dir = Path(tc.work_dir) if tc.work_dir else self.out_path.with_name(self.out_path.name + ".work")
        self.work = WorkDir(self.work_dir, self.topo, self.say)
        self.ckpt_dir = self.work.checkpoints
        self.resume = resume
        self.calib = calib or cal.Calibration.unconditional()
        self.latent_size = tc.latent_size or DEFAULT_LATENT.get(cfg.family, 64)
        self.progress = Progress(callback if self.topo.main or callback is None else None, tc.progress_bar and
                                 self.topo.main)
        self.timing: dict = {}
        self.stage1_total = 0
        self.stage2_groups = 1
        self.optimizer_name = self._optimizer_kind()

    # ------------------------------------------------------------------ helpers
    def say(self, text: str):
        if self.topo.main:
            if self.tc.log is not None:
                self.tc.say(text)
            elif self.tc.progress_bar:
                from tqdm.auto import tqdm
                tqdm.write(text, file=sys.stderr)

    def amp(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def free_device_memory(self):
        free_device_memory(self.device)

    def norm_eps(self, site: str) -> float:
        if self.site_by_name[site].kind != "res":
            return 1e-5
        return self.placement.site(site).get_submodule(layout.RES_LAYERS[self.naming]["norm2"]).eps

    def site_data(self, site: str, teacher_site: nn.Module) -> SiteData:
        kind = self.site_by_name[site].kind
        return SiteData(site, kind, self.store.site(site, "fit"), self.store.site(site, "eval"), teacher_site,
                        self.device, self.compute_dtype, self.amp, batch=4096 if kind == "ff" else 8)

    def _optimizer_kind(self) -> str:
        """adamw8bit (bitsandbytes, CUDA only) when asked for, or for ``auto`` when it imports; else adamw."""
        if self.device.type != "cuda" or self.tc.optimizer == "adamw":
            return "adamw"
        if self.tc.optimizer == "adamw8bit":
            optional.require("bitsandbytes", "--optimizer adamw8bit")
            return "adamw8bit"
        try:
            optional.require("bitsandbytes", "8-bit AdamW (--optimizer auto)")
        except optional.MissingDependency as err:
            self.say(f"{err}; using AdamW")
            return "adamw"
        return "adamw8bit"

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

    def resolve_stage2_groups(self, ranks: dict) -> int:
        """``stage2_groups``, with ``auto`` = the fewest groups whose adapters, gradients, optimizer states and
        bf16 copies fit next to the fp16 teacher and a 1.5 GiB margin (activations of the checkpointed UNet at
        batch 1, CUDA context, allocator slack) in 92% of the GPU's memory (finished groups run folded, their
        teacher layers off the device, so the teacher is the most the other sites ever take)."""
        tc = self.tc
        if tc.stage2_groups != "auto":
            return int(tc.stage2_groups)
        if self.device.type != "cuda":
            return 1
        total = torch.cuda.get_device_properties(self.device).total_memory
        teacher = ranks_mod._count(self.shapes) * torch.finfo(self.teacher_dtype).bits // 8
        g = stage2.auto_groups(teacher, adapter_param_count(self.site_list, ranks), self.optimizer_name, total,
                               len(ranks))
        if g == len(ranks) and g > 1:
            self.say("stage 2: the teacher nearly fills this GPU; training one site at a time")
        return g

    def owned_sites(self, names) -> list[str]:
        names = set(names)
        return [s for i, s in enumerate(self.site_order) if s in names and self.topo.owns(i)]

    def gather(self, local: dict) -> dict:
        if not self.topo.distributed:
            return dict(local)
        parts = [None] * self.topo.world
        torch.distributed.all_gather_object(parts, local)
        out = {}
        for p in parts:
            out.update(p)
        return out

    # --------------------------------------------------------------- work dir
    def fingerprint(self) -> dict:
        c = self.calib
        calib_fp = _fingerprint_tensors([("contexts", c.contexts), ("uncond", c.uncond), ("pooled", c.pooled),
                                         ("uncond_pooled", c.uncond_pooled), ("latents", c.latents)])
        device = {"type": self.device.type}
        if self.device.type == "cuda" and self.tc.stage2_groups == "auto":
            props = torch.cuda.get_device_properties(self.device)
            device.update(name=props.name, memory=props.total_memory)
        return {"version": TRAIN_META_VERSION, "run": self.tc.run_fields(), "teacher": self.teacher_fp,
                "device": device,
                "calibration": calib_fp, "schedule": dataclasses.asdict(c.schedule), "family": self.cfg.family,
                "latent_size": self.latent_size, "world": self.topo.world}

    def prepare_work_dir(self, fp: dict):
        self.resume = self.work.prepare(fp, self.resume)

    # ------------------------------------------------------------ calibration
    def calibrate(self, fp: dict):
        folder = self.work_dir / "calib"
        man = cal.read_manifest(folder)
        if not (self.resume and man and man.get("fingerprint") == fp):
            man = None
        if man is None and self.topo.main:
            t0 = time.perf_counter()
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True, exist_ok=True)
            teacher = self.placement.on_device()
            self.progress.start_stage("calibration", self.tc.n_trajectories if self.calib.latents is None
                                      else self.tc.n_noised, unit="traj" if self.calib.latents is None else "input")
            bank = cal.build_inputs(teacher, self.cfg, self.calib, self.tc, self.device, self.compute_dtype,
                                    self.latent_size, self.amp, progress=lambda d, n: self.progress.skip(d))
            self.progress.end_stage()
            bank.save(folder / cal.BANK_FILE)
            store = cal.ActivationStore(folder, self.tc.ram_budget_gb * 1e9, self._calib_dtype())
            self.progress.start_stage("capture", 1, unit="input")
            if self.progress.bar is not None:
                self.progress.bar.reset(total=None)
            cal.capture_sites(teacher, self.cfg, bank, self.site_list, self.tc, store, self.device, self.compute_dtype,
                              self.amp, progress=lambda d, n: self._bar_to(d, n))
            self.progress.end_stage()
            cal.write_manifest(folder, store, fp, self.calib.description)
            self.placement.release()
            self.timing["calibration_s"] = time.perf_counter() - t0
            self.say(f"calibration: {len(bank)} UNet inputs ({int(bank.is_eval.sum())} held out), "
                     f"{len(store.shards)} shard(s) in {folder}")
        self.topo.barrier()
        man = cal.read_manifest(folder)
        self.bank = cal.InputBank.load(folder / cal.BANK_FILE)
        self.store = cal.ActivationStore.open(folder, man["store"])
        return self.bank, self.store

    def _bar_to(self, done, total):
        if self.progress.bar is not None:
            self.progress.bar.total = total
            self.progress.skip(done)

    def _calib_dtype(self):
        if self.tc.calib_dtype == "auto":
            return torch.float16 if self.teacher_dtype in (torch.float16, torch.bfloat16) else torch.float32
        return getattr(torch, self.tc.calib_dtype)

    # --------------------------------------------------------- initialisation
    def _site_init(self, site: str) -> tuple[SiteInit, nn.Module]:
        teacher_site = self.placement.site_on_device(site)
        data = self.site_data(site, teacher_site)
        return SiteInit(self.site_by_name[site], teacher_site, self.naming, data, self.weights, self.cfg.family,
                        self.device, self.compute_dtype, self.amp, seed=self.tc.seed), teacher_site

    def choose_ranks(self) -> tuple[dict, dict]:
        """Ranks per site: explicit (``--uniform``, per-kind values) or allocated under the parameter budget
        (``--budget``, or the parameters of uniform ``--ratio``) from measured cost-vs-rank curves."""
        tc = self.tc
        if not tc.allocates():
            return ranks_mod.ratio_ranks(self.site_list, tc), {}
        fractions = tuple(tc.rank_grid) + ((tc.ratio,) if tc.ratio is not None else ())
        grids = {s.name: ranks_mod.rank_grid(s, fractions) for s in self.site_list}
        method = tc.init_methods[0]
        ids = sensitivity.probe_ids(self.bank, tc.alloc_inputs, tc.seed)
        local = {}
        todo = self.owned_sites([s for s in self.site_order if grids[s]])
        self.progress.start_stage("rank curves", len(todo), unit="site")
        for site in todo:
            path = self.work_dir / "init" / f"curve-{self.site_order.index(site):04d}.json"
            if self.resume and path.exists():
                curve = {int(k): v for k, v in json.loads(path.read_text()).items()}
            else:
                si, _ = self._site_init(site)
                if tc.allocation == "site":
                    curve = {r: e * e for r, e in si.curve(grids[site], method).items()}
                else:
                    teacher = self.placement.on_device()
                    curve = {}
                    for r in grids[site]:
                        one = AdapterSet(self.cfg.family, {site: si.tensors(method, r)},
                                         {site: rank_policy.res_groups(si.site.width, r)} if si.site.kind == "res"
                                         else {})
                        curve[r] = sensitivity.e2e_error(teacher, one, self.bank, ids, self.device,
                                                         self.compute_dtype, self.amp) ** 2
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(curve))
                tmp.replace(path)
                del si
                self.free_device_memory()
            local[site] = curve
            self.progress.skip(len(local))
        self.progress.end_stage()
        self.placement.release()
        curves = self.gather(local)
        if tc.budget_by == "flops":
            full, per_rank = sensitivity.flops_per_rank(self.placement.on_device(), self.cfg, self.site_list, self.bank,
                                                        self.device, self.compute_dtype, self.amp)
            self.placement.release()
            budget = ranks_mod.uniform_total(self.site_list, tc.ratio, full, per_rank)
            ranks, info = ranks_mod.allocate(self.site_list, self.shapes, curves, budget, per_rank, full, "flops")
        else:
            budget = ranks_mod.budget_params(tc, self.site_list, self.shapes)
            ranks, info = ranks_mod.allocate(self.site_list, self.shapes, curves, budget)
        unit = info["unit"]
        info.update(allocation=tc.allocation, method=method,
                    curves={s: {str(r): e for r, e in c.items()} for s, c in curves.items()})
        what = f"budget {tc.budget}" if tc.budget is not None else f"the {unit} of uniform ratio {tc.ratio}"
        self.say(f"{what}: {info[f'slim_{unit}'] / 1e6:.2f}M of {budget / 1e6:.2f}M {unit} used, "
                 f"{len(ranks)} sites slimmed (allocated by {tc.allocation} error)")
        return ranks, info

    def initialise(self, ranks: dict) -> tuple[AdapterSet, list, dict]:
        init_file = self.work_dir / "init.safetensors"
        if self.resume and init_file.exists():
            aset = self.ordered(AdapterSet.load(init_file))
            meta = aset.metadata["sdslim.init"]
            return aset, meta["table"], {k: float(v) for k, v in meta["site_error"].items()}
        t0 = time.perf_counter()
        todo = self.owned_sites(ranks)
        self.progress.start_stage("init", len(todo), unit="site")
        for n, site in enumerate(todo):
            i = self.site_order.index(site)
            path = self.work_dir / "init" / f"site-{i:04d}.safetensors"
            if self.resume and path.exists():
                self.progress.skip(n + 1)
                continue
            si, _ = self._site_init(site)
            tensors, chosen, errors = si.best(ranks[site], self.tc.init_methods)
            s = self.site_by_name[site]
            row = {"site": site, "kind": s.kind, "width": s.width, "rank": ranks[site], "errors": errors,
                   "chosen": chosen}
            save_file_atomic({f"{site}/{k}": v for k, v in tensors.items()}, path,
                             {"sdslim.init": {"row": report_mod._finite(row)}})
            del si
            self.free_device_memory()
            self.progress.skip(n + 1)
        self.progress.end_stage()
        self.timing["init_s"] = time.perf_counter() - t0
        self.topo.barrier()
        sites, groups, table, errs = {}, {}, [], {}
        for site in self.site_order:
            if site not in ranks:
                continue
            i = self.site_order.index(site)
            tensors, meta = load_file(self.work_dir / "init" / f"site-{i:04d}.safetensors")
            row = json.loads(meta["sdslim.init"])["row"]
            row["errors"] = {k: (float("inf") if v is None else v) for k, v in row["errors"].items()}
            sites[site] = {k.split("/", 1)[1]: v for k, v in tensors.items()}
            r = ranks[site]
            if self.site_by_name[site].kind == "res":
                groups[site] = rank_policy.res_groups(self.site_by_name[site].width, r)
            table.append(row)
            errs[site] = row["errors"][row["chosen"]]
        aset = AdapterSet(self.cfg.family, sites, groups)
        aset.metadata["sdslim.init"] = {"table": report_mod._finite(table), "site_error": errs}
        if self.topo.main:
            aset.save(init_file)
        self.topo.barrier()
        return aset, table, errs

    def measure_unet(self, aset: AdapterSet) -> float | None:
        if not self.topo.main:
            return None
        err = stage2.measure(self, aset, self.bank)
        self.placement.release()
        return err

    def final_site_errors(self, aset: AdapterSet) -> dict:
        local = {}
        for site in self.owned_sites(aset.sites):
            teacher_site = self.placement.site_on_device(site)
            data = self.site_data(site, teacher_site)
            adapter = make_site_adapter(site, aset.kind(site), aset.sites[site], aset.groups(site),
                                        self.norm_eps(site)).to(self.device)
            student = build_student(teacher_site, aset.kind(site), self.naming, adapter)
            local[site] = data.eval_error(student, self.device, self.compute_dtype, self.amp)
            del data, student, adapter
        self.free_device_memory()
        return self.gather(local)

    # --------------------------------------------------------------------- run
    def execute(self) -> TrainResult:
        tc = self.tc
        started = time.perf_counter()
        fp = self.fingerprint()
        self.prepare_work_dir(fp)
        vram_info = {}
        if tc.vram_estimate and not tc.allocates() and self.topo.main:
            r0 = ranks_mod.ratio_ranks(self.site_list, tc)
            self.stage2_groups = self.resolve_stage2_groups(r0)
            vram_info = self.predict_vram(r0)
        bank, _ = self.calibrate(fp)
        ranks, budget_info = self.choose_ranks()
        if not ranks:
            raise ValueError("no site would be slimmed with these settings (every rank is the full width)")
        if tc.vram_estimate and tc.allocates() and self.topo.main:
            self.stage2_groups = self.resolve_stage2_groups(ranks)
            vram_info = self.predict_vram(ranks)
        aset_init, table, err_init = self.initialise(ranks)
        report = report_mod.TrainReport(family=self.cfg.family, ranks=dict(aset_init.ranks()), init_table=table,
                                        vram=vram_info, budget={k: v for k, v in budget_info.items()
                                                                if k != "curves"},
                                        work_dir=str(self.work_dir))
        unet_err = {}
        stage1_file = self.work_dir / "stage1.safetensors"
        if self.resume and stage1_file.exists():
            aset_s1 = self.ordered(AdapterSet.load(stage1_file))
            info = aset_s1.metadata["sdslim.stage1"]
            err_s1 = {k: float(v) for k, v in info["site_error"].items()}
            unet_err = {k: v for k, v in info["unet_error"].items()}
            n_owned = len(self.owned_sites(aset_init.sites))
            self.stage1_total = tc.stage1_steps * n_owned
        else:
            unet_err["init"] = self.measure_unet(aset_init)
            n_owned = len(self.owned_sites(aset_init.sites))
            self.stage1_total = tc.stage1_steps * n_owned
            self.progress.total = self.stage1_total + tc.stage2_steps
            tensors, err_s1 = stage1.run_stage1(self, aset_init, err_init)
            aset_s1 = self.ordered(AdapterSet(self.cfg.family, tensors, aset_init.norm_groups))
            unet_err["stage1"] = self.measure_unet(aset_s1)
            aset_s1.metadata["sdslim.stage1"] = {"site_error": err_s1, "unet_error": unet_err}
            if self.topo.main:
                aset_s1.save(stage1_file)
            self.topo.barrier()
        self.progress.total = self.stage1_total + tc.stage2_steps
        self.stage2_groups = self.resolve_stage2_groups(aset_init.ranks())
        if tc.stage2_steps > 0:
            tensors2, before, after = stage2.run_stage2(self, aset_s1, bank)
            final = self.ordered(AdapterSet(self.cfg.family, tensors2, aset_init.norm_groups))
            unet_err["stage2"] = after
            site_err = self.final_site_errors(final)
        else:
            final, site_err = aset_s1, err_s1
        self.placement.release()
        report.site_error = {"init": err_init, "stage1": err_s1}
        if tc.stage2_steps > 0:
            report.site_error["final"] = site_err
        report.unet_error = {k: v for k, v in unet_err.items() if v is not None}
        report.steps = {"stage1_per_site": tc.stage1_steps, "stage2": tc.stage2_steps}
        self.timing["total_s"] = time.perf_counter() - started
        report.timing = dict(self.timing)
        shapes = self.shapes
        report.params = {"original": ranks_mod.slim_param_count(shapes, {}),
                         "slim": ranks_mod.slim_param_count(shapes, final.ranks()),
                         "adapters": adapter_param_count(self.site_list, final.ranks())}
        report.calibration = dict(self.calib.description, n_inputs=len(bank), n_eval=int(bank.is_eval.sum()),
                                  latent_size=self.latent_size, trajectories=tc.n_trajectories
                                  if self.calib.latents is None else None, sample_steps=tc.sample_steps,
                                  guidance=tc.guidance)
        final.metadata = {"sdslim.train": self.train_metadata(report, site_err, table),
                          "sdslim.base": {"family": self.cfg.family, "fingerprint": fp["teacher"],
                                          "params": report.params["original"]}}
        report.out = str(self.out_path)
        if self.topo.main:
            final.save(self.out_path)
            plot = self.out_path.with_name(self.out_path.stem + ".errors.png")
            try:
                report.plot = str(report_mod.plot_site_errors(report, plot))
            except Exception as err:  # a plot must never lose a finished training
                self.say(f"plot failed: {err}")
        self.topo.barrier()
        return TrainResult(final, report)

    def train_metadata(self, report, site_err: dict, table: list) -> dict:
        tc = self.tc
        return report_mod._finite({
            "version": TRAIN_META_VERSION,
            "data": report.calibration,
            "steps": report.steps,
            "site_error": site_err,
            "site_error_init": report.site_error.get("init", {}),
            "site_error_stage1": report.site_error.get("stage1", {}),
            "unet_error": report.unet_error,
            "init_method": {row["site"]: row["chosen"] for row in table},
            "ranks": {"ratio": tc.ratio, "ff_ratio": tc.ff_ratio, "ff_rank": tc.ff_rank, "res_ratio": tc.res_ratio,
                      "budget": tc.budget, **({"budget_info": report.budget} if report.budget else {})},
            "config": tc.run_fields(),
            "optimizer": self.optimizer_name,
            "device": str(self.device),
            "processes": self.topo.world,
        })

    def predict_vram(self, ranks: dict) -> dict:
        opt = self.optimizer_name if self.device.type == "cuda" else \
            ("adamw8bit" if self.tc.optimizer == "adamw8bit" else "adamw")
        try:
            import importlib
            importlib.import_module("sdslim_core.vram.estimate")
            use = True
        except ImportError:
            use = False
        sizes = {s.name: vram.adapter_param_count([s], ranks) for s in self.site_list if s.name in ranks}
        groups = stage2.split_groups(self.site_order, sizes, self.stage2_groups)
        train_sites = max(groups, key=lambda g: sum(sizes[s] for s in g))
        if use:
            self.say("predicting peak VRAM (the VRAM estimator runs the training step on fake tensors, ~1 min)…")
        info = vram.predict(self.cfg, ranks, self.tc, self.latent_size, opt,
                            grad_ckpt=self.grad_ckpt or self.device.type != "cuda", use_estimator=use,
                            train_sites=train_sites if len(groups) > 1 else None)
        self.say("VRAM: " + info["text"])
        return info


def _dtype(name: str, default: torch.dtype) -> torch.dtype:
    if name in ("auto", None):
        return default
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}")
    return table[name]


def train_adapters(unet, cfg: layout.UNetConfig | None = None, calib: cal.Calibration | None = None,
                   train_cfg: TrainConfig | None = None, out_path=None, progress: Callable | None = None,
                   resume: bool | str = False, *, out=None, contexts=None, **overrides) -> TrainResult:
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
    return Run(weights, cfg, tc, calib, out_path, progress, resume).execute()
