"""Stand-in for ``comfy.model_detection``: ComfyUI detects a UNet's config from its keys and shapes and takes the
first of ``comfy.supported_models.models`` that matches it; here each registered config class says itself whether a
state dict is its model (``matches(state_dict, prefix)``): tests register the tiny model they load."""
import comfy.supported_models


def model_config_from_unet(state_dict, unet_key_prefix, use_base_if_no_match=False, metadata=None):
    for cls in comfy.supported_models.models:
        if cls.matches(state_dict, unet_key_prefix):
            return cls()
    return None
