"""The shipped tiny demo model (``sdslim_core/tiny/assets``) as ComfyUI objects for ComfyUI's own nodes.

ComfyUI's loaders cannot open it (model detection needs SD1.5's 320 base channels, the text encoder is not CLIP,
its VAE and ControlNet hint encoder have widths ComfyUI's fixed LDM classes cannot build), so this module builds:

- MODEL: ComfyUI's own SD1.5 BaseModel from the file's UNet config (``model_detection.detect_unet_config``), with
  the tiny VAE's latent scale; KSampler, LoRA loaders, ControlNet and Slim UNet treat it like any SD1.5 model.
- CLIP: ComfyUI's ``CLIP`` over a ``ClipTarget`` (the tiny word tokenizer and text encoder).
- VAE: the encode/decode interface VAE Encode/Decode use, over the tiny diffusers VAE.
- CONTROL_NET: ComfyUI's ``controlnet.ControlNet`` around the tiny diffusers ControlNet (it takes a mask: the
  hint image's channels are averaged).
"""
from __future__ import annotations

import json

import torch

import comfy.controlnet
import comfy.latent_formats
import comfy.model_detection
import comfy.model_management as mm
import comfy.model_patcher
import comfy.sd
import comfy.supported_models
import comfy.supported_models_base
import comfy.utils

from sdslim_core import layout, tiny
from sdslim_core.io.tensors import load_file

UNET_PREFIX = layout.CHECKPOINT_PREFIX
SD15_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                 "beta_schedule": "scaled_linear", "prediction_type": "epsilon"}


def load(path=None) -> tuple:
    """(MODEL, CLIP, VAE, CONTROL_NET) of the tiny demo checkpoint (default: the shipped one)."""
    path = path or tiny.DEFAULT_PATH
    pipe = tiny.load_tiny_pipeline(path)
    tensors, metadata = load_file(path)
    schedule = json.loads(metadata[tiny.META["schedule"]])
    if any(schedule.get(k) != v for k, v in SD15_SCHEDULE.items()):
        raise ValueError(f"sdslim: {path}: noise schedule {schedule} is not SD1.5's, which the MODEL would use")
    downscale = pipe.image_size // pipe.latent_size
    return (model(tensors, pipe), clip(pipe), TinyVAE(pipe.vae, downscale),
            controlnet(tiny.load_tiny_controlnet(), downscale))


def model(tensors: dict, pipe: tiny.TinyPipeline):
    """ComfyUI's SD1.5 BaseModel and ModelPatcher over the checkpoint's UNet, the way ComfyUI loads one."""
    sd = {k: v for k, v in tensors.items() if k.startswith(UNET_PREFIX)}
    config = comfy.supported_models.SD15(comfy.model_detection.detect_unet_config(sd, UNET_PREFIX))
    config.latent_format = comfy.latent_formats.SD15(scale_factor=pipe.scaling_factor)
    config.sdslim_latent_size = pipe.latent_size          # read by Train Slim Adapters (its native calibration size)
    config.sdslim_tiny = True                             # read by the Save nodes, which refuse it
    load_device, offload_device = mm.get_torch_device(), mm.unet_offload_device()
    n_params = comfy.utils.calculate_parameters(sd, UNET_PREFIX)
    dtype = mm.unet_dtype(model_params=n_params, supported_dtypes=config.supported_inference_dtypes)
    config.set_inference_dtype(dtype, mm.unet_manual_cast(dtype, load_device, config.supported_inference_dtypes))
    base = config.get_model(sd, UNET_PREFIX, device=offload_device)
    base.load_model_weights(sd, UNET_PREFIX)
    return comfy.model_patcher.ModelPatcher(base, load_device=load_device, offload_device=offload_device)


class TinyTokenizer:
    """ComfyUI tokenizer interface over the tiny word tokenizer (``tokenizer_data["sdslim_tiny"]``)."""

    def __init__(self, embedding_directory=None, tokenizer_data=None):
        self.tokenizer = (tokenizer_data or {})["sdslim_tiny"]

    def tokenize_with_weights(self, text, return_word_ids=False, **kwargs):
        return {"ids": self.tokenizer([text])}

    def untokenize(self, tokens):
        return [self.tokenizer.vocab[i] for i in tokens["ids"][0].tolist()]

    def state_dict(self):
        return {}


class TinyTextModel(torch.nn.Module):
    """ComfyUI text-encoder interface (``encode_token_weights``) over the tiny text encoder."""

    def __init__(self, encoder=None, device=None, dtype=None, model_options=None):
        super().__init__()
        self.encoder = encoder.to(device or "cpu")
        self.dtypes = {torch.float32}

    def encode_token_weights(self, tokens):
        ids = tokens["ids"].to(self.encoder.proj.weight.device)
        cond = self.encoder(ids).to(mm.intermediate_device(), torch.float32)
        return cond, None

    def reset_clip_options(self):
        pass

    def set_clip_options(self, options):
        pass

    def load_sd(self, sd):
        return self.encoder.load_state_dict(sd)


def clip(pipe: tiny.TinyPipeline):
    target = comfy.supported_models_base.ClipTarget(TinyTokenizer, TinyTextModel)
    target.params = {"encoder": pipe.text_encoder}
    n_params = sum(p.numel() for p in pipe.text_encoder.parameters())
    return comfy.sd.CLIP(target, tokenizer_data={"sdslim_tiny": pipe.tokenizer}, parameters=n_params)


class TinyVAE:
    """What VAE Encode / VAE Decode call, over the tiny diffusers AutoencoderKL (latents unscaled, as ComfyUI's)."""

    def __init__(self, vae: torch.nn.Module, downscale: int):
        self.first_stage_model = vae
        self.downscale = downscale
        self.latent_channels = vae.config.latent_channels
        self.device = mm.vae_device()
        # the patcher sets ``.device`` on its module, a read-only property of diffusers models: hold it in a dict
        self.patcher = comfy.model_patcher.ModelPatcher(torch.nn.ModuleDict({"vae": vae}), load_device=self.device,
                                                        offload_device=mm.vae_offload_device())

    @torch.no_grad()
    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        mm.load_models_gpu([self.patcher])
        image = self.first_stage_model.decode(samples.to(self.device, torch.float32)).sample
        return ((image + 1) / 2).clamp(0, 1).movedim(1, -1).to(mm.intermediate_device())

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        mm.load_models_gpu([self.patcher])
        x = pixels[..., :3].movedim(-1, 1).to(self.device, torch.float32) * 2 - 1
        return self.first_stage_model.encode(x).latent_dist.mean.to(mm.intermediate_device())

    def spacial_compression_encode(self) -> int:
        return self.downscale

    def spacial_compression_decode(self) -> int:
        return self.downscale

    def temporal_compression_decode(self):
        return None


class TinyControlModel(torch.nn.Module):
    """ComfyUI's control-model call (``x, hint, timesteps, context``) over a diffusers ControlNetModel; returns the
    residuals in ComfyUI's layout (one per input block, then the middle block)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    @property
    def dtype(self):
        return self.net.dtype

    def forward(self, x, hint, timesteps, context, **extra):
        down, mid = self.net(x, timesteps, encoder_hidden_states=context, controlnet_cond=hint, return_dict=False)
        return {"output": list(down), "middle": [mid]}


def controlnet(net: torch.nn.Module, downscale: int):
    return comfy.controlnet.ControlNet(TinyControlModel(net), compression_ratio=downscale,
                                       load_device=mm.get_torch_device(),
                                       preprocess_image=lambda image: image.mean(dim=1, keepdim=True))
