"""Training configuration (:class:`TrainConfig`) and parsing of ``--budget`` values."""
from __future__ import annotations

import dataclasses
import json
import re

from ..io.adapters import DEFAULT_FILE_DTYPE, FILE_DTYPES

# Only these fields change what a run computes; a --resume refuses a work dir made with other values.
_RUN_FIELDS = ("ratio", "ff_ratio", "ff_rank", "res_ratio", "budget", "uniform", "budget_by", "allocation",
               "alloc_inputs", "alloc_anchors",
               "budget_bytes_per_param", "stage1_steps", "stage2_steps", "ff_batch_tokens", "res_batch",
               "stage2_batch", "lr1", "lr2", "p0", "p_full_at", "feature_loss", "guided_loss", "control_prob",
               "lora_prob", "lora_scale", "stage2_groups", "grad_clip", "n_trajectories", "sample_steps", "guidance",
               "sampler", "latent_size", "n_noised", "ff_inputs", "tokens_per_sample", "ff_tokens", "res_maps",
               "eval_fraction", "init_methods", "rank_grid", "seed", "calib_dtype", "teacher_dtype", "optimizer",
               "amp", "grad_ckpt", "start_from")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs besides the teacher, the calibration source and the output path.

    Step counts: ``stage1_steps`` is *per site* (sites are trained one after another, independently),
    ``stage2_steps`` counts full-UNet optimizer steps. ``steps`` (CLI ``--steps``) sets both.
    """
    # ---- ranks (one of: ratio / per-kind overrides / budget) ----
    ratio: float | None = None             # the parameter count of uniform width fraction R (0.5 when nothing else
                                           # is given), spent per site by measured error unless ``uniform``
    ff_ratio: float | None = None
    ff_rank: int | None = None
    res_ratio: float | None = None
    budget: str | float | None = None      # "600M" (UNet params) or "1.2GB" (weight bytes)
    budget_bytes_per_param: int = 2        # fp16 weights, for a byte budget
    uniform: bool = False                  # --ratio R: every site at R instead of R's parameters allocated
    budget_by: str = "params"              # what --ratio R's budget holds fixed while ranks are allocated: the
                                           # parameters of uniform R ("params") or its forward FLOPs ("flops")
    allocation: str = "anchored"           # error a budget is spent on: "e2e" = whole-UNet eps error with the site
                                           # slimmed alone (held-out inputs) at every grid rank; "anchored" = the
                                           # site's own error curve scaled to e2e errors measured at
                                           # ``alloc_anchors`` ranks (a few UNet forwards per site instead of one
                                           # batch per grid rank); "site" = the site's own output error
    alloc_anchors: int = 2                 # e2e-measured ranks per site under "anchored" (1 or 2)
    alloc_inputs: int = 16                 # held-out UNet inputs of each e2e measurement
    rank_grid: tuple = (1 / 16, 1 / 8, 3 / 16, 1 / 4, 5 / 16, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8)
    start_from: str | None = None          # an adapter file of the base model (``--from``): its sites and ranks are
                                           # kept (no allocation) and its tensors are an initialisation candidate
    # ---- calibration ----
    n_trajectories: int = 16               # teacher sampling runs (noise seeds × conditionings)
    sample_steps: int = 20                 # sampler steps per trajectory (each one UNet input, ×2 with CFG)
    guidance: float = 7.5                  # CFG scale of the calibration trajectories (1 = no CFG)
    sampler: str = "ddim"
    latent_size: int | None = None         # latent H=W; default from the model (64 SD1.5, 96 SD2, 128 SDXL)
    n_noised: int = 256                    # UNet inputs made from user latents (--latents)
    ff_inputs: int = 256                   # UNet inputs whose FF-site tokens are captured
    tokens_per_sample: int = 128           # FF-site tokens kept per captured input (at most)
    ff_tokens: int = 32768                 # FF-site tokens kept per site (fit + eval), at most
    res_maps: int = 96                     # Res-site feature maps kept per site (fit + eval)
    eval_fraction: float = 0.2             # held-out share of the calibration inputs (errors are measured there)
    calib_dtype: str = "auto"              # storage dtype of captured activations: auto|float32|float16
    ram_budget_gb: float = 2.0             # captured activations are flushed to disk shards beyond this
    # ---- initialisation ----
    init_methods: tuple = ("obs", "act_select", "act_pca", "weight_svd", "select")
    # ---- stage 1 (block-local) ----
    stage1_steps: int = 400
    ff_batch_tokens: int = 1024
    res_batch: int = 4
    lr1: float = 1e-3
    # ---- stage 2 (Theseus) ----
    stage2_steps: int = 1000
    stage2_batch: int = 1                  # UNet inputs per step (per process)
    lr2: float = 1e-4
    p0: float = 0.3                        # replacement probability at step 0 ...
    p_full_at: float = 0.7                 # ... reaching 1 at this fraction of stage 2
    feature_loss: float = 0.0              # weight of the normalised per-site feature loss (0 = output loss only)
    guided_loss: float = 1.0               # weight of the loss on the CFG-guided eps (steps train on CFG pairs)
    control_prob: float = 0.5              # share of steps with random ControlNet-like residuals (train/augment.py)
    lora_prob: float = 0.5                 # share of steps with random LoRA-like deltas of the fold's layers
    lora_scale: float = 0.25               # largest relative norm of those deltas
    stage2_groups: int | str = "auto"      # sites trained in this many groups, one after another (VRAM); auto:
                                           # the fewest that fit the GPU (predicted) or the RAM (stage2.resolve_groups)
    grad_clip: float = 1.0
    # ---- run ----
    seed: int = 0
    device: str = "auto"                   # auto = cuda when available, else cpu
    teacher_dtype: str = "auto"            # auto = float16 on CUDA, float32 otherwise
    amp: str = "auto"                      # auto = bf16 autocast on CUDA (when supported), off on CPU
    optimizer: str = "auto"                # auto = 8-bit AdamW with bitsandbytes on CUDA, else AdamW
    grad_ckpt: str | bool = "auto"         # gradient checkpointing in stage 2 (auto = on CUDA, or in groups)
    offload_teacher: str | bool = "auto"   # teacher weights in RAM, copied to the GPU layer by layer (same result,
                                           # slower); auto: on CUDA when the run does not fit the GPU otherwise
    checkpoint_every: int = 200            # optimizer steps between checkpoints (both stages)
    keep_checkpoints: int = 2
    work_dir: str | None = None            # default: <out>.work next to the output file
    progress_bar: bool = False             # tqdm bars on stderr (the CLI turns them on)
    vram_estimate: bool = False            # run the VRAM estimator before training (the CLI turns it on)
    plan: bool = False                     # print the cost plan (warm-up ETA) before training (the CLI turns it on)
    log: object = None                     # callable(str) for human messages (default: silent)
    adapter_dtype: str = DEFAULT_FILE_DTYPE  # storage dtype of the written adapter file (training is float32)

    def __post_init__(self):
        if self.ratio is None and self.ff_ratio is None and self.ff_rank is None and self.res_ratio is None \
                and self.budget is None:
            self.ratio = 0.5
        if self.budget is not None and any(v is not None for v in (self.ratio, self.ff_ratio, self.ff_rank,
                                                                   self.res_ratio)):
            raise ValueError("--budget allocates ranks itself: give it without --ratio/--ff-rank/--ff-ratio/"
                             "--res-ratio")
        if self.uniform and (self.budget is not None or self.ratio is None):
            raise ValueError("--uniform applies to --ratio (a budget is always allocated)")
        if self.budget_by not in ("params", "flops"):
            raise ValueError(f"budget_by must be params or flops, got {self.budget_by!r}")
        if self.budget_by == "flops" and (self.ratio is None or self.budget is not None):
            raise ValueError("--budget-by flops holds the FLOPs of uniform --ratio fixed: give --ratio")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")
        if self.alloc_anchors not in (1, 2) or self.alloc_inputs < 1:
            raise ValueError("alloc_anchors must be 1 or 2 and alloc_inputs at least 1")
        if self.ff_rank is not None and self.ff_ratio is not None:
            raise ValueError("give --ff-rank or --ff-ratio, not both")
        for name in ("ratio", "ff_ratio", "res_ratio"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.ff_rank is not None and self.ff_rank < 1:
            raise ValueError(f"ff_rank must be ≥ 1, got {self.ff_rank}")
        if self.budget is not None:
            parse_budget(self.budget, self.budget_bytes_per_param)
        if self.stage1_steps < 0 or self.stage2_steps < 0:
            raise ValueError("step counts must be ≥ 0")
        if not 0 <= self.control_prob <= 1 or not 0 <= self.lora_prob <= 1 or self.guided_loss < 0:
            raise ValueError("control_prob and lora_prob must be in [0, 1] and guided_loss ≥ 0")
        if not 0 <= self.p0 <= 1 or not 0 < self.p_full_at <= 1:
            raise ValueError("p0 must be in [0, 1] and p_full_at in (0, 1]")
        if not 0 < self.eval_fraction < 1:
            raise ValueError("eval_fraction must be in (0, 1)")
        if self.sampler not in ("ddim", "euler"):
            raise ValueError(f"sampler must be ddim or euler, got {self.sampler!r}")
        if self.optimizer not in ("auto", "adamw", "adamw8bit"):
            raise ValueError(f"optimizer must be auto, adamw or adamw8bit, got {self.optimizer!r}")
        unknown = set(self.init_methods) - set(INIT_METHODS)
        if unknown or not self.init_methods:
            raise ValueError(f"init_methods must be a non-empty subset of {INIT_METHODS}, got {self.init_methods}")
        self.init_methods = tuple(self.init_methods)
        if self.adapter_dtype not in FILE_DTYPES:
            raise ValueError(f"adapter_dtype must be one of {', '.join(FILE_DTYPES)}, got {self.adapter_dtype!r}")
        self.rank_grid = tuple(self.rank_grid)
        if self.stage2_groups != "auto" and (not isinstance(self.stage2_groups, int) or self.stage2_groups < 1):
            raise ValueError(f"stage2_groups must be 'auto' or a positive integer, got {self.stage2_groups!r}")
        if self.offload_teacher not in ("auto", True, False):
            raise ValueError(f"offload_teacher must be 'auto', True or False, got {self.offload_teacher!r}")
        if self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be ≥ 1")
        if self.start_from is not None:
            self.start_from = str(self.start_from)
            if self.budget is not None:
                raise ValueError("--from keeps the base adapters' ranks: give it without --budget")

    def allocates(self) -> bool:
        """True when ranks come from measured error curves (a budget, or ``--ratio`` without ``--uniform``; never
        with ``start_from``, whose file gives the ranks)."""
        if self.start_from is not None:
            return False
        if self.budget is not None:
            return True
        explicit = any(v is not None for v in (self.ff_ratio, self.ff_rank, self.res_ratio))
        return self.ratio is not None and not self.uniform and not explicit

    def with_steps(self, steps: int) -> "TrainConfig":
        return dataclasses.replace(self, stage1_steps=steps, stage2_steps=steps)

    def run_fields(self) -> dict:
        """The fields that determine the result (for the work dir's run fingerprint and the metadata)."""
        out = {}
        for name in _RUN_FIELDS:
            v = getattr(self, name)
            out[name] = list(v) if isinstance(v, tuple) else v
        return json.loads(json.dumps(out))

    def say(self, text: str):
        if callable(self.log):
            self.log(text)


INIT_METHODS = ("obs", "act_select", "act_pca", "weight_svd", "select", "random")
ALLOCATIONS = ("anchored", "e2e", "site")

_PARAM_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}
_BYTE_SUFFIX = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30,
                "TIB": 2 ** 40}


def parse_budget(value, bytes_per_param: int = 2) -> tuple[str, float, int]:
    """``"600M"`` → ("params", 6e8, 600000000); ``"1.2GB"`` → ("bytes", 1.2e9, params at ``bytes_per_param``).

    Returns (kind, the value as given, the UNet parameter budget). Plain numbers are parameter counts.
    """
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"budget must be positive, got {value}")
        return "params", float(value), int(value)
    text = str(value).strip().replace("_", "").replace(",", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)", text)
    if not m:
        raise ValueError(f"cannot read budget {value!r}: use e.g. 600M (UNet parameters) or 1.2GB (weight bytes)")
    number, suffix = float(m.group(1)), m.group(2).upper()
    if number <= 0:
        raise ValueError(f"budget must be positive, got {value!r}")
    if suffix in _PARAM_SUFFIX:
        return "params", number * _PARAM_SUFFIX[suffix], int(number * _PARAM_SUFFIX[suffix])
    if suffix in _BYTE_SUFFIX:
        n_bytes = number * _BYTE_SUFFIX[suffix]
        return "bytes", n_bytes, int(n_bytes // bytes_per_param)
    if suffix == "B":
        raise ValueError(f"budget {value!r} is ambiguous: write {m.group(1)}G for parameters or "
                         f"{m.group(1)}GB for weight bytes")
    raise ValueError(f"unknown budget unit {m.group(2)!r} in {value!r}: use K/M/G (parameters) or "
                     "KB/MB/GB/GiB (weight bytes)")
