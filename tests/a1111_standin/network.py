"""Stand-in for the Lora extension's ``network`` module: a loaded network and its per-layer LoRA module."""
import torch


class Network:
    def __init__(self, name, network_on_disk):
        self.name = name
        self.network_on_disk = network_on_disk
        self.te_multiplier = 1.0
        self.unet_multiplier = 1.0
        self.dyn_dim = None
        self.modules = {}
        self.mtime = None


class NetworkModule:
    """A plain LoRA on one layer: ``updown = up @ down * alpha / rank * multiplier``, reshaped to the weight.

    ``weights`` is ``{"up": [out, r(,1,1)], "down": [r, in(,k,k)], "alpha": float}``; a conv LoRA has a k×k
    ``down`` and a 1×1 ``up``, as kohya's do.
    """

    def __init__(self, net, weights):
        self.network = net
        self.up = weights["up"]
        self.down = weights["down"]
        self.dim = self.down.shape[0]
        self.alpha = float(weights.get("alpha", self.dim))
        self.scale = None

    def multiplier(self):
        return self.network.unet_multiplier

    def calc_scale(self):
        return self.alpha / self.dim

    def calc_updown(self, target):
        up = self.up.flatten(1).to(target.device, torch.float64)
        down = self.down.flatten(1).to(target.device, torch.float64)
        updown = (up @ down).reshape(target.shape) * self.calc_scale() * self.multiplier()
        return updown.to(target.dtype), None
