"""Shared plumbing of the tiny-asset training tools: setup, EMA, plots, and the asset manifest + README."""
import copy
import json
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads collapse on a shared 2-core box

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sdslim_core.io.files import sha256_file

ASSETS = ROOT / "sdslim_core" / "tiny" / "assets"
MANIFEST = ASSETS / "manifest.json"
IMG = ROOT / "docs" / "img"


def setup(seed: int, threads: int):
    """Deterministic CPU training: fixed seed, deterministic kernels, ``threads`` intra-op threads."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def command_line(script: str, args) -> str:
    """The exact command that reproduces a run: the script with every option spelled out."""
    parts = ["python", f"tools/{script}"]
    for key, value in vars(args).items():
        parts += [f"--{key.replace('_', '-')}", str(value)]
    return " ".join(shlex.quote(p) for p in parts)


class EMA:
    """Exponential moving average of a module's parameters (the weights that get shipped)."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.module, self.decay = copy.deepcopy(module).eval().requires_grad_(False), decay

    @torch.no_grad()
    def update(self, module: torch.nn.Module, step: int):
        d = min(self.decay, (1 + step) / (10 + step))
        for e, p in zip(self.module.parameters(), module.parameters()):
            e.lerp_(p.detach(), 1 - d)


def diffusion_loss(fn, x0: torch.Tensor, context: torch.Tensor, schedule, generator: torch.Generator,
                   min_snr: float, offset_noise: float) -> torch.Tensor:
    """Min-SNR-γ weighted eps-prediction loss of ``fn(x_t, t, context)`` at uniformly drawn timesteps.

    ``offset_noise`` adds a per-channel constant to the noise. SD's schedule leaves signal in x_t up to t=999, so
    the model can read an image's mean colour from x_t instead of the caption; on an 8×8 latent it then copies the
    background colour from the starting noise when sampling. With 0.5 (0.1 was measured to be too weak) the mean of
    x_t no longer gives the colour away and the caption decides it.
    """
    acp = schedule.alphas_cumprod().float()
    snr = acp / (1 - acp)
    t = torch.randint(0, schedule.num_train_timesteps, (x0.shape[0],), generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    noise = noise + offset_noise * torch.randn(*x0.shape[:2], 1, 1, generator=generator)
    per_sample = (fn(schedule.add_noise(x0, noise, t), t, context) - noise).square().mean(dim=(1, 2, 3))
    return (snr[t].clamp(max=min_snr) / snr[t] * per_sample).mean()


def drop_captions(captions: list, prob: float, generator: torch.Generator) -> list:
    """Replace each caption by ``""`` with probability ``prob`` (classifier-free guidance training)."""
    drop = torch.rand(len(captions), generator=generator) < prob
    return ["" if d else c for c, d in zip(captions, drop.tolist())]


def plot_losses(curves: dict, path: Path, title: str):
    """One panel per curve name (raw and smoothed, log scale) → PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (name, values) in zip(axes[0], curves.items()):
        v = torch.tensor(values, dtype=torch.float64)
        k = max(1, len(v) // 50)
        smooth = torch.nn.functional.avg_pool1d(v[None, None], k, 1).flatten() if len(v) >= k else v
        ax.plot(v.numpy(), alpha=0.3, lw=0.6, label="per step")
        ax.plot(range(k - 1, k - 1 + len(smooth)), smooth.numpy(), lw=1.5, label=f"mean of {k}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def image_grid(images: torch.Tensor, row_labels: list, col_labels: list, path: Path, title: str):
    """images (rows, cols, 3, H, W) in [0,1] → labelled PNG grid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, cols = images.shape[:2]
    fig, axes = plt.subplots(rows, cols, figsize=(1.2 * cols + 2.6, 1.2 * rows + 0.5), squeeze=False)
    for i in range(rows):
        for j in range(cols):
            ax = axes[i][j]
            ax.imshow(images[i, j].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(row_labels[i], rotation=0, ha="right", va="center", fontsize=7)
            if i == 0:
                ax.set_title(col_labels[j], fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record_asset(path: Path, entry: dict):
    """Add/replace ``path``'s entry (with size and sha256) in manifest.json, then rewrite README.md from it."""
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    manifest[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path), **entry}
    MANIFEST.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")
    (ASSETS / "README.md").write_text(_readme(manifest))


def _readme(manifest: dict) -> str:
    lines = ["# Tiny shipped assets", "",
             "Genuinely trained, tiny models with the SD1.5 block structure, used by `sdslim demo`, the benchmarks and",
             "the tests (no real SD weights can be shipped). This file is generated from `manifest.json` by the",
             "training tools in `tools/`; every number below was measured by the run that wrote the asset. Trained on",
             "a shared 2-core CPU: wall times include other people's load, and other hardware or thread counts give",
             "slightly different bytes.", "",
             "## Layout of `tiny_sd15.safetensors` (LDM single file)", "",
             "- `model.diffusion_model.*`: canonical LDM UNet keys (SD1.5 structure: 2 ResBlocks per level, "
             "cross-attention on all but the last level and in the middle, 8 heads, conv `proj_in`, GEGLU, "
             "context 768; widths in `sdslim.unet_config`).",
             "- `first_stage_model.*`: LDM VAE keys (a diffusers `AutoencoderKL` written by `tiny.vae_to_ldm`, "
             "attention projections as 1×1 convs, read back by diffusers' own LDM converter); 32×32 RGB ↔ 4×8×8 "
             "latents.",
             "- `cond_stage_model.*`: `sdslim_core.tiny.text.TinyTextEncoder` (word tokenizer, 12 tokens → 768).",
             "- metadata: `sdslim.unet_config` (UNetConfig JSON, heads included), `sdslim.tiny.vae_config` "
             "(AutoencoderKL kwargs with `scaling_factor`), `sdslim.tiny.text_config` (vocabulary and sizes), "
             "`sdslim.tiny.schedule` (SD scaled-linear betas 0.00085–0.012, 1000 steps, epsilon), "
             "`sdslim.tiny.image_size`, `sdslim.tiny.vae_layout` (`ldm`), `sdslim.tiny.command`, `sdslim.tiny.train`.",
             "- data: `sdslim_core.tiny.data` (procedural shapes; captions like "
             "\"a red circle on a blue background\").",
             "- ComfyUI's checkpoint loader does not auto-detect it (its SD1.5 match also needs 320 base channels, and",
             "  the text encoder is not CLIP); load it with `sdslim_core.tiny.load_tiny_pipeline()`.", ""]
    for name, e in manifest.items():
        lines += [f"## `{name}`", "", e["what"], "",
                  f"- size: {e['bytes'] / 1e6:.2f} MB ({e['bytes']} bytes)",
                  f"- sha256: `{e['sha256']}`",
                  f"- training time: {e['train_seconds']:.0f} s wall on {e['threads']} CPU thread(s)",
                  f"- final loss (mean of the last steps): {e['final_loss']}"]
        if e.get("effect"):
            lines.append("- measured effect: " + ", ".join(f"{k} = {v}" for k, v in e["effect"].items()))
        lines += [f"- loss curve: `{e['loss_curve']}`" + (f"; samples: `{e['samples']}`" if e.get("samples") else ""),
                  "- command (from the repository root):", "", "```bash", e["command"], "```", ""]
    return "\n".join(lines)
