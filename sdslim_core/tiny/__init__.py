"""The shipped tiny SD1.5-structure teachers as small pipelines, with their LoRA and ControlNet.

Two teachers ship (:data:`TEACHERS`): ``tiny`` (base width 32, the demo's) and ``wide`` (base width 64: blocks
64-128 wide, 2-4 channels per GroupNorm group, so fidelity is not judged on 32-channel blocks alone).

The file is an LDM single-file checkpoint: ``model.diffusion_model.`` (canonical UNet keys),
``first_stage_model.`` (LDM VAE keys, written by :func:`vae_to_ldm`, read back with diffusers' own LDM converter)
and ``cond_stage_model.`` (the tiny text encoder of :mod:`sdslim_core.tiny.text`), with the JSON configs needed to
rebuild each part in its metadata (see ``assets/README.md``).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from . import text as tiny_text
from ..io.tensors import FileFormatError, load_file
from ..modules import unet as unet_mod
from ..ops import lora, sampling

ASSETS = Path(__file__).resolve().parent / "assets"


@dataclasses.dataclass(frozen=True)
class TeacherAssets:
    """The files of one shipped teacher: checkpoint, its "green" LoRA and its mask ControlNet."""
    name: str
    model: Path
    lora: Path
    controlnet: Path


TEACHERS = {name: TeacherAssets(name, ASSETS / f"{name}_sd15.safetensors", ASSETS / f"{name}_lora_green.safetensors",
                                ASSETS / f"{name}_controlnet_mask.safetensors") for name in ("tiny", "wide")}
DEFAULT_PATH, LORA_PATH, CONTROLNET_PATH = TEACHERS["tiny"].model, TEACHERS["tiny"].lora, TEACHERS["tiny"].controlnet
VAE_PREFIX, TEXT_PREFIX = "first_stage_model.", "cond_stage_model."
META = {"vae": "sdslim.tiny.vae_config", "text": "sdslim.tiny.text_config", "schedule": "sdslim.tiny.schedule",
        "image_size": "sdslim.tiny.image_size", "controlnet": "sdslim.tiny.controlnet_config"}


@dataclasses.dataclass
class TinyPipeline:
    """The tiny teacher's parts (float32, eval mode) and the glue between them."""
    unet: torch.nn.Module              # diffusers UNet2DConditionModel
    text_encoder: torch.nn.Module
    tokenizer: tiny_text.Tokenizer
    vae: torch.nn.Module               # diffusers AutoencoderKL
    schedule: sampling.Schedule
    checkpoint: unet_mod.CheckpointUNet
    image_size: int

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def scaling_factor(self) -> float:
        return float(self.vae.config.scaling_factor)

    @torch.no_grad()
    def encode_prompt(self, prompts: list) -> torch.Tensor:
        """(B, tokens, 768) context; ``""`` gives the unconditional context."""
        return self.text_encoder(self.tokenizer(prompts))

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B,3,H,W) in [0,1] → scaled latents (posterior mean × scaling factor)."""
        return self.vae.encode(images * 2 - 1).latent_dist.mean * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents → images (B,3,H,W) in [0,1], on the latents' device (the VAE moves there)."""
        return ((self.vae.to(latents.device).decode(latents / self.scaling_factor).sample + 1) / 2).clamp(0, 1)

    def noise(self, batch: int, seed: int) -> torch.Tensor:
        """Deterministic starting latents for ``batch`` images from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, self.unet.config.in_channels, self.latent_size, self.latent_size, generator=g)

    def generate(self, prompts: list, seed: int = 0, steps: int = 20, guidance: float = 4.0, method: str = "ddim",
                 fn=None, control=None) -> torch.Tensor:
        """Text → images (B,3,H,W) in [0,1]; ``fn`` replaces the UNet call (e.g. a slim UNet)."""
        context = self.encode_prompt(prompts)
        uncond = self.encode_prompt([""] * len(prompts))
        latents = sampling.sample(fn or sampling.diffusers_fn(self.unet), self.noise(len(prompts), seed), context,
                                  uncond, schedule=self.schedule, steps=steps, method=method, guidance=guidance,
                                  control=control)
        return self.decode(latents)

    def unet_with_loras(self, loras) -> torch.nn.Module:
        """A new diffusers UNet with ``loras`` = [(path, strength), …] merged (via :mod:`sdslim_core.ops.lora`)."""
        weights = self.checkpoint.weights
        merged, _ = lora.merge_loras(weights, loras, self.checkpoint.config)
        full = {k: merged.get(k, weights[k]) for k in weights}
        return unet_mod.load_diffusers_unet(full, self.checkpoint.config, dtype=torch.float32).eval()


def controlnet_hook(controlnet, cond: torch.Tensor, scale: float = 1.0):
    """``control`` callable for :func:`sampling.sample`: runs a diffusers ``ControlNetModel`` on image ``cond``
    (B or 1, C, H, W in [0,1]; repeated over the CFG-doubled batch) and returns the UNet's residual kwargs."""
    def control(x, t, context):
        c = cond.repeat(x.shape[0] // cond.shape[0], 1, 1, 1)
        down, mid = controlnet(x, t, encoder_hidden_states=context, controlnet_cond=c, conditioning_scale=scale,
                               return_dict=False)
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
    return control


def _meta_json(metadata: dict, key: str, path: Path):
    if key not in metadata:
        raise FileFormatError(f"{path}: metadata {key!r} missing: not a tiny sdslim checkpoint")
    return json.loads(metadata[key])


def vae_to_ldm(state_dict: dict, levels: int) -> dict:
    """diffusers ``AutoencoderKL`` keys → LDM ``first_stage_model`` keys (attention projections as 1×1 convs)."""
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    out = {}
    for key, value in state_dict.items():
        k = key.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", k)
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0)\.",
                   lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}."
                             f"{'block' if m.group(2) == 'resnets' else 'upsample'}.", k)
        k = re.sub(r"\.mid_block\.resnets\.(\d+)\.", lambda m: f".mid.block_{int(m.group(1)) + 1}.", k)
        m = re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(\w+)$", k)
        if m:
            k = f"{m.group(1)}.mid.attn_1.{attn[m.group(2)]}.{m.group(3)}"
            if m.group(2) != "group_norm" and m.group(3) == "weight":
                value = value[:, :, None, None]
        out[k] = value
    return out


def load_tiny_pipeline(path=None) -> TinyPipeline:
    """Load the tiny teacher (default: the shipped asset) into float32 modules on the CPU."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    path = Path(path or DEFAULT_PATH)
    ckpt = unet_mod.open_checkpoint(path)
    tensors, metadata = load_file(path)
    unet = unet_mod.load_diffusers_unet(ckpt.weights, ckpt.config, dtype=torch.float32).eval()

    vae_cfg = _meta_json(metadata, META["vae"], path)
    vae = AutoencoderKL(**vae_cfg)
    vae_ldm = {k[len(VAE_PREFIX):]: v.float() for k, v in tensors.items() if k.startswith(VAE_PREFIX)}
    vae.load_state_dict(convert_ldm_vae_checkpoint(vae_ldm, vae_cfg), strict=True)

    tokenizer, text_encoder = tiny_text.build(_meta_json(metadata, META["text"], path))
    text_encoder.load_state_dict({k[len(TEXT_PREFIX):]: v.float() for k, v in tensors.items()
                                  if k.startswith(TEXT_PREFIX)}, strict=True)
    schedule = sampling.Schedule.from_dict(_meta_json(metadata, META["schedule"], path))
    image_size = int(_meta_json(metadata, META["image_size"], path))
    for m in (unet, vae, text_encoder):
        m.eval().requires_grad_(False)
    return TinyPipeline(unet, text_encoder, tokenizer, vae, schedule, ckpt, image_size)


def load_tiny_controlnet(path=None) -> torch.nn.Module:
    """The shipped mask ControlNet (diffusers ``ControlNetModel``, float32, eval); use with :func:`controlnet_hook`."""
    from diffusers import ControlNetModel
    path = Path(path or CONTROLNET_PATH)
    tensors, metadata = load_file(path)
    controlnet = ControlNetModel(**_meta_json(metadata, META["controlnet"], path))
    controlnet.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return controlnet.eval().requires_grad_(False)
