"""Stand-in for ``comfy.model_base.BaseModel``: a module holding the UNet as ``diffusion_model`` and its
``model_config``; Save Checkpoint's names are the UNet's under ``model.diffusion_model.`` and the CLIP's and VAE's as
given (ComfyUI renames those per model family)."""
import types

import torch


class BaseModel(torch.nn.Module):
    def __init__(self, model_config=None):
        super().__init__()
        self.model_config = model_config or types.SimpleNamespace(unet_config={}, scaled_fp8=None)

    def state_dict_for_saving(self, clip_state_dict=None, vae_state_dict=None, clip_vision_state_dict=None):
        sd = {"model.diffusion_model." + k: v for k, v in self.diffusion_model.state_dict().items()}
        for part in (clip_state_dict, vae_state_dict, clip_vision_state_dict):
            sd.update(part or {})
        return sd
