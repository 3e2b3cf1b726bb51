"""Training/sampling settings shared by the estimator and the GPU study (torch-free at import; reading a ``--ckpt``
file imports sdslim's file readers).

A ``Settings`` is one curve: everything but the batch size. ``MATRIX`` is the seed study's
one-change-at-a-time matrix (SD1.5, 768 px, AMP bf16, AdamW, text encoder frozen, no VAE).
"""
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from .. import layout

PRECISIONS = ("fp32", "amp-bf16", "full-bf16")
OPTIMIZERS = ("adamw", "adamw8bit", "adamw-fused")
ATTENTIONS = ("sdpa", "xformers")
LORA_KINDS = ("lora", "locon", "loha", "lora-fa")
ARCHS = ("sd15", "sd2", "sdxl")
SAMPLING_PRECISION_LABELS = {"fp32": "fp32 weights", "amp-bf16": "fp32 weights + bf16 autocast",
                             "full-bf16": "2-byte weights (fp16/bf16)"}
DEFAULT_BATCH_SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16)

# UNet2DConditionModel configs of the published architectures (from ``layout``; nothing is fetched).
SAMPLE_SIZES = {"sd15": 64, "sd2": 96, "sdxl": 128}
UNET_CONFIGS = {arch: layout.diffusers_config(layout.config_for_arch(arch), sample_size)
                for arch, sample_size in SAMPLE_SIZES.items()}

# Frozen models kept on the GPU unless offloaded (parameter counts taken from the typed
# transformers/diffusers configs on the meta device): VAE (same for all three), text encoder(s).
VAE_PARAMS = 83_653_863
TE_PARAMS = {"sd15": 123_060_480, "sd2": 340_387_840, "sdxl": 123_060_480 + 694_659_840}


@dataclass(frozen=True)
class Settings:
    """One curve of the study/estimate (the batch size is the x axis)."""
    arch: str = "sd15"
    resolution: int = 768
    precision: str = "amp-bf16"
    optimizer: str = "adamw"
    grad_ckpt: bool = False
    attention: str = "sdpa"
    lora_rank: int = 0
    lora_kind: str = "lora"
    resident_te_vae: bool = False
    sampling: bool = False
    slim_ratio: float = 0.0
    ckpt: str = ""
    unet_config: dict = field(default=None, hash=False)  # overrides arch (tests, --ckpt)
    slim_ranks: dict = field(default=None, hash=False)  # site -> rank: the slim UNet of a slim --ckpt
    quantised: dict = field(default=None, hash=False)  # canonical key -> [GGUF type, bytes] of a GGUF --ckpt
    model_factory: str = ""  # "module:function" returning a UNet-like module (sampling of other models)

    def __post_init__(self):
        checks = ((self.precision, PRECISIONS), (self.optimizer, OPTIMIZERS),
                  (self.attention, ATTENTIONS), (self.lora_kind, LORA_KINDS))
        for value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        if self.arch not in ARCHS and self.unet_config is None and not self.ckpt:
            raise ValueError(f"unknown arch {self.arch!r} (use {', '.join(ARCHS)} or --ckpt)")
        if self.resolution % 8:
            raise ValueError(f"resolution {self.resolution} is not a multiple of 8")
        if not 0.0 <= self.slim_ratio < 1.0:
            raise ValueError("--slim-ratio must be in [0, 1)")
        if self.slim_ratio and self.slim_ranks:
            raise ValueError(f"--slim-ratio: {self.ckpt or 'the checkpoint'} is a slim checkpoint already "
                             "(its own ranks are estimated)")

    @property
    def latent_size(self) -> int:
        return self.resolution // 8

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Settings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def label(self) -> str:
        """Short human label, e.g. 'sd15 768px amp-bf16 adamw LoRA r16' (sampling: no optimizer; weight dtype)."""
        precision = (SAMPLING_PRECISION_LABELS[self.precision] if self.sampling else self.precision)
        source = "slim ckpt" if self.slim_ranks else "ckpt"
        parts = [f"{self.arch} ({source})" if self.ckpt else self.arch, f"{self.resolution}px", precision]
        if self.quantised and self.sampling:
            parts.append(f"GGUF {'/'.join(sorted({t for t, _ in self.quantised.values()}))} kept quantised")
        if not self.sampling:
            parts.append(self.optimizer)
        if self.grad_ckpt:
            parts.append("grad-ckpt")
        if self.attention != "sdpa":
            parts.append(self.attention)
        if self.lora_rank:
            parts.append(f"{self.lora_kind} r{self.lora_rank}")
        if self.resident_te_vae:
            parts.append("TE+VAE resident")
        if self.slim_ratio:
            parts.append(f"slim {self.slim_ratio:g}")
        if self.sampling:
            parts.append("sampling")
        return " ".join(parts)


_FT = Settings()
_LORA = replace(_FT, lora_rank=16)

# name -> (settings, group, baseline name used for the classification)
MATRIX = {
    "base": (_FT, "finetune", "base"),
    "xformers": (replace(_FT, attention="xformers"), "finetune", "base"),
    "resident_te_vae": (replace(_FT, resident_te_vae=True), "finetune", "base"),
    "adamw8bit": (replace(_FT, optimizer="adamw8bit"), "finetune", "base"),
    "adamw_fused": (replace(_FT, optimizer="adamw-fused"), "finetune", "base"),
    "fp32": (replace(_FT, precision="fp32"), "finetune", "base"),
    "full_bf16": (replace(_FT, precision="full-bf16"), "finetune", "base"),
    "grad_ckpt": (replace(_FT, grad_ckpt=True), "finetune", "base"),
    "res512": (replace(_FT, resolution=512), "finetune", "base"),
    "res1024": (replace(_FT, resolution=1024), "finetune", "base"),
    "lora16": (_LORA, "lora", "base"),
    "lora16_fa": (replace(_LORA, lora_kind="lora-fa"), "lora", "lora16"),
    "lora16_gc": (replace(_LORA, grad_ckpt=True), "lora", "lora16"),
    "locon16": (replace(_LORA, lora_kind="locon"), "lora", "lora16"),
    "loha16": (replace(_LORA, lora_kind="loha"), "lora", "lora16"),
    "lora64": (replace(_LORA, lora_rank=64), "lora", "lora16"),
    "lora128": (replace(_LORA, lora_rank=128), "lora", "lora16"),
    "lora16_adamw8bit": (replace(_LORA, optimizer="adamw8bit"), "lora", "lora16"),
    "lora16_fp32": (replace(_LORA, precision="fp32"), "lora", "lora16"),
}
# the GPU check's small matrix: one curve per kind of effect
SMALL_MATRIX = ("base", "adamw8bit", "grad_ckpt", "full_bf16", "lora16")


def select_matrix(spec: str) -> list:
    """'all' | 'finetune' | 'lora' | 'small' | comma-separated names -> [(name, settings, baseline)]."""
    if spec == "all":
        names = list(MATRIX)
    elif spec in ("finetune", "lora"):
        names = [n for n, (_, group, _) in MATRIX.items() if group == spec]
    elif spec == "small":
        names = list(SMALL_MATRIX)
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in MATRIX]
    if unknown:
        raise ValueError(f"unknown matrix entries {unknown}; known: {', '.join(MATRIX)}")
    return [(n, MATRIX[n][0], MATRIX[n][2]) for n in names]


def parse_batch_sizes(text: str) -> tuple:
    """'1,2,4' -> (1, 2, 4), sorted and unique; raises ValueError on nonsense."""
    try:
        sizes = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}")
    return tuple(sizes)


def settings_from_ckpt(path: str, **overrides) -> Settings:
    """Settings whose UNet is the one the model file at ``path`` holds, read from its header: an original
    ``.safetensors`` (shapes) or diffusers folder, a slim ``.safetensors`` or ``.gguf`` (its full-size config and
    ranks: the slim UNet), a plain ``.gguf`` (shapes); a GGUF file's quantised tensors in ``quantised``.
    FileFormatError (naming the file) when it is none of these."""
    from ..io import slim_checkpoint
    file = Path(path)
    ranks = quantised = None
    if file.suffix.lower() == ".gguf":
        from ..io import gguf
        f, keys, cfg, meta = gguf.read_header(file)
        if f.fields.get(slim_checkpoint.SLIM_KEY) == "1":
            ranks = meta.get("sdslim.ranks")
        quantised = {k: [f.types[n], f.nbytes(n)] for k, n in keys.items() if f.types[n] not in gguf.FLOAT_TYPES}
    elif slim_checkpoint.is_slim_checkpoint(file):
        cfg, meta = slim_checkpoint.read_slim(file)[4:]
        ranks = meta.get("sdslim.ranks")
    else:
        from ..modules.unet import open_checkpoint
        cfg = open_checkpoint(file).config
    if ranks is not None and not (isinstance(ranks, dict) and ranks):
        from ..io.tensors import FileFormatError
        raise FileFormatError(f"{path}: a slim checkpoint without readable sdslim.ranks metadata")
    arch = cfg.family if cfg.family in ARCHS else overrides.get("arch", "sd15")
    return Settings(**{**overrides, "arch": arch, "ckpt": str(path), "unet_config": dict(layout.diffusers_config(cfg)),
                       "slim_ranks": ranks, "quantised": quantised or None})


def with_overrides(entries, arch=None, resolution=None):
    """Apply --arch to every matrix entry and --resolution to those at the default resolution."""
    out = []
    for name, s, baseline in entries:
        if arch:
            s = replace(s, arch=arch)
        if resolution and s.resolution == Settings.resolution:
            s = replace(s, resolution=resolution)
        out.append((name, s, baseline))
    return out
