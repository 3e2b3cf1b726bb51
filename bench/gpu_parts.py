"""The GPU suite's parts (run by ``bench/gpu_suite.py``'s runner process); each returns a JSON-able dict.

Every part calls the project's own code: the VRAM study/estimator (``sdslim_core.vram``), the trainer
(``sdslim_core.train.train_adapters``), the slim module builder (``harness.slim_of``), ``sdslim slim`` (as a
subprocess, the real CLI), the interleaved timer of ``bench/core_bench.py`` and the input generator of
``bench/slim_speed.py``. On the GPU the sizes are the real ones; with ``dry=True`` the same code runs on the
CPU with tiny UNets, and what only CUDA has (events, allocator counters, NVML, bitsandbytes) is replaced by
the CPU's equivalent (wall clock, live-tensor counting, process RSS) or skipped with the reason recorded.

Only the fp8-storage wrapper below is the suite's own: weights stored as float8_e4m3fn, cast to the input's
dtype (fp16) in every forward, as UIs that "store fp8, compute fp16" do.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import shutil
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import slim_speed
from core_bench import cpu_timer, interleaved_times
from gpu_report import write_json
from sdslim_core import layout
from sdslim_core.modules.unet import build_diffusers_unet, canonical_shapes
from sdslim_core.train import Calibration, TrainConfig, train_adapters
from sdslim_core.vram import harness
from sdslim_core.vram.estimate import run_worker
from sdslim_core.vram.live import measure_peak, memory_report
from sdslim_core.vram.settings import ARCHS, Settings, select_matrix
from sdslim_core.vram.study import run_study

ROOT = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
RATIOS = (0.75, 0.5, 0.25)


@dataclasses.dataclass
class Context:
    """What a part gets: the mode, a scratch folder, its deadline (epoch seconds) and a partial-result sink."""
    name: str
    dry: bool
    work: Path
    compile: bool
    deadline: float
    _partial: dict | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def remaining(self) -> float:
        return self.deadline - time.time()

    def partial(self, result: dict):
        """Record what the part has so far (kept if it is stopped or crashes)."""
        self._partial = result
        write_json(self.work / "parts" / f"{self.name}.partial.json", result)

    def partial_result(self):
        return self._partial

    def log(self, text: str):
        print(text, flush=True)


# ------------------------------------------------------------------------------------------------ sizes

def tiny_config(family: str):
    """The dry run's UNets: the SD1.5/SDXL block structure (cross-attention levels, SDXL's added embeddings and
    multi-block transformers) at 32 base channels and 2 levels."""
    if family == "sdxl":
        return layout.UNetConfig(family="sdxl", in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2),
                                 num_res_blocks=1, transformer_depth=(0, 2), mid_transformer_depth=1, context_dim=64,
                                 use_linear_proj=True, adm_in_channels=64 + 6 * 256, num_head_channels=16,
                                 time_embed_dim=128)
    return layout.UNetConfig(family="sd15", in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2),
                             num_res_blocks=1, transformer_depth=(1, 0), mid_transformer_depth=1, context_dim=64,
                             use_linear_proj=False, adm_in_channels=None, num_heads=2, time_embed_dim=128)


def unet_config(family: str, dry: bool):
    return tiny_config(family) if dry else layout.config_for_arch(family)


def latent(family: str, dry: bool) -> int:
    """Latent side: SD1.5 512 px, SDXL 1024 px (dry run: 8)."""
    return 8 if dry else {"sd15": 64, "sdxl": 128}[family]


def release():
    """Free what the last part left (the runner calls it between parts)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(name: str, ctx: Context) -> dict:
    if ctx.dry:
        torch.set_num_threads(1)     # tiny models: one thread is as fast, and the dry run shares busy cores
    return {"environment": environment, "vram_study": vram_study, "vram_estimate": vram_estimate,
            "trainer_sd15": lambda c: trainer(c, "sd15"), "trainer_sdxl": lambda c: trainer(c, "sdxl"),
            "speed_sd15": lambda c: speed(c, "sd15"), "speed_sdxl": lambda c: speed(c, "sdxl"),
            "fold": fold, "speed_compile": speed_compile}[name](ctx)


# ---------------------------------------------------------------------------------------- environment

def _version(module: str, dist: str | None = None):
    """(version, None) when ``module`` imports, (None, reason) otherwise."""
    try:
        m = importlib.import_module(module)
    except Exception as err:  # not installed, or broken for this CUDA: both are worth recording
        return None, f"{type(err).__name__}: {err}"[:300]
    try:
        return getattr(m, "__version__", None) or importlib.metadata.version(dist or module), None
    except importlib.metadata.PackageNotFoundError:
        return "unknown", None


def _driver_version():
    try:
        import pynvml
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(ctx: Context) -> dict:
    packages, missing = {}, {}
    for name in ("diffusers", "peft", "safetensors", "bitsandbytes", "xformers", "pynvml", "psutil", "numpy"):
        packages[name], why = _version(name, "nvidia-ml-py" if name == "pynvml" else None)
        if why:
            missing[name] = why
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda": torch.cuda.is_available(),
            "packages": packages, "not_importable": missing, "git_commit": commit, "gpu": None, "skipped": [],
            "package_dirs": {n: os.path.dirname(getattr(sys.modules[n], "__file__", None) or "")
                             for n in ("diffusers", "bitsandbytes") if packages[n]}}
    gpu = ctx.device == "cuda" and torch.cuda.is_available()
    if gpu:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                       "total_gib": props.total_memory / GIB, "multiprocessors": props.multi_processor_count,
                       "driver": _driver_version(), "cudnn": torch.backends.cudnn.version(),
                       "bf16": torch.cuda.is_bf16_supported(),
                       "sdpa": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                "math": torch.backends.cuda.math_sdp_enabled()}}
    else:
        info["skipped"].append("dry run: no GPU, driver or cuDNN to report (CPU only)" if ctx.dry else
                               "no CUDA GPU is visible to torch")
    info["memory"] = memory_report("cuda" if gpu else "cpu").format_text()
    ctx.log(json.dumps(info, indent=1))
    return info


# ------------------------------------------------------------------------------------------------- VRAM

def vram_entries(dry: bool) -> list:
    """[(name, Settings, baseline, batch sizes)]: the seed study's small matrix (SD1.5, 768 px, B = 1, 2, 4) and
    one SDXL point (1024 px, B = 1); tiny UNets at 64 px and B = 1 in the dry run."""

    def shaped(s, family, px):
        return dataclasses.replace(s, arch=family, resolution=64 if dry else px,
                       unet_config=dict(layout.diffusers_config(tiny_config(family))) if dry else None)
    out = [(name, shaped(s, "sd15", 768), base, (1,) if dry else (1, 2, 4)) for name, s, base in
           select_matrix("small")]
    base = select_matrix("base")[0][1]
    out.append(("sdxl_base", shaped(base, "sdxl", 1024), "sdxl_base", (1,)))
    return out


def vram_study(ctx: Context) -> dict:
    """The real training steps (harness shared with the estimator), measured: torch allocated/reserved peaks
    and the whole-device (NVML) peak per point."""
    steps = 1 if ctx.dry else 3
    curves = []
    for name, settings, base, batches in vram_entries(ctx.dry):
        curves += run_study([(name, settings, base)], batches, steps, ctx.device, log=ctx.log)
        ctx.partial({"curves": curves, "steps": steps})
    out = {"curves": curves, "steps": steps}
    if ctx.dry:
        out["skipped"] = ["dry run: allocated = live tensor bytes (LiveTracker on real CPU tensors), no reserved "
                          "(no caching allocator), device peak = process RSS; 8-bit AdamW needs CUDA"]
    return out


def vram_estimate(ctx: Context) -> dict:
    """``sdslim vram estimate`` (fake tensors, no GPU) for the study's points, in one worker process; a curve
    the worker could not estimate is recorded with its error and the others are kept."""
    raw = run_worker([(n, s, b) for n, s, _, b in vram_entries(ctx.dry)], timeout=max(10.0, ctx.remaining() - 5),
                     echo_progress=True)
    failed = {r["name"]: r["error"] for r in raw if "error" in r}
    return {"curves": [r for r in raw if "error" not in r], "errors": failed,
            "device_mode": next((r["device_mode"] for r in raw if "device_mode" in r), None)}


# ---------------------------------------------------------------------------------------------- trainer

def train_config(family: str, dry: bool, work: Path, log):
    """Small data, the trainer's own CUDA defaults (fp16 teacher, bf16 autocast, 8-bit AdamW when bitsandbytes
    imports, gradient checkpointing) and the trainer's own VRAM prediction. SD1.5: every site at uniform ratio 0.5
    (``uniform``: the default allocation's e2e curves cost ~10k UNet forwards, beyond this part's cap); SDXL:
    the ResBlock sites at 0.5, stage 2 in 3 site groups. The dry run predicts for SDXL only (the grouped path):
    each prediction is one more estimator process, ~7 s of CPU."""
    size = dict(n_trajectories=4, sample_steps=2, ff_inputs=16, tokens_per_sample=32, ff_tokens=512, res_maps=16,
                latent_size=8, stage1_steps=2, stage2_steps=6) if dry else \
        dict(n_trajectories=6, sample_steps=3, ff_inputs=32, tokens_per_sample=64, ff_tokens=2048, res_maps=16,
             stage1_steps=3, stage2_steps=30)
    ranks = dict(ratio=0.5, uniform=True) if family == "sd15" else dict(res_ratio=0.5, stage2_groups=3)
    return TrainConfig(**size, **ranks, guidance=7.5, checkpoint_every=1000, vram_estimate=not dry or family == "sdxl",
                       device="cpu" if dry else "cuda", work_dir=str(work / f"train-{family}"), log=log, seed=0)


class _PeakSegments:
    """torch's allocated/reserved peak per stretch of the run, cut at the first progress call of each stage (so a
    stage's first optimizer step counts with the stretch before it)."""
    LABELS = {None: "calibration+init", 1: "stage1", 2: "stage2"}

    def __init__(self, cuda: bool):
        self.cuda, self.stage, self.gib = cuda, None, {}

    def cut(self, label: str):
        if not self.cuda:
            return
        torch.cuda.synchronize()
        self.gib[label] = {"allocated": torch.cuda.max_memory_allocated() / GIB,
                           "reserved": torch.cuda.max_memory_reserved() / GIB}
        torch.cuda.reset_peak_memory_stats()

    def step(self, stage):
        if stage != self.stage:
            self.cut(self.LABELS[self.stage])
            self.stage = stage


def trainer(ctx: Context, family: str) -> dict:
    cuda = ctx.device == "cuda"
    cfg = unet_config(family, ctx.dry)
    torch.manual_seed(0)   # built on the device (fast init), then handed over on the CPU as a user's model is
    unet = build_diffusers_unet(cfg, device=ctx.device, dtype=torch.float16 if cuda else torch.float32)
    unet = unet.to("cpu").eval()
    g = torch.Generator().manual_seed(1)
    pooled = {"pooled": torch.randn(4, cfg.adm_in_channels - 6 * 256, generator=g)} if cfg.adm_in_channels else {}
    calib = Calibration.from_contexts(torch.randn(4, 77, cfg.context_dim, generator=g), **pooled)
    tc = train_config(family, ctx.dry, ctx.work, ctx.log)
    losses = {1: [], 2: []}
    seg = _PeakSegments(cuda)
    t0 = time.time()

    def summary():
        return {"family": family, "steps_done": len(losses[1]) + len(losses[2]), "wall_s": time.time() - t0,
                "loss_last": {k: v[-1] for k, v in losses.items() if v}, "measured_gib": dict(seg.gib)}

    def progress(done, total, info):
        if "of" in info:          # calibration, capture, rank curves, init: no optimizer step (segment "None")
            return
        new_stage = info["stage"] != seg.stage
        seg.step(info["stage"])
        losses[info["stage"]].append(float(info["loss"]))
        if new_stage or done % 10 == 0:
            ctx.partial(summary())
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with measure_peak(ctx.device) as monitor:
        result = train_adapters(unet, cfg, calib, tc, ctx.work / f"adapters-{family}.safetensors", progress=progress)
    seg.cut(seg.LABELS[seg.stage])
    rep = result.report.to_dict()
    unet_error = result.report.unet_error     # raw: to_dict() turns non-finite values into None
    meta = result.adapters.metadata.get("sdslim.train", {})
    vram = rep.get("vram", {})
    finite_adapters = all(bool(torch.isfinite(t).all()) for site in result.adapters.sites.values()
                          for t in site.values())
    all_losses = losses[1] + losses[2]
    out = summary()
    measured = max((s["allocated"] for s in seg.gib.values()), default=None)
    predicted = vram.get("peak_gib")
    out.update({
        "sites": len(result.adapters.sites), "ranks_by_kind": _kinds(result.adapters),
        "config": {k: getattr(tc, k) for k in ("ratio", "res_ratio", "stage1_steps", "stage2_steps", "n_trajectories",
                                               "sample_steps", "stage2_groups")},
        "effective": {"device": meta.get("device"), "optimizer": meta.get("optimizer"),
                      "teacher_dtype": "float16" if cuda else "float32",
                      "bf16_autocast": bool(cuda and torch.cuda.is_bf16_supported()),
                      "grad_ckpt": vram.get("grad_ckpt"), "stage2_groups": rep["timing"].get("stage2_groups")},
        "finite": {"losses": all(math.isfinite(v) for v in all_losses) and bool(all_losses),
                   "adapters": finite_adapters,
                   "unet_error": bool(unet_error) and all(isinstance(v, float) and math.isfinite(v)
                                                          for v in unet_error.values())},
        "unet_error": rep["unet_error"], "timing": rep["timing"],
        "loss": {"stage1_first": losses[1][0] if losses[1] else None, "stage1_last": losses[1][-1] if losses[1] else None,
                 "stage2_first": losses[2][0] if losses[2] else None, "stage2_last": losses[2][-1] if losses[2] else None},
        "measured": {"peak_allocated_gib": measured, "segments_gib": seg.gib,
                     "device_peak_gib": None if monitor.result.device_peak_used_bytes is None else
                     monitor.result.device_peak_used_bytes / GIB, "device_peak_source": monitor.result.source},
        "predicted": {"peak_gib": predicted, "stages_gib": vram.get("stages_gib"), "text": vram.get("text"),
                      "estimator": vram.get("estimator") if isinstance(vram.get("estimator"), str) else "ran"},
        "rel_err": predicted / measured - 1 if predicted and measured else None,
    })
    if not cuda:
        out["skipped"] = ["dry run: no CUDA allocator counters on the CPU (measured peaks n/a; the device peak is "
                          "the process RSS)" + ("" if tc.vram_estimate else "; no VRAM prediction (SDXL's covers it)")]
    return out


def _kinds(aset) -> dict:
    out = {}
    for site in aset.sites:
        out[aset.kind(site)] = out.get(aset.kind(site), 0) + 1
    return out


# ------------------------------------------------------------------------------------------------ speed

class Fp8Layer(nn.Module):
    """A Linear/Conv2d whose weight is stored as float8_e4m3fn and cast to the input's dtype in forward."""

    def __init__(self, layer):
        super().__init__()
        self.register_buffer("weight", layer.weight.detach().to(torch.float8_e4m3fn))
        self.bias = layer.bias
        self.conv = isinstance(layer, nn.Conv2d)
        if self.conv:
            self.stride, self.padding, self.dilation, self.groups = (layer.stride, layer.padding, layer.dilation,
                                                                     layer.groups)

    def forward(self, x):
        w = self.weight.to(x.dtype)
        if self.conv:
            return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return F.linear(x, w, self.bias)


def fp8_storage(model):
    """``model`` (changed in place) with every Linear/Conv2d as an :class:`Fp8Layer`; norms and biases stay."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (nn.Linear, nn.Conv2d)) and getattr(module, "padding_mode", "zeros") == "zeros":
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, Fp8Layer(module))
    return model


def weight_bytes(model) -> int:
    """Bytes of all parameters and buffers (fp8 weights are buffers)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def cuda_timer(fn) -> float:
    """Seconds of GPU time between two CUDA events around ``fn`` (synchronised after each call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def _timer(ctx):
    return cuda_timer if ctx.device == "cuda" else cpu_timer


def _speed_models(family: str, ctx: Context, fp8: bool = True) -> tuple:
    """(config, {name: module}): the original fp16 UNet (random weights, sdpa attention), its slim versions
    sharing untouched weights, and fp8-storage copies of the original and of slim 0.5."""
    cfg = unet_config(family, ctx.dry)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        unet = build_diffusers_unet(cfg, device=ctx.device, dtype=torch.float16).eval()
        models = {"original": unet}
        for r in RATIOS:
            models[f"slim {r}"] = harness.slim_of(unet, r).eval()
        if fp8:
            models["original fp8"] = fp8_storage(copy.deepcopy(unet))
            models["slim 0.5 fp8"] = fp8_storage(copy.deepcopy(models["slim 0.5"]))
    for m in models.values():
        harness.set_attention(m, Settings(attention="sdpa"), None)
    return cfg, models


def _inputs(cfg, unet, side: int, batch: int, device: str):
    """fp16 (sample, timestep, context, extra kwargs) from the harness's input maker."""
    s = Settings(arch=cfg.family if cfg.family in ARCHS else "sd15", resolution=side * 8, precision="fp32",
                 unet_config=dict(layout.diffusers_config(cfg)))
    torch.manual_seed(batch)
    x, t, context, extra = harness.step_inputs(unet, s, batch, device, torch.float16)
    half = lambda d: {k: (v.half() if v.is_floating_point() else v) for k, v in d.items()}  # noqa: E731
    if "added_cond_kwargs" in extra:
        extra = {"added_cond_kwargs": half(extra["added_cond_kwargs"])}
    return x, t, context.half(), extra


def _table(times: dict, models: dict) -> dict:
    base = statistics.median(times["original"])
    return {name: {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3, "n": len(ts),
                   "speedup": base / statistics.median(ts), "weight_gib": weight_bytes(models[name]) / GIB}
            for name, ts in times.items()}


def speed(ctx: Context, family: str) -> dict:
    """UNet forward latency, fp16, interleaved, median of 20 after 3 warm-ups (dry run: 3 after 1), for each
    shape; fp8 storage next to it (bytes and time), with its output error against fp16."""
    cfg, models = _speed_models(family, ctx)
    side = latent(family, ctx.dry)
    batches = (1, 4) if family == "sd15" else (1,)
    repeats, warmup = (3, 1) if ctx.dry else (20, 3)
    out = {"family": family, "dtype": "float16", "attention": "sdpa", "timer": "cuda events" if ctx.device == "cuda"
           else "wall clock (dry run: CPU)", "repeats": repeats, "warmup": warmup, "shapes": {}}
    for batch in batches:
        x, t, context, extra = _inputs(cfg, models["original"], side, batch, ctx.device)

        def call(m):
            return m(x, t, context, **extra)
        with torch.inference_mode():
            ref = {k: call(models[k]).sample.float() for k in ("original", "slim 0.5")}
            fp8_err = {k: float((call(models[f"{k} fp8"]).sample.float() - ref[k]).norm() / ref[k].norm())
                       for k in ref}
            times = interleaved_times(models, call, repeats, warmup, _timer(ctx))
        key = f"{side * 8}px_b{batch}"
        out["shapes"][key] = {"latent": side, "batch": batch, "models": _table(times, models),
                              "fp8_rel_err": fp8_err, "finite": all(bool(torch.isfinite(r).all()) for r in ref.values())}
        ctx.partial(out)
        ctx.log(f"{family} {key}: " + ", ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in
                                                  out["shapes"][key]["models"].items()))
    if ctx.device == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def speed_compile(ctx: Context) -> dict:
    """torch.compile (default mode) of the SD1.5 original and slim 0.5 at 512² B=1: compile time, latency."""
    cfg, eager = _speed_models("sd15", ctx, fp8=False)
    x, t, context, extra = _inputs(cfg, eager["original"], latent("sd15", ctx.dry), 1, ctx.device)

    def call(m):
        return m(x, t, context, **extra)
    models, compile_s = {"original (eager)": eager["original"]}, {}
    with torch.no_grad():   # inference_mode tensors and dynamo's guards do not mix everywhere
        for name in ("original", "slim 0.5"):
            m = torch.compile(eager[name])
            t0 = time.time()
            call(m)
            if ctx.device == "cuda":
                torch.cuda.synchronize()
            compile_s[name] = time.time() - t0
            models[f"{name} (compiled)"] = m
            ctx.partial({"compile_s": compile_s})
        times = interleaved_times(models, call, 3 if ctx.dry else 20, 2, _timer(ctx))
    base = statistics.median(times["original (compiled)"])
    return {"compile_s": compile_s, "models": {k: {"median_ms": statistics.median(v) * 1e3,
                                                   "speedup_vs_compiled_original": base / statistics.median(v)}
                                               for k, v in times.items()}}


# ------------------------------------------------------------------------------------------------- fold

def fold(ctx: Context) -> dict:
    """``sdslim slim --device cuda`` (a child process: the real CLI) on a random full-size SD1.5 single-file
    checkpoint with dense adapters at ratio 0.5 and a rank-16 LoCon, the inputs of ``bench/slim_speed.py``."""
    cfg = unet_config("sd15", ctx.dry)
    folder = ctx.work / "fold"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.time()
        sizes = slim_speed.write_inputs(folder, canonical_shapes(cfg), 0.5, cfg=cfg)
        generate_s = time.time() - t0
        ctx.partial({"generate_s": generate_s, **sizes})
        out_file = folder / "slim.safetensors"
        cmd = [sys.executable, "-m", "sdslim_core.cli", "slim", "--ckpt", str(folder / "sd15.safetensors"),
               "--adapters", str(folder / "adapters.safetensors"), "--lora", f"{folder / 'locon.safetensors'}:0.8",
               "--out", str(out_file), "--device", ctx.device, "--json"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(5.0, ctx.remaining() - 3))
        wall = time.time() - t0
        if proc.returncode:
            raise RuntimeError(f"sdslim slim exited {proc.returncode}: {proc.stderr[-1500:]}")
        info = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        return {"device": ctx.device, "command_s": info["seconds"], "process_wall_s": wall, "generate_s": generate_s,
                "sites": info["sites"], "lora_tensors_merged": len(info["merge"]["merged"]),
                "ckpt_gib": (folder / "sd15.safetensors").stat().st_size / GIB,
                "slim_file_gib": out_file.stat().st_size / GIB, **sizes}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
