"""Stand-in for ``modules.devices`` (CPU)."""
import contextlib

import torch

cpu = torch.device("cpu")
device = cpu
fp8 = False
dtype_unet = torch.float32
unet_needs_upcast = False


def torch_gc():
    """Nothing to collect on the CPU."""


def cond_cast_unet(input):
    """The UNet input cast of ``--upcast-sampling`` (identity here, as without it)."""
    return input.to(dtype_unet) if unet_needs_upcast else input


def autocast(disable=False):
    """The webui's autocast for inference (none on the CPU)."""
    return contextlib.nullcontext()
