"""The adapter file format: round trip and one clear error per kind of invalid file."""
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_config
from sdslim_core import layout
from sdslim_core.io.adapters import AdapterError, AdapterSet, _selection
from sdslim_core.layout import rank_policy
from sdslim_core.modules.unet import build_diffusers_unet


@pytest.fixture(scope="module")
def weights():
    return layout.to_canonical(build_diffusers_unet(tiny_config()).state_dict())[0]


@pytest.fixture
def aset(weights):
    return AdapterSet.init_select(weights, rank_policy.ranks_for_ratio(layout.sites(weights), 0.5), "sd15")


def test_round_trip(tmp_path, aset, weights):
    aset.metadata["sdslim.train"] = {"steps": 3, "site_error": {s: 0.1 for s in aset.sites}}
    path = aset.save(tmp_path / "a.safetensors")
    back = AdapterSet.load(path)
    assert back.family == "sd15" and back.ranks() == aset.ranks() and back.norm_groups == aset.norm_groups
    assert all(torch.equal(back.state_dict()[k], v) for k, v in aset.state_dict().items())
    assert back.metadata["sdslim.train"]["steps"] == 3
    back.check_model(weights, "sd15")


def test_res_ranks_keep_whole_norm2_groups():
    """SD's norm2 has 32 groups: a 320-wide block has groups of 10 channels, so Res ranks are multiples of 10 (of 40
    with the tensor-core tile) and the bottleneck norm has one group per kept group; FF ranks are plain fractions."""
    assert rank_policy.rank_for_ratio(320, 0.5, "res") == 160 and rank_policy.res_groups(320, 160) == 16
    assert rank_policy.rank_for_ratio(320, 0.75, "res") == 240 and rank_policy.res_groups(320, 240) == 24
    assert rank_policy.rank_for_ratio(640, 0.01, "res") == 40 and rank_policy.res_groups(640, 40) == 2
    assert rank_policy.res_groups(320, 320) == 32 and rank_policy.res_groups(64, 32) == 16
    # 32 ∤ 48: per channel
    assert rank_policy.rank_for_ratio(48, 0.5, "res") == 24 and rank_policy.res_groups(48, 24) == 24
    assert rank_policy.rank_for_ratio(1280 * 4, 0.5, "ff") == 2560
    assert rank_policy.norm_groups_for(80) == 20 and rank_policy.norm_groups_for(7) == 7


def test_select_by_recorded_error(aset):
    names = list(aset.sites)
    aset.metadata["sdslim.train"] = {"site_error": {s: float(i) for i, s in enumerate(reversed(names))}}
    half = aset.select(0.5)
    assert set(half.sites) == set(names[len(names) - len(half.sites):])
    assert len(aset.select(0.0).sites) == 0 and len(aset.select(1.0).sites) == len(names)


def _write(path, tensors, meta):
    save_file(tensors, str(path), metadata=meta)
    return path


GOOD_META = {"sdslim.format": "sdslim-adapters", "sdslim.version": "1", "sdslim.family": "sd15"}


def _ff(r=4, m=8):
    return {"input_blocks.1.1.transformer_blocks.0.ff.down_value": torch.zeros(r, m),
            "input_blocks.1.1.transformer_blocks.0.ff.down_gate": torch.zeros(r, m),
            "input_blocks.1.1.transformer_blocks.0.ff.up": torch.zeros(m, r)}


def _res(r=8, c=16):
    return {"input_blocks.1.0.down": torch.zeros(r, c), "input_blocks.1.0.norm.weight": torch.ones(r),
            "input_blocks.1.0.norm.bias": torch.zeros(r), "input_blocks.1.0.up": torch.zeros(c, r)}


@pytest.mark.parametrize("tensors,meta,message", [
    (_ff(), {**GOOD_META, "sdslim.version": "3"}, "sdslim.version '3' is not supported"),
    (_ff(), {k: v for k, v in GOOD_META.items() if k != "sdslim.format"}, "missing metadata 'sdslim.format'"),
    (_ff(), {**GOOD_META, "sdslim.format": "lora"}, "sdslim.format is 'lora'"),
    (_ff(), {**GOOD_META, "sdslim.family": "flux"}, "unknown family 'flux'"),
    ({**_ff(), "input_blocks.1.1.transformer_blocks.0.ff.up": torch.zeros(8, 3)}, GOOD_META,
     r"ff\.up: shape \(8, 3\), expected \(8, 4\)"),
    ({k.replace("input_blocks.1.1", "input_blocks.1.7"): v for k, v in _ff().items()}, GOOD_META,
     "is not a site name"),
    ({**_ff(), "input_blocks.1.1.transformer_blocks.0.ff.extra": torch.zeros(1)}, GOOD_META, "unknown tensor"),
    (_ff(r=9, m=8), GOOD_META, "rank 9 exceeds the width 8"),
    (_res(r=8), {**GOOD_META, "sdslim.norm_groups": json.dumps({"input_blocks.1.0": 3})}, "3 GroupNorm groups do not divide rank 8"),
    (_res(r=8), GOOD_META, "32 GroupNorm groups do not divide rank 8"),
    ({**_ff(), "input_blocks.1.1.transformer_blocks.0.ff.down_gate": torch.full((4, 8), float("nan"))}, GOOD_META,
     "down_gate: contains NaN"),
    ({"input_blocks.1.0.down": torch.zeros(8, 16)}, GOOD_META, "res site needs tensors"),
])
def test_invalid_files_each_give_their_own_error(tmp_path, tensors, meta, message):
    path = _write(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(AdapterError, match=message) as err:
        AdapterSet.load(path)
    assert str(path) in str(err.value)


def test_truncated_and_pickle_files(tmp_path, aset):
    path = aset.save(tmp_path / "a.safetensors")
    data = path.read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        AdapterSet.load(tmp_path / "t.safetensors")
    (tmp_path / "a.ckpt").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle"):
        AdapterSet.load(tmp_path / "a.ckpt")


def test_a_damaged_safetensors_file_is_a_file_format_error_naming_it(tmp_path, aset):
    """Cut at every byte of its header, garbage, text, headers that safetensors itself refuses: every reader gives
    a FileFormatError naming the file (none an AttributeError or a SafetensorError that names no file)."""
    import struct

    from conftest import damaged_copies
    from sdslim_core.io import slim_checkpoint
    from sdslim_core.io.adapters import is_adapter_file
    from sdslim_core.io.tensors import FileFormatError, LazyStateDict, read_header
    site = next(s for s in aset.sites if aset.kind(s) == "ff")
    good = AdapterSet("sd15", {site: aset.sites[site]}).save(tmp_path / "good.safetensors")
    assert is_adapter_file(good)
    damaged = damaged_copies(good, tmp_path / "damaged", 8 + struct.unpack("<Q", good.read_bytes()[:8])[0])

    def raw(name, header):
        text = json.dumps(header).encode()
        (tmp_path / "damaged" / name).write_bytes(struct.pack("<Q", len(text)) + text + bytes(64))
        return tmp_path / "damaged" / name
    one = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    damaged += [raw("meta-list.safetensors", {"__metadata__": ["sdslim.slim"], "a": one}),
                raw("meta-text.safetensors", {"__metadata__": "sdslim.slim", "a": one}),
                raw("meta-number.safetensors", {"__metadata__": {"sdslim.slim": 1}, "a": one}),
                raw("short-data.safetensors", {"a": dict(one, data_offsets=[0, 8])}),
                raw("backwards.safetensors", {"a": dict(one, shape=[0], data_offsets=[16, 0])}),
                raw("negative.safetensors", {"a": dict(one, shape=[-4])})]
    for path in damaged:
        gone = not path.exists()
        readers = (read_header, LazyStateDict, AdapterSet.load, slim_checkpoint.read_slim)
        for read in readers + (() if gone else (slim_checkpoint.is_slim_checkpoint,)):
            with pytest.raises(FileNotFoundError if gone else FileFormatError, match=re.escape(str(path))):
                read(path)
        assert not is_adapter_file(path)


def test_model_mismatch_is_named(aset):
    other = layout.to_canonical(build_diffusers_unet(tiny_config(), device="meta").state_dict())[0]
    with pytest.raises(AdapterError, match="adapters are for sd15, the model is sdxl"):
        aset.check_model(other, "sdxl")
    bigger = dict(other)
    bigger["input_blocks.1.0.in_layers.2.weight"] = torch.empty(64, 32, 3, 3, device="meta")
    with pytest.raises(AdapterError, match="does not match the model's 64"):
        aset.check_model(bigger)


def test_data_free_selection_stays_on_the_weights_device():
    """The 0/1 selection is built where the scores live (CUDA weights must not get CPU selections)."""
    score = torch.rand(8, device="meta")
    assert _selection(score, 3).device == score.device
    sel = _selection(torch.tensor([0.1, 5.0, 0.2, 3.0]), 2)
    assert torch.equal(sel, torch.tensor([[0.0, 1, 0, 0], [0, 0, 0, 1]]))
