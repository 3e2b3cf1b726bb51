"""Worker for tests/test_train_dist.py, started twice by ``torch.distributed.run`` (what ``accelerate launch``
uses): trains the tiny teacher with 2 CPU processes (gloo) and saves this rank's final adapters."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import tiny_config  # noqa: E402

torch.set_num_threads(1)
from sdslim_core.train import Calibration, TrainConfig, train_adapters  # noqa: E402
from sdslim_core.modules.unet import build_diffusers_unet


def main(out_dir, config_json):
    torch.manual_seed(0)
    teacher = build_diffusers_unet(tiny_config()).eval()
    ctx = torch.randn(3, 6, tiny_config().context_dim, generator=torch.Generator().manual_seed(1))
    tc = TrainConfig(device="cpu", **json.loads(config_json))
    result = train_adapters(teacher, tiny_config(), Calibration.from_contexts(ctx), tc,
                            os.path.join(out_dir, "adapters.safetensors"))
    rank = int(os.environ["RANK"])
    result.adapters.save(os.path.join(out_dir, f"rank{rank}.safetensors"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"unet_error": result.report.unet_error, "site_error": result.report.site_error,
                   "world": int(os.environ["WORLD_SIZE"])}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
