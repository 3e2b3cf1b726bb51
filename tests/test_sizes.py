"""File sizes by part, read from headers: against the bytes of every tensor written (a second count) and the size
on disk."""
import math
import os

import pytest
import torch

from sdslim_core import layout, tiny
from sdslim_core.io import sizes
from sdslim_core.io.tensors import LazyStateDict, save_file_atomic


def test_a_checkpoints_parts_are_its_tensors_bytes_and_sum_to_the_file(tmp_path):
    tensors = {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(8, 4, 3, 3),
               "model.diffusion_model.out.2.bias": torch.zeros(4, dtype=torch.float16),
               "first_stage_model.decoder.conv_out.weight": torch.zeros(3, 8, 3, 3, dtype=torch.float16),
               "cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.zeros(12),
               "conditioner.embedders.1.model.ln_final.weight": torch.zeros(5, dtype=torch.bfloat16),
               layout.ADAPTER_TENSORS + "input_blocks.1.0.down": torch.zeros(2, 8, dtype=torch.float16),
               "something_else": torch.zeros(3, dtype=torch.int64)}
    path = save_file_atomic(tensors, tmp_path / "m.safetensors", {"note": "x" * 100})
    got = sizes.file_size(path)
    want = {"unet": 8 * 4 * 9 * 4 + 4 * 2, "vae": 3 * 8 * 9 * 2, "text_encoders": 12 * 4 + 5 * 2,
            "adapters": 2 * 8 * 2, "other": 3 * 8}
    assert {p: got.parts[p] for p in want} == want
    assert got.total == os.path.getsize(path) == sum(got.parts.values()) and got.parts["header"] > 100
    assert got.text().startswith(f"{got.total / 2 ** 20:.1f} MiB (UNet")


def test_the_shipped_checkpoint_and_a_gguf_file(tmp_path):
    got = sizes.file_size(tiny.DEFAULT_PATH)
    lazy = LazyStateDict(tiny.DEFAULT_PATH)
    unet = sum(math.prod(s) * d.itemsize for k, (d, s) in lazy.entries.items() if k.startswith("model.diffusion_model."))
    assert got.parts["unet"] == unet and got.parts["vae"] > 0 and got.parts["text_encoders"] > 0
    pytest.importorskip("gguf")
    from sdslim_core.apps.slim import slim_checkpoint
    out = slim_checkpoint(tiny.DEFAULT_PATH, None, tmp_path / "q.gguf", quant="Q4_0").out
    g = sizes.file_size(out)
    from sdslim_core.io.gguf import GGUFFile, tensor_bytes
    f = GGUFFile(out)
    assert g.parts["unet"] == sum(tensor_bytes(f.entries[k][1], "Q4_0") for k in f)
    assert g.total == os.path.getsize(out) == sum(g.parts.values()) and g.parts["vae"] == 0


def test_a_diffusers_folder_by_subfolder(tmp_path):
    for sub, n in (("unet", 1000), ("vae", 300), ("text_encoder", 200), ("tokenizer", 10), ("scheduler", 5)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "f.bin").write_bytes(b"0" * n)
    (tmp_path / "model_index.json").write_bytes(b"{}")
    got = sizes.file_size(tmp_path)
    assert (got.parts["unet"], got.parts["vae"], got.parts["text_encoders"], got.parts["other"]) == (1000, 300, 210, 7)


def test_the_ladders_unet_bytes_are_the_unet_part_of_each_formats_file(tmp_path):
    """`quant.storage_bytes` (eval's and the demo's UNet bytes) against the files sdslim writes: fp16 slim, fp8 slim,
    GGUF Q4_0 slim, read back from disk."""
    pytest.importorskip("gguf")
    from sdslim_core.apps.slim import slim_checkpoint
    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.ops import fold, quant
    half = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
    lazy = LazyStateDict(tiny.DEFAULT_PATH)
    weights = {k: v.float() for k, v in layout.to_canonical({k: lazy[k] for k in lazy})[0].items()
               if k.split(".", 1)[0] in layout.UNET_TOP_MODULES}
    slim_w = {**weights, **fold.fold_state_dict(weights, AdapterSet.load(half))}
    for name, kwargs, method in (("s.safetensors", {}, None),
                                 ("s8.safetensors", {"weight_dtype": torch.float8_e4m3fn}, "fp8"),
                                 ("s.gguf", {"quant": "Q4_0"}, "q4_0")):
        res = slim_checkpoint(tiny.DEFAULT_PATH, half, tmp_path / name, **kwargs)
        assert sizes.file_size(res.out).parts["unet"] == quant.storage_bytes(slim_w, method), name
