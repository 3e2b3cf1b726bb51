"""The GPU suite's parts (run by ``bench/gpu_suite.py``'s runner process): the shared context and sizes, the
environment part, and the dispatch to the parts' modules (each part returns a JSON-able dict):

- ``gpu_vram.py``: the seed's training-VRAM study measured, the estimator for the same points (background, CPU),
  sampling VRAM (original / slim / fp8 / GGUF kept quantised, UNet at CFG batch 2, VAE decode);
- ``gpu_trainer.py``: the trainer on CUDA (every phase, device peak per phase vs its prediction, steps/s, the
  recipes' time from the trainer's plan), under an 8 GB device limit;
- ``gpu_speed.py``: UNet speed eager and CUDA-graph replay with FLOPs, and where slim layers lose time (profile).

Every part calls the project's own code. On the GPU the sizes are the real ones; with ``dry=True`` the same code
runs on the CPU with tiny UNets, and what only CUDA has (events, graphs, allocator counters, NVML, bitsandbytes)
is replaced by the CPU's equivalent (wall clock, eager calls, live-tensor counting, process RSS) or skipped with
the reason recorded.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpu_report import write_json
from sdslim_core import layout
from sdslim_core.vram import harness
from sdslim_core.vram.live import memory_report
from sdslim_core.vram.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
GIB = 2 ** 30


@dataclasses.dataclass
class Context:
    """What a part gets: the mode, a scratch folder shared by the run's parts, its deadline (epoch seconds) and a
    partial-result sink."""
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

    def earlier(self, part: str) -> dict:
        """The result an earlier part of this run recorded (``{}`` when it did not run or recorded nothing)."""
        for suffix in ("json", "partial.json"):
            f = self.work / "parts" / f"{part}.{suffix}"
            if f.exists():
                rec = json.loads(f.read_text())
                return (rec.get("result") if suffix == "json" else rec) or {}
        return {}

    def context_gib(self):
        """The measured context of this run's environment part (None in the dry run or when it did not run)."""
        return (self.earlier("environment").get("context") or {}).get("context_gib")

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
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(name: str, ctx: Context) -> dict:
    if ctx.dry:
        torch.set_num_threads(1)     # tiny models: one thread is as fast, and the dry run shares busy cores
    module, func, *args = PARTS[name]
    return getattr(importlib.import_module(module) if module else sys.modules[__name__], func)(ctx, *args)


PARTS = {"environment": (None, "environment"),
         "seed_study": ("gpu_vram", "seed_study"), "vram_estimate": ("gpu_vram", "vram_estimate"),
         "sampling_vram": ("gpu_vram", "sampling_vram"),
         "trainer_sd15": ("gpu_trainer", "trainer", "sd15"), "trainer_sdxl": ("gpu_trainer", "trainer", "sdxl"),
         "speed_sd15": ("gpu_speed", "speed", "sd15"), "speed_sdxl": ("gpu_speed", "speed", "sdxl"),
         "profile": ("gpu_speed", "profile"), "speed_compile": ("gpu_speed", "speed_compile")}


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
    info["context"] = measure_context(ctx)
    ctx.log(json.dumps(info, indent=1))
    return info


def measure_context(ctx: Context) -> dict:
    """What the device holds for this process besides torch's reserve (the item-4 input ``context``): NVML's
    whole-device reading before this process touched CUDA, then after a tiny SD-structure UNet (the dry run's) ran
    one bf16-autocast training step with AdamW and one fp16 sampling step (the CUDA context, cuBLAS/cuDNN handles
    and the kernels such steps load), minus torch's reserve. The dry run has no device: None with the reason."""
    if ctx.dry or not torch.cuda.is_available():
        return {"context_gib": None, "why": "dry run: no CUDA device (the estimator's device peak uses the named "
                "default)" if ctx.dry else "no CUDA GPU"}
    from sdslim_core.vram.live import device_used
    before = device_used(0)
    s = Settings(arch="sd15", resolution=64, unet_config=dict(layout.diffusers_config(tiny_config("sd15"))))
    with torch.device("cuda"):
        unet = harness.build_model(s)
        params = harness.prepare_training(unet, s, None)
        opt = harness.make_optimizer(params, s)
        harness.train_step(unet, opt, params, s, 2, torch.device("cuda"))
        unet.to(torch.bfloat16).eval()
        harness.sampling_step(unet, dataclasses.replace(s, sampling=True, precision="full-bf16"), 2,
                              torch.device("cuda"))
    torch.cuda.synchronize()
    del unet, params, opt
    gc.collect()
    used, reserved = device_used(0), torch.cuda.memory_reserved()
    out = {"before_gib": None if before is None else before / GIB, "after_gib": None if used is None else used / GIB,
           "reserved_gib": reserved / GIB,
           "context_gib": None if used is None else (used - reserved) / GIB,
           "process_gib": None if None in (used, before) else (used - before - reserved) / GIB,
           "source": "nvml" if used is not None else None}
    torch.cuda.empty_cache()
    return out


