"""The teacher of a run: its weights from what the user passes (:func:`teacher_weights`), and where the frozen
teacher UNet lives during the run: on the CPU, on the device, mixed (the layers of finished stage-2 groups moved
back to the CPU, their sites running folded), or offloaded (in CPU RAM, each layer copied to the device for its
call)."""
from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from .. import layout
from ..modules import offload, swap


def _heads_from_diffusers(module) -> dict:
    conf = getattr(module, "config", None)
    if conf is None:
        return {}
    ahd = conf.get("attention_head_dim") if hasattr(conf, "get") else getattr(conf, "attention_head_dim", None)
    widths = list(conf.get("block_out_channels", ()) if hasattr(conf, "get") else ())
    if isinstance(ahd, int):
        return {"num_heads": ahd}
    if ahd and widths and len(ahd) == len(widths):
        per = {w // h for w, h in zip(widths, ahd) if h and w % h == 0}
        if len(per) == 1 and len(set(ahd)) > 1:
            return {"num_head_channels": per.pop()}
        if len(set(ahd)) == 1:
            return {"num_heads": int(ahd[0])}
    return {}


def teacher_weights(unet, cfg: layout.UNetConfig | None = None) -> tuple[Mapping, layout.UNetConfig]:
    """(canonical weights, UNetConfig) from a diffusers/LDM module, a state dict in any naming, or an
    :class:`~sdslim_core.modules.unet.CheckpointUNet`."""
    if hasattr(unet, "weights") and hasattr(unet, "config") and isinstance(getattr(unet, "config"),
                                                                          layout.UNetConfig):
        return unet.weights, cfg or unet.config
    if isinstance(unet, nn.Module):
        sd = {k: v.detach() for k, v in unet.state_dict().items()}
        canon, naming, _ = layout.to_canonical(sd)
        if cfg is None:
            if naming == "diffusers":
                heads = _heads_from_diffusers(unet)
            else:
                heads = {k: int(getattr(unet, k)) for k in ("num_heads", "num_head_channels")
                         if isinstance(getattr(unet, k, None), int) and getattr(unet, k) > 0}
            cfg = layout.config_from_state_dict(canon, heads)
        return canon, cfg
    if isinstance(unet, Mapping):
        canon, _, _ = layout.to_canonical(unet)
        return canon, cfg or layout.config_from_state_dict(canon)
    raise TypeError(f"cannot train from a {type(unet).__name__}: pass a UNet module, a state dict or an "
                    "opened checkpoint")


def free_device_memory(device: torch.device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


class TeacherPlacement:
    """The teacher module ``unet`` (kept on the CPU between stages) and its placement on ``device``: whole, or with
    ``offload`` its layers' weights copied to the device call by call (:mod:`~sdslim_core.modules.offload`),
    which takes the teacher's weights off the device at the cost of a copy per forward."""

    def __init__(self, unet: nn.Module, cfg: layout.UNetConfig, device: torch.device, offload: bool = False):
        self.unet, self.cfg, self.device = unet, cfg, device
        self.offload = offload and device.type != "cpu"
        self.where = "cpu"          # "cpu", str(device), "mixed" or "offloaded"
        self._hooks: list = []
        self._pinned = False

    def set_offload(self, offload: bool):
        """Offload from the next placement on (the teacher goes back to the CPU first)."""
        offload = offload and self.device.type != "cpu"
        if offload != self.offload:
            self.release()
            self.offload = offload

    def on_device(self) -> nn.Module:
        """The whole teacher running on the device."""
        if self.offload:
            if self.where != "offloaded":
                if not self._pinned and self.device.type == "cuda" and self._room_to_pin():
                    self._pinned = offload.pin(self.unet)
                self._hooks += offload.attach(self.unet, self.device)
                self.where = "offloaded"
            return self.unet
        if self.where != str(self.device):
            self.unet.to(self.device)
            self.where = str(self.device)
        return self.unet

    def _room_to_pin(self) -> bool:
        """Pinning makes a page-locked copy of weights the caller may still hold (the user's checkpoint): only
        with twice the teacher's bytes of RAM free, so that it never pushes the host into swap."""
        from .memory import available_ram
        size = sum(t.numel() * t.element_size() for t in self.unet.parameters())
        return available_ram() > 2 * size

    def as_placed(self) -> nn.Module:
        """The teacher as it stands when mixed (earlier groups' layers stay off the device), else on the device."""
        return self.unet if self.where == "mixed" else self.on_device()

    def run_on_device(self, module: nn.Module) -> nn.Module:
        """``module`` (made from the teacher's layers, e.g. a folded site) running on the device as the teacher
        does: moved there, or offloaded with it."""
        if self.offload:
            self._hooks += offload.attach(module, self.device)
            return module
        return module.to(self.device)

    def offload_site(self, site: str):
        """Move one site's teacher layers off the device (a finished stage-2 group runs folded)."""
        if self.device.type != "cpu" and not self.offload:
            self.site(site).to("cpu")
            self.where = "mixed"

    def release(self):
        """Back to the CPU, freeing the device's cache."""
        if self.where == "offloaded":
            offload.detach(self.unet, self._hooks)
            self._hooks = []
            self.where = "cpu"
            free_device_memory(self.device)
        elif self.where != "cpu":
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
        copied = copy.deepcopy(mod)
        offload.detach(copied, [])
        return copied.to(self.device)
