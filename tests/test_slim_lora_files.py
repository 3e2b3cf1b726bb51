"""LoRAs after slimming: applied to a slim checkpoint in slim space (`sdslim slim --ckpt SLIM`) with its adapter file
found by sha256 (renamed, moved, missing, duplicated) or embedded compactly (`--embed-adapters`), LoRAs rewritten for
it (`sdslim lora convert`), and the host loaders' key filters on a real slim file that embeds its adapters."""
import json
import math
import os

import pytest
import torch

from sdslim_core import cli, layout
from sdslim_core.apps import slim
from sdslim_core.io import lora_files, slim_checkpoint
from sdslim_core.io.tensors import load_file, read_header, save_file_atomic
from sdslim_core.modules import unet as unet_mod
from sdslim_core.ops import lora
from test_slim_roundtrip import CFG, EXTRA, PREFIX, canonical_weights, make_loras, random_adapters, write_ldm_checkpoint

TOL = 1e-12


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def run(capsys, *args):
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def loha_file(w, seed=9):
    """LoHa on every GEGLU proj and conv2 (LDM kohya names), a text-encoder key, and a norm2 delta."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, v in w.items():
        module = key[:-len(".weight")]
        if key.endswith(".weight") and (module.endswith("ff.net.0.proj") or module.endswith("out_layers.3")):
            n = "lora_unet_" + module.replace(".", "_")
            flat = v[0].numel()
            sd.update({f"{n}.hada_w1_a": torch.randn(v.shape[0], 2, generator=g, dtype=torch.float64) * 0.3,
                       f"{n}.hada_w1_b": torch.randn(2, flat, generator=g, dtype=torch.float64),
                       f"{n}.hada_w2_a": torch.randn(v.shape[0], 2, generator=g, dtype=torch.float64) * 0.3,
                       f"{n}.hada_w2_b": torch.randn(2, flat, generator=g, dtype=torch.float64),
                       f"{n}.alpha": torch.tensor(1.0)})
    sd["lora_unet_input_blocks_1_0_out_layers_0.w_norm"] = torch.full((32,), 0.1, dtype=torch.float64)
    sd["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.ones(2, 4, dtype=torch.float64)
    sd["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = torch.ones(4, 2, dtype=torch.float64)
    return sd


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A float64 SD1.5-layout checkpoint, its adapters, LoRAs, and slim checkpoints: the default (adapter file by
    sha256) and one that embeds its adapters."""
    d = tmp_path_factory.mktemp("slimlora")
    w = canonical_weights(seed=3)
    write_ldm_checkpoint(d / "base.safetensors", w)
    random_adapters(w, seed=4).save(d / "adapters.safetensors")
    kohya, locon, _ = make_loras(w, seed=6)
    save_file_atomic(kohya, d / "kohya.safetensors", {"ss_network_dim": "4"})
    save_file_atomic(locon, d / "locon.safetensors")
    save_file_atomic(loha_file(w), d / "loha.safetensors")
    slim.slim_checkpoint(d / "base.safetensors", d / "adapters.safetensors", d / "slim.safetensors")
    slim.slim_checkpoint(d / "base.safetensors", d / "adapters.safetensors", d / "slim_embedded.safetensors",
                         embed_adapters=True)
    return d


def unet_tensors(path):
    tensors, meta = load_file(path)
    return {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}, tensors, meta


def folded_with(d, tmp, loras, name):
    """The reference: the original checkpoint with the LoRAs merged, then folded (today's path)."""
    out = tmp / name
    slim.slim_checkpoint(d / "base.safetensors", d / "adapters.safetensors", out,
                         [(str(d / f), s) for f, s in loras])
    return unet_tensors(out)[0]


def assert_same_unet(got, ref):
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].shape == ref[k].shape and got[k].dtype == ref[k].dtype, k
        if ref[k].norm() > 0:
            assert rel(got[k], ref[k]) < TOL, k


# ----------------------------------------------------------------------------- `sdslim slim --ckpt SLIM`

def fresh_index(monkeypatch, tmp_path):
    """Another machine: the hash index has never seen a file."""
    monkeypatch.setenv("SDSLIM_CACHE_DIR", str(tmp_path / "fresh-cache"))


def lora_effect_cosine(got, ref, before):
    num = sum(float(((got[k] - before[k]).double() * (ref[k] - before[k]).double()).sum()) for k in ref)
    den = math.sqrt(sum(float((got[k] - before[k]).double().pow(2).sum()) for k in ref) *
                    sum(float((ref[k] - before[k]).double().pow(2).sum()) for k in ref))
    return num / den


def test_loras_on_a_slim_checkpoint_equal_folding_them_in_with_the_adapter_file_found_by_hash(files, tmp_path, capsys,
                                                                                             monkeypatch):
    d = files
    fresh_index(monkeypatch, tmp_path)
    alone = tmp_path / "alone"                   # the slim checkpoint, the LoRAs, the adapter file renamed
    alone.mkdir()
    for f in ("slim.safetensors", "kohya.safetensors", "locon.safetensors", "loha.safetensors"):
        os.link(d / f, alone / f)
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    os.link(d / "adapters.safetensors", shelf / "renamed.safetensors")
    monkeypatch.setenv("SDSLIM_ADAPTER_PATH", str(shelf))
    rc, out, err = run(capsys, "slim", "--ckpt", alone / "slim.safetensors", "--lora",
                       f"{alone / 'kohya.safetensors'}:0.8", "--lora", f"{alone / 'locon.safetensors'}:-0.5",
                       "--out", tmp_path / "a.safetensors", "--json")
    assert rc == 0, err
    info = json.loads(out)
    # kohya: 2 FF layers low-rank, 2 attention layers unchanged; LoCon: conv1/conv2/emb low-rank, a skip conv unchanged
    assert info["lora_forms"] == {"low-rank": 5, "unchanged": 3} and info["adapter_bytes"] == 0
    got, tensors, meta = unet_tensors(tmp_path / "a.safetensors")
    ref = folded_with(d, tmp_path, [("kohya.safetensors", 0.8), ("locon.safetensors", -0.5)], "ref_a.safetensors")
    assert_same_unet(got, ref)
    base_tensors, base_meta = load_file(d / "slim.safetensors")
    for k, v in base_tensors.items():            # VAE/text encoder copied through
        if not k.startswith(PREFIX):
            assert torch.equal(tensors[k], v), k
    assert json.loads(meta["sdslim.loras"]) == [
        {"file": "kohya.safetensors", "strength": 0.8, "applied": "in slim space"},
        {"file": "locon.safetensors", "strength": -0.5, "applied": "in slim space"}]
    assert meta["sdslim.ranks"] == base_meta["sdslim.ranks"] and meta["sdslim.adapters"] == base_meta["sdslim.adapters"]

    # stacking: a LoHa applied to the LoRA-ed slim checkpoint = folding all three in; the norm2 part is lost. The
    # index remembers the renamed file: nothing is hashed again
    from sdslim_core.io.adapter_lookup import HashIndex
    assert shelf / "renamed.safetensors" in HashIndex().known(json.loads(meta["sdslim.adapters"])["sha256"])
    calls = []
    monkeypatch.setattr("sdslim_core.io.adapter_lookup.sha256_file", lambda p: calls.append(p))
    rc, out, err = run(capsys, "slim", "--ckpt", tmp_path / "a.safetensors", "--lora",
                       f"{alone / 'loha.safetensors'}:0.6", "--out", tmp_path / "b.safetensors")
    assert rc == 0 and out == "" and calls == []
    assert "applied in slim space" in err and "norm2" in err and "lora_unet_input_blocks_1_0_out_layers_0" in err
    ref = folded_with(d, tmp_path, [("kohya.safetensors", 0.8), ("locon.safetensors", -0.5),
                                    ("loha.safetensors", 0.6)], "ref_b.safetensors")
    assert_same_unet(unet_tensors(tmp_path / "b.safetensors")[0], ref)


def test_missing_clashing_and_duplicated_adapter_files(files, tmp_path, capsys, monkeypatch):
    """Missing: one message naming the sha256 and recorded name, saying the LoRA can be merged before slimming, and
    nothing written. A different file under the recorded name is not taken. Two copies: the first folder wins."""
    d = files
    fresh_index(monkeypatch, tmp_path)
    alone = tmp_path / "alone"
    alone.mkdir()
    os.link(d / "slim.safetensors", alone / "slim.safetensors")
    sha = json.loads(read_header(d / "slim.safetensors")[1]["sdslim.adapters"])["sha256"]
    random_adapters(canonical_weights(seed=3), seed=5).save(alone / "adapters.safetensors")   # the name, not the file
    rc, out, err = run(capsys, "slim", "--ckpt", alone / "slim.safetensors", "--lora", d / "kohya.safetensors",
                       "--out", tmp_path / "x.safetensors")
    assert rc == 2 and sha in err and "adapters.safetensors" in err and "merge the LoRA before slimming" in err
    assert "has the recorded name but another sha256" in err and str(alone) in err
    assert not (tmp_path / "x.safetensors").exists()
    rc, _, err = run(capsys, "adapters", "find", alone / "slim.safetensors")
    assert rc == 2 and sha in err
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
        os.link(d / "adapters.safetensors", folder / "copy.safetensors")
    monkeypatch.setenv("SDSLIM_ADAPTER_PATH", os.pathsep.join([str(second), str(first)]))
    rc, out, _ = run(capsys, "adapters", "find", alone / "slim.safetensors")
    assert rc == 0 and out.strip() == str(second / "copy.safetensors")
    rc, out, _ = run(capsys, "adapters", "find", alone / "slim.safetensors", "--folder", first)
    assert rc == 0 and out.strip() == str(first / "copy.safetensors")
    # the config file's adapter_paths, and --adapters FOLDER, are searched the same way
    monkeypatch.delenv("SDSLIM_ADAPTER_PATH")
    (tmp_path / "config.json").write_text(json.dumps({"adapter_paths": [str(first)]}))
    monkeypatch.setenv("SDSLIM_CONFIG", str(tmp_path / "config.json"))
    rc, _, err = run(capsys, "slim", "--ckpt", alone / "slim.safetensors", "--lora", d / "kohya.safetensors",
                     "--out", tmp_path / "y.safetensors")
    assert rc == 0, err
    monkeypatch.setenv("SDSLIM_CONFIG", str(tmp_path / "none.json"))
    fresh_index(monkeypatch, tmp_path / "again")
    rc, _, err = run(capsys, "slim", "--ckpt", alone / "slim.safetensors", "--adapters", second, "--lora",
                     d / "kohya.safetensors", "--out", tmp_path / "z.safetensors")
    assert rc == 0, err
    y, z = (unet_tensors(tmp_path / f"{n}.safetensors")[0] for n in "yz")
    assert all(torch.equal(y[k], z[k]) for k in y)


def test_embedded_compact_adapters_need_no_adapter_file(files, tmp_path, capsys, monkeypatch):
    """`--embed-adapters`: the adapters ride in the file as fp16; LoRAs after it need no adapter file and keep the
    LoRA's effect (cosine against folding the LoRA in with the float64 adapters ≥ 0.9999)."""
    d = files
    fresh_index(monkeypatch, tmp_path)
    alone = tmp_path / "alone"
    alone.mkdir()
    os.link(d / "slim_embedded.safetensors", alone / "slim.safetensors")
    entries, meta = read_header(alone / "slim.safetensors")
    own = {k: v for k, v in entries.items() if k.startswith(slim_checkpoint.ADAPTER_PREFIX)}
    assert own and {dt for dt, _ in own.values()} == {torch.float16}
    assert json.loads(meta["sdslim.adapters"])["embedded"] == "fp16"
    rc, out, err = run(capsys, "slim", "--ckpt", alone / "slim.safetensors", "--lora", f"{d / 'kohya.safetensors'}:0.8",
                       "--lora", f"{d / 'locon.safetensors'}:-0.5", "--out", tmp_path / "e.safetensors", "--json")
    assert rc == 0, err
    got = unet_tensors(tmp_path / "e.safetensors")[0]
    ref = folded_with(d, tmp_path, [("kohya.safetensors", 0.8), ("locon.safetensors", -0.5)], "ref_e.safetensors")
    before = unet_tensors(alone / "slim.safetensors")[0]
    assert lora_effect_cosine(got, ref, before) > 0.9999
    assert max(rel(got[k], ref[k]) for k in ref if ref[k].norm() > 0) < 1e-3     # fp16 adapters: not exact
    # fp8 storage: the matrices embedded in fp8 (read back as float32), against the same fp8 file with the
    # adapter file's float64 adapters
    for name, embed in (("f8.safetensors", False), ("f8e.safetensors", True)):
        slim.slim_checkpoint(d / "base.safetensors", d / "adapters.safetensors", tmp_path / name,
                             weight_dtype=torch.float8_e4m3fn, embed_adapters=embed)
        slim.slim_checkpoint(tmp_path / name, None, tmp_path / ("lora_" + name), [(d / "kohya.safetensors", 0.8)])
    entries, meta = read_header(tmp_path / "f8e.safetensors")
    assert {entries[k][0] for k in entries if k.startswith(slim_checkpoint.ADAPTER_PREFIX)
            and len(entries[k][1]) == 2} == {torch.float8_e4m3fn}
    assert json.loads(meta["sdslim.adapters"])["embedded"] == "float8_e4m3fn"
    plain8, emb8 = (unet_tensors(tmp_path / n)[0] for n in ("f8.safetensors", "f8e.safetensors"))
    ref8, got8 = (unet_tensors(tmp_path / ("lora_" + n))[0] for n in ("f8.safetensors", "f8e.safetensors"))
    assert all(torch.equal(plain8[k].float(), emb8[k].float()) for k in plain8)
    assert lora_effect_cosine({k: v.float() for k, v in got8.items()}, {k: v.float() for k, v in ref8.items()},
                              {k: v.float() for k, v in plain8.items()}) > 0.99


def test_slim_space_refusals_write_nothing(files, tmp_path):
    d = files
    g = torch.Generator().manual_seed(0)
    module = "input_blocks.4.1.transformer_blocks.0.ff.net.0.proj"
    name = "lora_unet_" + layout.canonical_to_diffusers_key(CFG, module).replace(".", "_")
    dora = {f"{name}.lora_down.weight": torch.randn(2, 64, generator=g, dtype=torch.float64),
            f"{name}.lora_up.weight": torch.randn(512, 2, generator=g, dtype=torch.float64),
            f"{name}.dora_scale": torch.ones(512, 1, dtype=torch.float64)}
    save_file_atomic(dora, tmp_path / "dora.safetensors")
    with pytest.raises(lora_files.LoraError, match="DoRA.*fold it instead"):
        slim.slim_checkpoint(d / "slim.safetensors", None, tmp_path / "o.safetensors", [(tmp_path / "dora.safetensors", 1.0)])
    nan = {k: v.clone() for k, v in dora.items() if "dora" not in k}
    nan[f"{name}.lora_up.weight"][0, 0] = float("nan")
    save_file_atomic(nan, tmp_path / "nan.safetensors")
    with pytest.raises(lora_files.LoraError, match="NaN"):
        slim.slim_checkpoint(d / "slim.safetensors", None, tmp_path / "o.safetensors", [(tmp_path / "nan.safetensors", 1.0)])
    with pytest.raises(slim.SlimError, match="is the input"):
        slim.slim_checkpoint(d / "slim.safetensors", None, d / "slim.safetensors", [(d / "kohya.safetensors", 1.0)])
    # the adapter file given explicitly must be the one it was folded with
    lean = tmp_path / "lean.safetensors"
    result = slim.slim_checkpoint(d / "base.safetensors", d / "adapters.safetensors", lean)
    assert result.adapter_bytes == 0 and not [k for k in read_header(lean)[0] if k.startswith("sdslim.")]
    random_adapters(canonical_weights(seed=3), seed=5).save(tmp_path / "other.safetensors")
    with pytest.raises(slim.SlimError, match="sha256"):
        slim.slim_checkpoint(lean, tmp_path / "other.safetensors", tmp_path / "o.safetensors",
                             [(d / "kohya.safetensors", 1.0)])
    assert sorted(os.listdir(tmp_path)) == ["dora.safetensors", "lean.safetensors", "nan.safetensors",
                                            "other.safetensors"]
    slim.slim_checkpoint(lean, d / "adapters.safetensors", tmp_path / "o.safetensors", [(d / "kohya.safetensors", 0.3)])
    ref = folded_with(d, tmp_path, [("kohya.safetensors", 0.3)], "ref.safetensors")
    assert_same_unet(unet_tensors(tmp_path / "o.safetensors")[0], ref)


def test_a_lora_on_net2_moves_the_slim_bias_under_an_ff_intercept(files, tmp_path):
    """With ``up_bias`` c the slim net.2 bias is b_o + W_o·c, so a LoRA on net.2 (which has no bias part of its own)
    also changes the slim bias: applying it to the slim checkpoint equals folding it in."""
    d = files
    aset = random_adapters(canonical_weights(seed=3), seed=4)
    g = torch.Generator().manual_seed(8)
    for t in aset.sites.values():
        if "down_value" in t:
            t["up_bias"] = torch.randn(t["up"].shape[0], generator=g, dtype=torch.float64)
    aset.save(tmp_path / "with_c.safetensors")
    slim.slim_checkpoint(d / "base.safetensors", tmp_path / "with_c.safetensors", tmp_path / "slim_c.safetensors")
    lora_file = str(d / "kohya.safetensors")
    slim.slim_checkpoint(tmp_path / "slim_c.safetensors", None, tmp_path / "after.safetensors", [(lora_file, 0.7)])
    slim.slim_checkpoint(d / "base.safetensors", tmp_path / "with_c.safetensors", tmp_path / "before.safetensors",
                         [(lora_file, 0.7)])
    got, ref = unet_tensors(tmp_path / "after.safetensors")[0], unet_tensors(tmp_path / "before.safetensors")[0]
    assert_same_unet(got, ref)
    base = unet_tensors(tmp_path / "slim_c.safetensors")[0]
    moved = [k for k in ref if k.endswith("ff.net.2.bias") and not torch.equal(ref[k], base[k])]
    assert moved, "the kohya LoRA must reach a net.2 (else this proves nothing)"


def test_a_site_reader_refuses_an_adapter_file_that_changed(files, tmp_path):
    """Hosts keep a reader for as long as the slim model lives: a replaced file is not read as if it were the
    one folded, and the file is not held open meanwhile (it can be replaced)."""
    d = files
    path = tmp_path / "adapters.safetensors"
    path.write_bytes((d / "adapters.safetensors").read_bytes())
    aset, _ = slim._streamed_adapters(path, 1.0)
    read = slim_checkpoint.site_reader(path, aset)
    site = next(iter(aset.sites))
    first = read(site)
    random_adapters(canonical_weights(seed=3), seed=6).save(path)          # atomic replace, as the trainer does
    with pytest.raises(slim.SlimError, match="gone or changed"):
        read(site)
    os.remove(path)
    with pytest.raises(slim.SlimError, match="gone or changed"):
        read(site)
    assert all(torch.is_tensor(v) for v in first.values())


# ------------------------------------------------------------------------------------ `sdslim lora convert`

def test_lora_convert_writes_a_kohya_file_that_plain_merging_applies_exactly(files, tmp_path, capsys):
    d = files
    slim_w, _, meta = unet_tensors(d / "slim.safetensors")
    slim_shapes = {k: tuple(v.shape) for k, v in slim_w.items()}
    sites = json.loads(meta["sdslim.ranks"])            # every FF proj and every conv2 carries a LoHa (rank 2·2)
    for src, strength, forms in (("kohya.safetensors", 0.8, {"low-rank": 2, "unchanged": 2}),
                                 ("locon.safetensors", 1.0, {"low-rank": 3, "unchanged": 1}),
                                 ("loha.safetensors", 0.6, {"low-rank": len(sites), "dropped": 1})):
        out = tmp_path / f"{src}.slim.safetensors"
        rc, text, err = run(capsys, "lora", "convert", "--slim", d / "slim.safetensors", "--lora",
                            f"{d / src}:{strength}", "--out", out, "--json")
        assert rc == 0, err
        info = json.loads(text)
        assert {k: v for k, v in info["forms"].items() if v} == forms
        converted, cmeta = load_file(out)
        assert all(k.startswith(("lora_unet_", "lora_te_")) for k in converted)
        # plain kohya merge into the slim weights (what an unmodified host does) = fold(base + s·ΔW)
        merged, report = lora.merge_loras(slim_w, [(str(out), 1.0)], CFG)
        ref = folded_with(d, tmp_path, [(src, strength)], f"ref_{src}")
        assert_same_unet({**slim_w, **merged}, ref)
        assert not report.unknown
        # a shape-checking loader: every module's up/down (or diff) fits the slim layer it names
        index = lora_files.ModuleIndex(CFG, slim_shapes)
        for key, v in converted.items():
            if key.startswith("lora_te_") or key.endswith(".alpha"):
                continue
            name, suffix = key.split(".", 1)
            module = index.resolve_kohya(name[len("lora_unet_"):])
            shape = slim_shapes[f"{module}.{'bias' if suffix == 'diff_b' else 'weight'}"]
            if suffix == "lora_up.weight":
                assert v.shape[0] == shape[0] and v.ndim == len(shape)
            elif suffix == "lora_down.weight":
                assert v.shape[1:] == shape[1:] and v.ndim == len(shape)
                assert converted[f"{name}.lora_up.weight"].shape[1] == v.shape[0]
            elif suffix in ("diff", "diff_b"):
                assert tuple(v.shape) == shape
        assert json.loads(cmeta["sdslim.slim_lora"])["strength"] == strength
    te = load_file(tmp_path / "loha.safetensors.slim.safetensors")[0]
    assert torch.equal(te["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"], torch.ones(4, 2).double())


def test_lora_convert_rank_is_kept_and_errors_write_nothing(files, tmp_path, capsys):
    d = files
    out = tmp_path / "k.safetensors"
    rc, _, err = run(capsys, "lora", "convert", "--slim", d / "slim.safetensors", "--lora", d / "kohya.safetensors",
                     "--out", out, "--dtype", "fp16")
    assert rc == 0 and "low-rank at their own rank" in err
    src, conv = load_file(d / "kohya.safetensors")[0], load_file(out)[0]
    downs = {k: v for k, v in conv.items() if k.startswith("lora_unet_") and k.endswith("lora_down.weight")}
    assert downs and all(v.dtype == torch.float16 and v.shape[0] == 4 for v in downs.values())
    assert {k for k in conv if k.startswith("lora_unet_")} == {k for k in src if k.startswith("lora_unet_")}
    rc, _, err = run(capsys, "lora", "convert", "--slim", d / "base.safetensors", "--lora", d / "kohya.safetensors",
                     "--out", tmp_path / "x.safetensors")
    assert rc == 2 and "not a slim checkpoint" in err
    rc, _, err = run(capsys, "lora", "convert", "--slim", d / "slim.safetensors", "--lora", d / "kohya.safetensors",
                     "--out", d / "kohya.safetensors")
    assert rc == 2 and "is the input" in err
    assert sorted(os.listdir(tmp_path)) == ["k.safetensors"]


# ------------------------------------------------------------------------------ host loaders' key filters

def test_embedded_adapters_are_ignored_by_comfyui_and_a1111_checkpoint_loaders(files):
    """The key rules of the real loaders, reimplemented from their source (Comfy-Org/ComfyUI @ a125cd84, AUTOMATIC1111
    stable-diffusion-webui v1.10.1), applied to a real slim file: every UNet/VAE/text-encoder key lands where it did
    without adapters, and the adapter tensors land nowhere."""
    entries, meta = read_header(files / "slim_embedded.safetensors")
    keys = list(entries)
    adapter_keys = {k for k in keys if k.startswith(slim_checkpoint.ADAPTER_PREFIX)}
    plain = set(keys) - adapter_keys
    assert adapter_keys and meta[slim_checkpoint.ADAPTER_KEY] == slim_checkpoint.ADAPTER_PREFIX

    # comfy/model_detection.py unet_prefix_from_state_dict: the candidate with the most keys (> 5), else "model."
    candidates = ["model.diffusion_model.", "model.model.", "net."]
    counts = {c: sum(1 for k in keys if k.startswith(c)) for c in candidates}
    prefix = max(counts, key=counts.get) if max(counts.values()) > 5 else "model."
    assert prefix == "model.diffusion_model."

    # comfy/model_base.py BaseModel.load_model_weights: keys starting with the UNet prefix;
    # comfy/sd.py load_state_dict_guess_config → comfy/utils.py state_dict_prefix_replace(filter_keys=True) with
    # supported_models_base.BASE.vae_key_prefix ["first_stage_model."] and text_encoder_key_prefix
    # ["cond_stage_model."] (SD15.process_clip_state_dict: "cond_stage_model." → "clip_l."); the rest is "left over"
    def take(ks, pfx):
        return {k for k in ks if k.startswith(pfx)}
    unet, vae, clip = take(keys, prefix), take(keys, "first_stage_model."), take(keys, "cond_stage_model.")
    left_over = set(keys) - unet - vae - clip
    assert left_over == adapter_keys
    assert unet == take(plain, prefix) and not (unet | vae | clip) & adapter_keys
    # comfy/sd.py load_diffusion_model_state_dict (UNet loader): state_dict_prefix_replace({prefix: ""}, filter_keys)
    assert {k[len(prefix):] for k in take(keys, prefix)} == {k[len(prefix):] for k in plain if k.startswith(prefix)}

    # A1111 modules/sd_models.py get_state_dict_from_checkpoint: transform_checkpoint_dict_key with
    # checkpoint_dict_replacements_sd1 (cond_stage_model.transformer.{embeddings,encoder,final_layer_norm}. →
    # ….text_model.…), then model.load_state_dict(state_dict, strict=False): keys the LatentDiffusion model lacks are
    # ignored. The model's keys are those of the original checkpoint (same architecture, full shapes).
    replacements = {"cond_stage_model.transformer.embeddings.": "cond_stage_model.transformer.text_model.embeddings.",
                    "cond_stage_model.transformer.encoder.": "cond_stage_model.transformer.text_model.encoder.",
                    "cond_stage_model.transformer.final_layer_norm.":
                        "cond_stage_model.transformer.text_model.final_layer_norm."}

    def transform(k):
        for text, replacement in replacements.items():
            if k.startswith(text):
                k = replacement + k[len(text):]
        return k
    model_keys = {transform(k) for k in read_header(files / "base.safetensors")[0]}
    loaded = {transform(k) for k in keys} & model_keys
    assert loaded == {transform(k) for k in plain} and not {transform(k) for k in adapter_keys} & model_keys
    # A1111 sd_models_config.guess_model_config_from_state_dict reads fixed keys, none in the adapter namespace
    assert "model.diffusion_model.input_blocks.0.0.weight" in plain

    # and sdslim's own readers see a normal slim checkpoint
    from sdslim_core.modules.unet import open_checkpoint
    ckpt = open_checkpoint(files / "slim_embedded.safetensors")
    assert set(ckpt.weights.file_keys.values()) == take(plain, PREFIX)
    assert set(ckpt.other_keys()) == (plain - take(plain, PREFIX)) | adapter_keys
    assert set(EXTRA) <= set(ckpt.other_keys())
    loaded_unet, cfg, _ = unet_mod.load_slim_unet(files / "slim_embedded.safetensors")
    assert cfg == CFG and sum(p.numel() for p in loaded_unet.parameters()) == sum(
        math.prod(shape) for k, (_, shape) in entries.items() if k.startswith(PREFIX))


def test_diffusers_named_slim_checkpoint_takes_loras_too(files, tmp_path):
    """A slim file with diffusers keys (from a diffusers folder) and float32 weights: LoRAs in slim space agree with
    folding them in, up to float32 rounding."""
    w = {k: v.float() for k, v in canonical_weights(seed=3).items()}
    folder = tmp_path / "model" / "unet"
    folder.mkdir(parents=True)
    save_file_atomic({layout.canonical_to_diffusers_key(CFG, k): v for k, v in w.items()},
                     folder / "diffusion_pytorch_model.safetensors", {"sdslim.unet_config": json.dumps(CFG.to_dict())})
    ad, lo = files / "adapters.safetensors", files / "locon.safetensors"
    slim.slim_checkpoint(tmp_path / "model", ad, tmp_path / "slim.safetensors")
    slim.slim_checkpoint(tmp_path / "slim.safetensors", None, tmp_path / "after.safetensors", [(lo, 0.7)])
    slim.slim_checkpoint(tmp_path / "model", ad, tmp_path / "ref.safetensors", [(lo, 0.7)])
    got, ref, before = (load_file(tmp_path / f"{n}.safetensors")[0] for n in ("after", "ref", "slim"))
    assert got.keys() == ref.keys() and "down_blocks.0.resnets.0.conv1.weight" in got
    changed = [k for k in ref if not torch.equal(ref[k], before[k])]
    assert changed and all(rel(got[k].double(), ref[k].double()) < 1e-5 for k in ref if ref[k].norm() > 0)
