"""Stand-in for the Lora extension's ``network`` module: a loaded network and its per-layer LoRA module."""
import torch
import torch.nn.functional as F


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

    ``weights`` is ``{"up": [out, r(,1,1)], "down": [r, in(,k,k)], "alpha": float, "sd_module": layer}``; a conv
    LoRA has a k×k ``down`` and a 1×1 ``up``, as kohya's do. ``forward(x, y)`` is upstream's functional form
    (``lora_functional``): the layer's output plus the delta applied with the layer's own op (linear, conv2d with
    its stride/padding, group_norm with its groups/eps).
    """

    def __init__(self, net, weights):
        self.network = net
        self.sd_module = weights.get("sd_module")
        self.up = weights["up"]
        self.down = weights["down"]
        self.dim = self.down.shape[0]
        self.alpha = float(weights.get("alpha", self.dim))
        self.scale = None
        self.ops, self.extra_kwargs = None, {}
        if isinstance(self.sd_module, torch.nn.Conv2d):
            self.ops = F.conv2d
            self.extra_kwargs = {"stride": self.sd_module.stride, "padding": self.sd_module.padding}
        elif isinstance(self.sd_module, torch.nn.Linear):
            self.ops = F.linear
        elif isinstance(self.sd_module, torch.nn.GroupNorm):
            self.ops = F.group_norm
            self.extra_kwargs = {"num_groups": self.sd_module.num_groups, "eps": self.sd_module.eps}

    def multiplier(self):
        return self.network.unet_multiplier

    def calc_scale(self):
        return self.alpha / self.dim

    def calc_updown(self, target):
        up = self.up.flatten(1).to(target.device, torch.float64)
        down = self.down.flatten(1).to(target.device, torch.float64)
        updown = (up @ down).reshape(target.shape) * self.calc_scale() * self.multiplier()
        return updown.to(target.dtype), None

    def forward(self, x, y):
        if self.ops is None:
            raise NotImplementedError()
        updown, ex_bias = self.calc_updown(self.sd_module.weight)
        return y + self.ops(x, weight=updown, bias=ex_bias, **self.extra_kwargs)
