"""Malformed LoRA files give clear errors that name the file and the key."""
import pytest
import torch

from conftest import tiny_config
from sdslim_core import layout
from sdslim_core.io import lora_files
from sdslim_core.io.tensors import FileFormatError, save_file_atomic
from sdslim_core.ops import lora

CFG = tiny_config()
Q = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
NAME = "lora_unet_" + Q.replace(".", "_")


@pytest.fixture(scope="module")
def weights():
    from sdslim_core.modules.unet import build_diffusers_unet
    shapes = {k: tuple(v.shape) for k, v in build_diffusers_unet(CFG, device="meta").state_dict().items()}
    return {k: torch.zeros(s) for k, s in layout.to_canonical(shapes)[0].items()}


def good():
    return {f"{NAME}.lora_down.weight": torch.randn(2, 32), f"{NAME}.lora_up.weight": torch.randn(32, 2),
            f"{NAME}.alpha": torch.tensor(1.0)}


def merge(weights, src):
    return lora.merge_loras(weights, [(src, 1.0)], CFG)


def test_truncated_file(weights, tmp_path):
    path = tmp_path / "trunc.safetensors"
    save_file_atomic(good(), path)
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(lora_files.LoraError, match="truncated") as err:
        merge(weights, str(path))
    assert str(path) in str(err.value)
    path.write_bytes(b"\x00" * 5)
    with pytest.raises(lora_files.LoraError, match="too short"):
        merge(weights, str(path))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt"])
def test_pickle_files_are_refused(weights, tmp_path, suffix):
    path = tmp_path / f"lora{suffix}"
    torch.save(good(), path)
    with pytest.raises(FileFormatError, match="pickle"):
        merge(weights, str(path))


def test_wrong_shapes(weights):
    sd = good()
    sd[f"{NAME}.lora_up.weight"] = torch.randn(32, 3)                     # rank 3 vs down's 2
    with pytest.raises(lora_files.LoraError, match=f"{NAME}.*do not chain"):
        merge(weights, sd)
    sd = good()
    sd[f"{NAME}.lora_down.weight"] = torch.randn(2, 48)                   # in 48 vs the layer's 32
    with pytest.raises(lora_files.LoraError, match=f"{NAME}.*{Q}.weight"):
        merge(weights, sd)
    sd = good()
    sd[f"{NAME}.alpha"] = torch.ones(2)
    with pytest.raises(lora_files.LoraError, match="scalar"):
        merge(weights, sd)
    sd = good()
    sd[f"{NAME}.dora_scale"] = torch.ones(7, 1)
    with pytest.raises(lora_files.LoraError, match="DoRA magnitude"):
        merge(weights, sd)


def test_nan_and_non_float_and_incomplete(weights):
    sd = good()
    sd[f"{NAME}.lora_up.weight"][3, 1] = float("nan")
    with pytest.raises(lora_files.LoraError, match=f"{NAME}.lora_up.weight.*NaN"):
        merge(weights, sd)
    sd = good()
    sd[f"{NAME}.lora_down.weight"] = torch.ones(2, 32, dtype=torch.int64)
    with pytest.raises(lora_files.LoraError, match="expected floats"):
        merge(weights, sd)
    sd = good()
    del sd[f"{NAME}.lora_down.weight"]
    with pytest.raises(lora_files.LoraError, match="incomplete"):
        merge(weights, sd)
    sd = {f"{NAME}.hada_w1_a": torch.randn(32, 2), f"{NAME}.hada_w1_b": torch.randn(2, 32)}
    with pytest.raises(lora_files.LoraError, match="incomplete"):
        merge(weights, sd)


def test_not_a_lora_and_missing_file(weights, tmp_path):
    with pytest.raises(lora_files.LoraError, match="no LoRA/LyCORIS keys"):
        merge(weights, {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(3)})
    with pytest.raises(FileNotFoundError):
        merge(weights, str(tmp_path / "absent.safetensors"))
    with pytest.raises(lora_files.LoraError, match="do not exist in this model"):
        merge(weights, {"lora_unet_no_such_layer.lora_down.weight": torch.zeros(2, 3),
                        "lora_unet_no_such_layer.lora_up.weight": torch.zeros(3, 2)})
