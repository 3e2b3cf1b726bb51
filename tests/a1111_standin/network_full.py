"""Stand-in for the Lora extension's ``network_full``: a full difference ``diff`` and its bias ``diff_b``."""
import network


class NetworkModuleFull(network.NetworkModule):
    def __init__(self, net, weights):
        super().__init__(net, weights)
        self.weight = weights.w.get("diff")
        self.ex_bias = weights.w.get("diff_b")

    def calc_updown(self, orig_weight):
        updown, ex_bias = self.finalize_updown(self.weight.to(orig_weight.device), orig_weight, self.weight.shape,
                                               None if self.ex_bias is None else self.ex_bias.to(orig_weight.device))
        return updown.to(orig_weight.dtype), ex_bias
