"""Stand-in for ``comfy.lora.calculate_weight``: ``("diff", (delta,))`` patches and weight adapters, their tensors
brought to the weight's device (``cast_to_device``) as ComfyUI does."""
import torch

import comfy.model_management
from comfy import weight_adapter


def calculate_weight(patches, weight, key, intermediate_dtype=torch.float32, original_weights=None):
    for strength, value, strength_model, offset, function in patches:
        function = function or (lambda a: a)
        if strength_model != 1.0:
            weight *= strength_model
        if isinstance(value, weight_adapter.WeightAdapterBase):
            weight = value.calculate_weight(weight, key, strength, strength_model, offset, function, intermediate_dtype,
                                            original_weights)
            continue
        if value[0] != "diff":
            raise NotImplementedError(f"stand-in supports 'diff' patches only, got {value[0]!r} for {key}")
        weight += function(strength * comfy.model_management.cast_to_device(value[1][0], weight.device, weight.dtype))
    return weight
