"""Layouts (family, naming, configuration from shapes) and the parameter breakdown."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from sdslim_core import layout
from sdslim_core.apps.breakdown import canonical_shapes_for_arch
from sdslim_core.io.tensors import save_file_atomic
from sdslim_core.layout import rank_policy
from sdslim_core.modules.unet import build_diffusers_unet, open_checkpoint
from sdslim_core.ops import breakdown, fold


SHARED = Path(__file__).resolve().parents[2] / "shared"   # the project's shared/ beside the checkout
needs_shared = pytest.mark.skipif(not (SHARED / "data").is_dir(), reason="shared/data key lists not present")


def read_key_list(name):
    out = {}
    with open(SHARED / "data" / name) as fh:
        for line in fh:
            key, shape = line.split(" ", 1)
            out[key] = tuple(int(s) for s in shape.strip("()\n ").split(",") if s.strip())
    return out


@needs_shared
@pytest.mark.parametrize("arch,keys", [("sd15", "unet_keys_sd15_ldm.txt"), ("sdxl", "unet_keys_sdxl_ldm.txt")])
def test_diffusers_layout_maps_onto_the_real_ldm_keys(arch, keys):
    real = read_key_list(keys)
    mine, cfg = canonical_shapes_for_arch(arch)
    assert mine == real                                   # every key and shape, both directions
    assert layout.config_from_state_dict(real) == cfg


def test_seed_table_sd15_digit_for_digit():
    shapes, _ = canonical_shapes_for_arch("sd15")
    rows = breakdown.count(shapes, "seed", "sd15")
    assert (rows["resnet"], rows["transformer"], rows["downsample"], rows["upsample"], rows["total"],
            rows["feedforward"]) == (537_670_400, 267_239_360, 19_355_840, 33_180_800, 857_446_400, 148_684_800)


def test_seed_table_sdxl_reproducible_rows_and_exact_total():
    shapes, _ = canonical_shapes_for_arch("sdxl")
    rows = breakdown.count(shapes, "seed", "sdxl")
    assert (rows["resnet"], rows["upsample"], rows["feedforward"]) == (327_782_400, 18_432_000, 1_228_800_000)
    exact = breakdown.count(shapes, "exact")
    assert exact["total"] == 2_567_463_684 == sum(torch.Size(s).numel() for s in shapes.values())


@pytest.mark.parametrize("arch,expected_m", [("sd15", 528), ("sdxl", 1796)])
def test_half_ratio_slim_counts(arch, expected_m):
    shapes, _ = canonical_shapes_for_arch(arch)
    ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), 0.5)
    slim = breakdown.count(fold.slim_shapes(shapes, ranks), "exact")["total"]
    assert abs(slim / 1e6 - expected_m) < 1.0


def test_cli_breakdown_json_seed():
    out = subprocess.run([sys.executable, "-m", "sdslim_core.cli", "breakdown", "--arch", "sd15", "--mode", "seed",
                          "--json", "--ratio", "0.5"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["total"] == 857_446_400 and data["feedforward"] == 148_684_800
    assert data["slim"]["total"] < 0.62 * 859_520_964


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model.", ""])
def test_naming_variants_and_config_from_a_file(tmp_path, prefix):
    cfg = tiny_config()
    unet = build_diffusers_unet(cfg)
    canon, naming, _ = layout.to_canonical(unet.state_dict())
    assert naming == "diffusers"
    extra = {"first_stage_model.decoder.conv_in.weight": torch.zeros(2)} if prefix else {}
    path = save_file_atomic({**{prefix + k: v for k, v in canon.items()}, **extra}, tmp_path / "m.safetensors",
                            {"sdslim.unet_config": {"num_heads": 2}})
    ckpt = open_checkpoint(path)
    assert ckpt.naming == "ldm" and ckpt.prefix == prefix and ckpt.config == cfg
    assert ckpt.other_keys() == list(extra)
    assert torch.equal(ckpt.weights["out.2.weight"], canon["out.2.weight"])


def test_diffusers_file_and_folder(tmp_path):
    cfg = tiny_config("sd2")
    unet = build_diffusers_unet(cfg)
    (tmp_path / "unet").mkdir()
    save_file_atomic(unet.state_dict(), tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.naming == "diffusers" and ckpt.config.family == "sd2" and ckpt.config.use_linear_proj
    assert torch.equal(ckpt.weights["input_blocks.1.0.in_layers.2.weight"],
                       unet.down_blocks[0].resnets[0].conv1.weight)


def test_inpainting_9_channels_and_64_base_channels_supported():
    cfg = layout.UNetConfig(family="sd15", in_channels=9, out_channels=4, model_channels=64, channel_mult=(1, 2, 4, 4),
                            num_res_blocks=2, transformer_depth=(1, 1, 1, 0), mid_transformer_depth=1,
                            context_dim=768, use_linear_proj=False, adm_in_channels=None, num_heads=8,
                            time_embed_dim=256)
    unet = build_diffusers_unet(cfg, device="meta")
    canon, _, _ = layout.to_canonical({k: tuple(v.shape) for k, v in unet.state_dict().items()})
    assert layout.config_from_state_dict(canon) == cfg
    assert len([s for s in layout.sites(canon) if s.kind == "res"]) == 22


@pytest.mark.parametrize("keys,what", [
    ({"joint_blocks.0.x_block.attn.qkv.weight": (1,)}, "SD3"),
    ({"double_blocks.0.img_attn.qkv.weight": (1,)}, "Flux"),
    ({"encoder.down.0.block.0.conv1.weight": (1,)}, "VAE"),
    ({"something.else": (1,)}, "no SD UNet found"),
])
def test_unknown_layouts_are_named(keys, what):
    with pytest.raises(layout.LayoutError, match=what):
        layout.to_canonical(keys)


def test_key_classification():
    assert breakdown.classify_key("input_blocks.1.1.transformer_blocks.0.ff.net.2.weight") == ("transformer", True)
    assert breakdown.classify_key("input_blocks.1.1.proj_in.weight") == ("transformer", False)
    assert breakdown.classify_key("middle_block.0.in_layers.2.weight") == ("resnet", False)
    assert breakdown.classify_key("input_blocks.3.0.op.weight") == ("downsample", False)
    assert breakdown.classify_key("output_blocks.2.1.conv.weight") == ("upsample", False)
    assert breakdown.classify_key("time_embed.0.weight") == ("other", False)


def test_downsample_before_any_resblock_is_a_layout_error():
    shapes = {"input_blocks.0.0.weight": (32, 4, 3, 3), "out.2.weight": (4, 32, 3, 3),
              "input_blocks.1.0.op.weight": (32, 32, 3, 3)}
    with pytest.raises(layout.LayoutError, match="input_blocks.1 is a Downsample"):
        layout.config_from_state_dict(shapes)
