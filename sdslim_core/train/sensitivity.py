"""End-to-end sensitivity of a site: the whole-UNet ε error on held-out inputs with only that site slimmed.

Site-local errors say how well a bottleneck reproduces its own block, not how much that matters: in the shipped tiny
teacher a middle-block site at ⅛ width moves the UNet output by 0.01 % while a high-resolution ResBlock at ½ width
moves it by 15 %. Squared end-to-end errors of different sites add up (to within a few percent when several are
slimmed together), so they are the costs the budget allocator spends parameters on.
"""
from __future__ import annotations

import torch

from ..io.adapters import AdapterSet
from ..modules import swap
from .calibration import InputBank, _gen, unet_call


def probe_ids(bank: InputBank, n: int, seed: int) -> torch.Tensor:
    """``n`` held-out inputs (a fixed random subset of the eval split)."""
    ev = bank.eval_ids()
    if n >= ev.numel():
        return ev
    return torch.sort(ev[torch.randperm(ev.numel(), generator=_gen(seed, 81))[:n]]).values


@torch.no_grad()
def e2e_error(teacher, aset: AdapterSet, bank: InputBank, ids: torch.Tensor, device, dtype, amp,
              batch: int = 8) -> float:
    """Relative error of ``teacher`` (on ``device``) with ``aset``'s sites in train-time form against the teacher's
    recorded ε."""
    tree, _ = swap.attach_train_adapters(teacher, aset)
    for p in tree.parameters():
        p.requires_grad_(False)
    tree.eval()
    num = den = 0.0
    for i in range(0, ids.numel(), batch):
        b = ids[i:i + batch]
        with amp():
            out = unet_call(tree, bank.batch(b, device, dtype)).double()
        ref = bank.eps[b].to(device).double()
        num += float((out - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num / max(den, 1e-30)) ** 0.5


@torch.no_grad()
def flops_per_rank(teacher, cfg, site_list, bank: InputBank, device, dtype, amp) -> tuple[int, dict[str, float]]:
    """(forward FLOPs of the whole UNet, {site: FLOPs per unit of rank}) on one bank input, as torch counts them
    (matmuls and convolutions): each layer the fold shrinks costs in proportion to the rank it keeps."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter, amp():
        unet_call(teacher, bank.batch(bank.fit_ids()[:1], device, dtype))
    by_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(teacher).__name__                       # FlopCounterMode names modules "<root class>.<path>"
    out = {}
    for s in site_list:
        paths = swap.layer_paths(teacher, s.name, s.kind, cfg)
        layers = sum(by_module.get(f"{root}.{p}", 0) for role, p in paths.items() if role != "norm2")
        out[s.name] = layers / s.width
    return int(counter.get_total_flops()), out
