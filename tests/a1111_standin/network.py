"""Stand-in for the Lora extension's ``network`` module: a loaded network and the base of its per-layer modules.

As upstream, a module is made from weights with ``network_key``, ``sd_key``, ``w`` (the file's tensors for that
layer, by suffix: ``lora_up.weight``, ``hada_w1_a``, ``diff``, ``alpha`` …) and ``sd_module`` (the webui layer);
``calc_updown(orig_weight)`` gives (ΔW, Δbias) with the format scale and the multiplier applied
(``finalize_updown``), and ``forward(x, y)`` is the functional form (``lora_functional``): the layer's output plus
the delta applied with the layer's own op. The per-format classes are in ``network_lora``/``network_hada``/
``network_full``/``network_lokr``; DoRA is not reproduced.
"""
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
    def __init__(self, net, weights):
        self.network = net
        self.network_key = weights.network_key
        self.sd_key = weights.sd_key
        self.sd_module = weights.sd_module
        self.shape = self.sd_module.weight.shape
        self.ops, self.extra_kwargs = None, {}
        if isinstance(self.sd_module, torch.nn.Conv2d):
            self.ops = F.conv2d
            self.extra_kwargs = {"stride": self.sd_module.stride, "padding": self.sd_module.padding}
        elif isinstance(self.sd_module, torch.nn.Linear):
            self.ops = F.linear
        elif isinstance(self.sd_module, torch.nn.GroupNorm):
            self.ops = F.group_norm
            self.extra_kwargs = {"num_groups": self.sd_module.num_groups, "eps": self.sd_module.eps}
        self.dim = None
        self.bias = weights.w.get("bias")
        self.alpha = weights.w["alpha"].item() if "alpha" in weights.w else None
        self.scale = weights.w["scale"].item() if "scale" in weights.w else None
        self.dora_scale = weights.w.get("dora_scale", None)
        self.dora_norm_dims = len(self.shape) - 1

    def multiplier(self):
        return self.network.te_multiplier if "transformer" in self.sd_key[:20] else self.network.unet_multiplier

    def calc_scale(self):
        if self.scale is not None:
            return self.scale
        if self.dim is not None and self.alpha is not None:
            return self.alpha / self.dim
        return 1.0

    def finalize_updown(self, updown, orig_weight, output_shape, ex_bias=None):
        if self.dora_scale is not None:
            raise NotImplementedError("stand-in: no DoRA")
        if self.bias is not None:           # LyCORIS' "bias" of a module: added to its ΔW before the scale
            updown = updown.reshape(self.bias.shape) + self.bias.to(orig_weight.device, dtype=updown.dtype)
        updown = updown.reshape(orig_weight.shape)
        if ex_bias is not None:
            ex_bias = ex_bias * self.multiplier()
        return updown * self.calc_scale() * self.multiplier(), ex_bias

    def calc_updown(self, target):
        raise NotImplementedError()

    def forward(self, x, y):
        if self.ops is None:
            raise NotImplementedError()
        updown, ex_bias = self.calc_updown(self.sd_module.weight)
        return y + self.ops(x, weight=updown.to(x.dtype), bias=None if ex_bias is None else ex_bias.to(x.dtype),
                            **self.extra_kwargs)
