"""Stand-in for ``modules.devices`` (CPU)."""
import torch

cpu = torch.device("cpu")
device = cpu
fp8 = False
dtype_unet = torch.float32


def torch_gc():
    """Nothing to collect on the CPU."""
