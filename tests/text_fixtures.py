"""Checkpoints carrying random CLIP text encoders in their real layouts (tools/random_checkpoint.py), at the tests'
small widths with the tiny UNet, for the prompt-encoding tests."""
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import random_checkpoint as rc  # noqa: E402
sys.path.pop(0)

from conftest import tiny_config  # noqa: E402
from sdslim_core import layout  # noqa: E402
from sdslim_core.layout.text_encoders import FAMILY_TEXT_ENCODERS  # noqa: E402

SMALL, FULL = rc.SMALL, rc.FULL


def context_dim(family, sizes=SMALL) -> int:
    return sum(sizes[e.name][0] for e in FAMILY_TEXT_ENCODERS[family])


def tiny_unet_config(family, sizes=SMALL) -> layout.UNetConfig:
    """The tests' tiny UNet (conftest) with the context (and SDXL pooled) width of these text encoders."""
    cfg = tiny_config(family, context_dim=context_dim(family, sizes))
    if family == "sdxl":
        cfg = dataclasses.replace(cfg, adm_in_channels=sizes["clip_g"][3] + 6 * 256)
    return cfg


def write_checkpoint(path, family, sizes=SMALL, seed=0, dtype=torch.float32):
    """A single-file LDM checkpoint: the tiny UNet and the family's text encoders, random."""
    return rc.write(path, family, tiny_unet_config(family, sizes), sizes, dtype=dtype, seed=seed, vae=None)


def encoder_state(path, entry) -> dict:
    """One encoder's tensors as the file stores them (its prefix stripped), float64."""
    from sdslim_core.io.tensors import LazyStateDict
    lazy = LazyStateDict(path)
    return {k[len(entry.prefix):]: lazy[k].double() for k in lazy if k.startswith(entry.prefix)}


def unet_config_json(family, sizes=SMALL) -> str:
    return json.dumps(tiny_unet_config(family, sizes).to_dict())
