"""Stand-in for the Lora extension's ``network_lokr``: LoKr, ΔW = kron(w1, w2), each side whole or factorised."""
import torch

import network


class NetworkModuleLokr(network.NetworkModule):
    def __init__(self, net, weights):
        super().__init__(net, weights)
        self.w1 = weights.w.get("lokr_w1")
        self.w1a = weights.w.get("lokr_w1_a")
        self.w1b = weights.w.get("lokr_w1_b")
        self.dim = self.w1b.shape[0] if self.w1b is not None else self.dim
        self.w2 = weights.w.get("lokr_w2")
        self.w2a = weights.w.get("lokr_w2_a")
        self.w2b = weights.w.get("lokr_w2_b")
        self.dim = self.w2b.shape[0] if self.w2b is not None else self.dim
        self.t2 = weights.w.get("lokr_t2")

    def calc_updown(self, orig_weight):
        if self.t2 is not None:
            raise NotImplementedError("stand-in: no Tucker LoKr")
        d = torch.float64
        w1 = self.w1.to(d) if self.w1 is not None else self.w1a.to(d) @ self.w1b.to(d)
        w2 = self.w2.to(d) if self.w2 is not None else self.w2a.to(d) @ self.w2b.to(d)
        updown, ex_bias = self.finalize_updown(torch.kron(w1, w2), orig_weight, orig_weight.shape)
        return updown.to(orig_weight.dtype), ex_bias
