"""Stand-in for the Lora extension's ``network_lora``: LoRA / LoCon (``lora_up``/``lora_down``), as upstream kept in
``up_model``/``down_model`` layers (``mid_model`` for a Tucker core: not reproduced here)."""
import types

import torch

import network


class NetworkModuleLora(network.NetworkModule):
    def __init__(self, net, weights):
        super().__init__(net, weights)
        self.up_model = types.SimpleNamespace(weight=weights.w["lora_up.weight"])
        self.down_model = types.SimpleNamespace(weight=weights.w["lora_down.weight"])
        self.mid_model = None
        self.dim = weights.w["lora_down.weight"].shape[0]

    def calc_updown(self, orig_weight):
        up = self.up_model.weight.flatten(1).to(orig_weight.device, torch.float64)
        down = self.down_model.weight.flatten(1).to(orig_weight.device, torch.float64)
        if self.network.dyn_dim is not None:
            up, down = up[:, :self.network.dyn_dim], down[:self.network.dyn_dim]
        updown, ex_bias = self.finalize_updown(up @ down, orig_weight, orig_weight.shape)
        return updown.to(orig_weight.dtype), ex_bias
