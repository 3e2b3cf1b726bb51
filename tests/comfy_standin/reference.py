"""Float64 reference of the fold, written from the formulas in shared/design.md (not with sdslim_core.ops.fold)."""
import torch


def fold64(weights, tensors, site, kind, deltas=None):
    """Folded canonical tensors of one site; ``deltas`` (key → float64 tensor) are added to the weights first."""
    deltas = deltas or {}

    def w(k):
        return weights[k].double() + deltas.get(k, 0)
    t = {n: v.double() for n, v in tensors.items()}
    if kind == "ff":
        wp, bp, wo = w(f"{site}.net.0.proj.weight"), w(f"{site}.net.0.proj.bias"), w(f"{site}.net.2.weight")
        m = wo.shape[1]
        out = {f"{site}.net.0.proj.weight": torch.cat([t["down_value"] @ wp[:m], t["down_gate"] @ wp[m:]]),
               f"{site}.net.0.proj.bias": torch.cat([t["down_value"] @ bp[:m], t["down_gate"] @ bp[m:]]),
               f"{site}.net.2.weight": wo @ t["up"]}
        if "up_bias" in t:          # the intercept c: y = W_o (U h + c) + b_o, so b'_o = b_o + W_o c
            out[f"{site}.net.2.bias"] = w(f"{site}.net.2.bias") + wo @ t["up_bias"]
        return out
    d, u = t["down"], t["up"]
    return {f"{site}.in_layers.2.weight": torch.einsum("rc,cikl->rikl", d, w(f"{site}.in_layers.2.weight")),
            f"{site}.in_layers.2.bias": d @ w(f"{site}.in_layers.2.bias"),
            f"{site}.emb_layers.1.weight": d @ w(f"{site}.emb_layers.1.weight"),
            f"{site}.emb_layers.1.bias": d @ w(f"{site}.emb_layers.1.bias"),
            f"{site}.out_layers.0.weight": t["norm.weight"], f"{site}.out_layers.0.bias": t["norm.bias"],
            f"{site}.out_layers.3.weight": torch.einsum("ocij,cr->orij", w(f"{site}.out_layers.3.weight"), u)}
