"""Process topology for multi-GPU runs started by ``accelerate launch`` (or ``torchrun``).

Single-process runs never import accelerate. With ``WORLD_SIZE`` > 1 in the environment, accelerate's
``PartialState`` sets up the process group (NCCL on GPUs, gloo on CPUs) and picks this process's device.
Stage 1 shards the sites over processes; stage 2 is data-parallel (gradients averaged with all-reduce).
"""
from __future__ import annotations

import os

import torch

from .. import devices, optional


class Topology:
    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | None = None, state=None):
        self.rank, self.world, self.device, self.state = rank, world, device, state

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self):
        if self.distributed:
            torch.distributed.barrier()

    def all_reduce_mean_(self, tensors):
        """Average ``tensors`` (in place) over processes, as one flat buffer."""
        if not self.distributed or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        torch.distributed.all_reduce(flat)
        flat /= self.world
        i = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[i:i + n].view_as(t).to(t.dtype))
            i += n

    def broadcast_object(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def owns(self, index: int) -> bool:
        return index % self.world == self.rank


def topology(device: str = "auto") -> Topology:
    """This process's rank/world/device; ``device`` ``auto`` means CUDA when available."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if world > 1:
        accelerate = optional.require("accelerate", f"multi-process training (WORLD_SIZE={world})")
        state = accelerate.PartialState(cpu=want_cpu)
        dev = torch.device("cpu") if want_cpu else state.device
        return Topology(state.process_index, state.num_processes, dev, state)
    return Topology(0, 1, devices.resolve(device, float64=True))
