"""Stand-in for ``comfy.weight_adapter``: the LoRA/LoHa/LoKr patch values of ComfyUI's LoRA loader (weights tuples
in ComfyUI's order); only a plain LoRA computes its weight here, on the weight's device as ComfyUI does."""
import torch

import comfy.model_management


class WeightAdapterBase:
    name = "base"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys = loaded_keys
        self.weights = weights


class LoRAAdapter(WeightAdapterBase):
    """weights: (up, down, alpha, mid, dora_scale, reshape); ΔW = (alpha/rank)·up·down (scale 1 without alpha,
    rank = down's rows); a Tucker core ``mid`` [r_up, r_down, k, k] makes down Σ_b mid[a, b]·down[b] first."""
    name = "lora"

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32, original_weight=None):
        up, down, alpha, mid, dora_scale, reshape = self.weights
        if dora_scale is not None or reshape is not None:
            raise NotImplementedError(f"stand-in LoRAAdapter: no DoRA/reshape ({key})")
        scale = 1.0 if alpha is None else alpha / down.shape[0]
        up, down = (comfy.model_management.cast_to_device(t, weight.device, intermediate_dtype) for t in (up, down))
        if mid is not None:
            mid = comfy.model_management.cast_to_device(mid, weight.device, intermediate_dtype)
            down = torch.einsum("abkl,bi->aikl", mid, down.flatten(1))
        diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        weight += function((strength * scale * diff).to(weight.dtype))
        return weight


class LoHaAdapter(WeightAdapterBase):
    """weights: (w1a, w1b, alpha, w2a, w2b, t1, t2, dora_scale)."""
    name = "loha"


class LoKrAdapter(WeightAdapterBase):
    """weights: (w1, w2, alpha, w1_a, w1_b, w2_a, w2_b, t2, dora_scale)."""
    name = "lokr"


class OFTAdapter(WeightAdapterBase):
    name = "oft"
