"""Stand-in for the Lora extension's ``network_hada``: LoHa without Tucker cores, ΔW = (w1a·w1b) ⊙ (w2a·w2b)."""
import torch

import network


class NetworkModuleHada(network.NetworkModule):
    def __init__(self, net, weights):
        super().__init__(net, weights)
        self.w1a = weights.w["hada_w1_a"]
        self.w1b = weights.w["hada_w1_b"]
        self.dim = self.w1b.shape[0]
        self.w2a = weights.w["hada_w2_a"]
        self.w2b = weights.w["hada_w2_b"]
        self.t1 = weights.w.get("hada_t1")
        self.t2 = weights.w.get("hada_t2")

    def calc_updown(self, orig_weight):
        if self.t1 is not None:
            raise NotImplementedError("stand-in: no Tucker LoHa")
        d = torch.float64
        updown = (self.w1a.to(d) @ self.w1b.to(d)) * (self.w2a.to(d) @ self.w2b.to(d))
        updown, ex_bias = self.finalize_updown(updown, orig_weight, orig_weight.shape)
        return updown.to(orig_weight.dtype), ex_bias
