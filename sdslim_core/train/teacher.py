"""Where the frozen teacher UNet lives during a run: on the CPU, on the device, or mixed (the layers of finished
stage-2 groups moved back to the CPU, their sites running folded)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .. import layout
from ..modules import swap


def free_device_memory(device: torch.device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


class TeacherPlacement:
    """The teacher module ``unet`` (kept on the CPU between stages) and its placement on ``device``."""

    def __init__(self, unet: nn.Module, cfg: layout.UNetConfig, device: torch.device):
        self.unet, self.cfg, self.device = unet, cfg, device
        self.where = "cpu"          # "cpu", str(device) or "mixed"

    def on_device(self) -> nn.Module:
        """The whole teacher on the device."""
        if self.where != str(self.device):
            self.unet.to(self.device)
            self.where = str(self.device)
        return self.unet

    def as_placed(self) -> nn.Module:
        """The teacher as it stands when mixed (earlier groups' layers stay off the device), else on the device."""
        return self.unet if self.where == "mixed" else self.on_device()

    def offload_site(self, site: str):
        """Move one site's teacher layers off the device (a finished stage-2 group runs folded)."""
        if self.device.type != "cpu":
            self.site(site).to("cpu")
            self.where = "mixed"

    def release(self):
        """Back to the CPU, freeing the device's cache."""
        if self.where != "cpu":
            self.unet.to("cpu")
            self.where = "cpu"
            free_device_memory(self.device)

    def site(self, site: str) -> nn.Module:
        return self.unet.get_submodule(swap.site_path(self.unet, site, self.cfg))

    def site_on_device(self, site: str) -> nn.Module:
        """The site's module on the device: the teacher's own when the teacher is there, else a copy."""
        mod = self.site(site)
        if self.where == str(self.device):
            return mod
        return copy.deepcopy(mod).to(self.device)
