"""Stand-in for ``comfy.lora.calculate_weight``: ``("diff", (delta,))`` patches and nested lists only."""
import torch


def calculate_weight(patches, weight, key, intermediate_dtype=torch.float32, original_weights=None):
    for strength, value, strength_model, offset, function in patches:
        if strength_model != 1.0:
            weight *= strength_model
        if value[0] != "diff":
            raise NotImplementedError(f"stand-in supports 'diff' patches only, got {value[0]!r} for {key}")
        weight += strength * value[1][0].to(weight.device, weight.dtype)
    return weight
