"""RAM of a CPU run, said before it is needed: what the teacher holds, what one stage-2 step's autograd keeps and
what a batch-8 forward peaks at (counted on one small forward of the teacher, scaled to the run's latent), and
what this machine has free."""
from __future__ import annotations

import dataclasses

import torch

from .. import layout

GIB = 2 ** 30
FORWARD_PEAK = 3        # a no-grad forward holds about this many of its largest activations at once
PROBE_LATENT = 16       # the latent size of the counting forward (the smallest every family's UNet takes)


def available_ram() -> int:
    """Bytes of RAM free for this process now (psutil's ``available``: Linux's MemAvailable, and what Windows and
    macOS report as such)."""
    import psutil
    return psutil.virtual_memory().available


def saved_per_input(teacher: torch.nn.Module, cfg: layout.UNetConfig, latent_size: int) -> tuple[int, int]:
    """(bytes autograd saves for one UNet input at ``latent_size``, bytes of the largest saved activation):
    counted on a real forward of ``teacher`` at a small latent (:data:`PROBE_LATENT`, the same kernels as the run)
    and scaled by the pixels (every saved activation is per pixel or per token: convolutions, norms, linear
    layers, fused attention's output and log-sum-exp)."""
    from .calibration import unet_call
    size = min(latent_size, PROBE_LATENT)
    p = next(teacher.parameters())
    weights = {q.untyped_storage().data_ptr() for q in teacher.parameters()}
    saved: dict = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            saved[key] = t.untyped_storage().nbytes()
        return t
    inputs = {"sample": torch.zeros(1, cfg.in_channels, size, size, device=p.device, dtype=p.dtype,
                                    requires_grad=True),
              "timestep": torch.full((1,), 500.0, device=p.device),
              "encoder_hidden_states": torch.zeros(1, 77, cfg.context_dim, device=p.device, dtype=p.dtype)}
    if cfg.adm_in_channels:
        px = float(size * 8)
        inputs["added_cond_kwargs"] = {
            "text_embeds": torch.zeros(1, cfg.adm_in_channels - 6 * 256, device=p.device, dtype=p.dtype),
            "time_ids": torch.tensor([[px, px, 0, 0, px, px]], device=p.device, dtype=p.dtype)}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unet_call(teacher, inputs)     # kept until counted: the graph holds what it saved, storages unique
    scale = (latent_size / size) ** 2
    counted = int(sum(saved.values()) * scale), int(max(saved.values(), default=0) * scale)
    del out
    return counted


@dataclasses.dataclass(frozen=True)
class RamNeed:
    """Bytes: ``teacher`` (its weights as read plus the module built from them), ``step`` (one stage-2 step's saved
    activations per input; an upper bound when stage 2 checkpoints), ``forward`` (a batch-8 forward's peak),
    ``adapters`` (stage 2's adapters with their gradients and AdamW states)."""
    teacher: int
    step_per_input: int
    forward: int
    adapters: int

    def warm_up(self, stage2_inputs: int) -> int:
        """What the warm-up adds to the loaded teacher (its stage-2 step at ``stage2_inputs``, 0: no step)."""
        step = self.step_per_input * stage2_inputs + self.adapters if stage2_inputs else 0
        return max(self.forward, step)

    def run(self, stage2_inputs: int, calib_ram: int) -> int:
        """A run's peak: the teacher, plus the larger of the calibration (captured activations kept in RAM and a
        forward) and stage 2 (``stage2_inputs`` 0: none)."""
        return self.teacher + max(calib_ram + self.forward, self.warm_up(stage2_inputs))


def ram_need(session, adapter_params: int) -> RamNeed:
    """The :class:`RamNeed` of ``session``'s run (adapters: ``adapter_params`` trained at once in stage 2)."""
    from .ranks import param_count
    key = session.latent_size
    if getattr(session, "_saved_per_input", (None,))[0] != key:
        session._saved_per_input = key, saved_per_input(session.placement.on_device(), session.cfg, key)
    per_input, largest = session._saved_per_input[1]
    itemsize = torch.finfo(session.teacher_dtype).bits // 8
    return RamNeed(teacher=2 * param_count(session.shapes) * itemsize, step_per_input=per_input, forward=FORWARD_PEAK * 8 * largest,
                   adapters=16 * adapter_params)


def gib(n: float) -> str:
    """``n`` bytes for a message (GiB above 1 GiB)."""
    from ..io.files import format_bytes
    return f"{n / GIB:.1f} GiB" if n >= GIB else format_bytes(n)
