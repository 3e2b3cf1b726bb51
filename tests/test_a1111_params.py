"""sdslim_core.hosts.a1111.params: settings vs. override, adapter folder, infotext fields."""
import os

import pytest

from sdslim_core.hosts.a1111 import params

SETTINGS = {"enable": True, "adapters": "a.safetensors", "strength": 0.5}


@pytest.mark.parametrize("mode, adapter, strength, want", [
    ("Settings", "Settings", 0, params.Job(True, "a.safetensors", 0.5, from_settings=True)),
    ("Off", "Settings", 0, params.Job(False, "a.safetensors", 0.5, from_settings=True)),
    ("Settings", "b.safetensors", 0.75, params.Job(True, "b.safetensors", 0.75)),
])
def test_override_wins_over_settings(mode, adapter, strength, want):
    assert params.resolve(SETTINGS, mode, adapter, strength) == want


def test_on_needs_an_adapter_file_and_a_positive_strength():
    off = dict(SETTINGS, enable=False)
    assert params.resolve(off, "On", "Settings", 0).enabled
    assert not params.resolve(dict(off, adapters=params.NONE), "On", "Settings", 0).enabled
    assert not params.resolve(dict(off, strength=0.0), "On", "Settings", 0).enabled


def test_bad_values_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match="expected one of"):
        params.resolve(SETTINGS, "Maybe", "Settings", 0)
    with pytest.raises(ValueError, match=r"strength 1.5: expected a fraction of sites in \[0, 1\]"):
        params.resolve(SETTINGS, "On", "Settings", 1.5)


def test_adapter_folder_listing_and_paths(tmp_path):
    assert params.list_adapter_files(str(tmp_path / "missing")) == []
    (tmp_path / "sub").mkdir()
    for name in ("B.safetensors", "a.safetensors", "sub/c.safetensors", "notes.txt", "x.ckpt"):
        (tmp_path / name).write_bytes(b"x")
    assert params.list_adapter_files(str(tmp_path)) == ["a.safetensors", "B.safetensors", "sub/c.safetensors"]
    assert params.adapter_path(str(tmp_path), "sub/c.safetensors") == os.path.realpath(tmp_path / "sub/c.safetensors")
    with pytest.raises(ValueError, match="outside the adapter folder"):
        params.adapter_path(str(tmp_path / "sub"), "../a.safetensors")
    with pytest.raises(FileNotFoundError, match="gone.safetensors not found"):
        params.adapter_path(str(tmp_path), "gone.safetensors")


def test_infotext_value_parses_back():
    value = params.infotext_value("sub/my adapters, v2.safetensors", "0123456789", 0.35)
    assert value == "adapters=sub/my adapters, v2.safetensors [0123456789], ratio=0.35"
    assert params.parse_infotext(value) == {"adapter": "sub/my adapters, v2.safetensors", "hash": "0123456789",
                                            "strength": 0.35}
    assert params.parse_infotext(params.infotext_value("a.safetensors", None, 1)) == \
        {"adapter": "a.safetensors", "hash": None, "strength": 1.0}
    assert params.parse_infotext("something else") is None and params.parse_infotext(None) is None


def test_match_adapter_by_name_then_hash():
    parsed = {"adapter": "old.safetensors", "hash": "abc"}
    hashes = {"x.safetensors": "999", "new.safetensors": "abc"}
    assert params.match_adapter(parsed, list(hashes), hashes.get) == "new.safetensors"
    assert params.match_adapter({"adapter": "x.safetensors", "hash": "abc"}, list(hashes), hashes.get) == "x.safetensors"
    assert params.match_adapter({"adapter": "y", "hash": "000"}, list(hashes), hashes.get) is None


def test_short_hash_is_sha256_prefix_and_follows_file_changes(tmp_path):
    import hashlib
    f = tmp_path / "a.safetensors"
    f.write_bytes(b"one")
    files = params.AdapterFiles()
    assert files.short_hash(str(f)) == hashlib.sha256(b"one").hexdigest()[:10]
    f.write_bytes(b"two!")
    assert files.short_hash(str(f)) == hashlib.sha256(b"two!").hexdigest()[:10]


def test_lora_key_and_norm2_hits():
    class Net:
        def __init__(self, name, modules):
            self.name, self.te_multiplier, self.unet_multiplier, self.dyn_dim = name, 1.0, 0.5, None
            self.modules = modules
    nets = [Net("a", {"x_out_layers_0": 1, "y": 2}), Net("b", {"z": 1})]
    assert params.lora_key(nets) == (("a", 1.0, 0.5, None), ("b", 1.0, 0.5, None))
    assert params.norm2_lora_hits(["x_out_layers_0", None, "w"], nets) == {"a": 1}


def test_vram_text():
    gib = 2 ** 30
    assert params.vram_text(3 * gib, 4 * gib, None, gib, gib // 2, "cpu") == \
        "peak 3.00 GiB allocated, 4.00 GiB reserved; UNet weights 1.50 GiB -> 1.00 GiB; originals kept on cpu"
    assert params.vram_text(None, None, 300 * 2 ** 20, None, None, None) == "no CUDA, RAM (RSS) 300.0 MiB"
