"""Stand-in for ``comfy.ops``: layer classes carrying the CastWeightBiasOp flags."""
import torch


class CastWeightBiasOp:
    comfy_cast_weights = False
    weight_function = []
    bias_function = []


class disable_weight_init:
    class Linear(torch.nn.Linear, CastWeightBiasOp):
        pass

    class Conv2d(torch.nn.Conv2d, CastWeightBiasOp):
        pass

    class GroupNorm(torch.nn.GroupNorm, CastWeightBiasOp):
        pass


class manual_cast(disable_weight_init):
    class Linear(disable_weight_init.Linear):
        comfy_cast_weights = True

    class Conv2d(disable_weight_init.Conv2d):
        comfy_cast_weights = True

    class GroupNorm(disable_weight_init.GroupNorm):
        comfy_cast_weights = True
