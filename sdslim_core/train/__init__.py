"""``sdslim train``: distil slim adapters from the teacher model itself.

Recipe (see ``docs/training.md``): calibration data from the teacher's own sampling trajectories (or user
latents) → activation-aware initialisation, measured per site against data-free baselines (best kept) →
stage 1, block-local distillation (sites independent, one at a time on the device) → stage 2,
BERT-of-Theseus progressive replacement on the full UNet output. Ranks: a uniform ratio, per-kind overrides,
or a parameter/byte budget allocated from measured error-vs-rank curves.

Public API::

    from sdslim_core.train import train_adapters, TrainConfig, Calibration
    adapters, report = train_adapters(unet, cfg, Calibration.from_contexts([ctx]), TrainConfig(ratio=0.5),
                                      "slim.safetensors", progress=None, resume=False)
    print(report)            # tables; report.to_dict() for JSON

Heavy imports (diffusers, matplotlib, accelerate) happen inside the functions that need them.
"""
from .calibration import Calibration
from .checkpoint import CheckpointError
from .config import TrainConfig, parse_budget
from .report import TrainReport
from .run import TrainResult, train_adapters

__all__ = ["train_adapters", "TrainConfig", "TrainResult", "TrainReport", "Calibration", "CheckpointError",
           "parse_budget"]
