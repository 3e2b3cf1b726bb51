"""End to end: `sdslim slim` and `sdslim eval` on a generated SD1.5-layout checkpoint with a kohya LoRA and a LoCon."""
import json
import os

import pytest
import torch

from sdslim_core import cli
from sdslim_core.io.tensors import load_file, save_file_atomic
from test_slim_roundtrip import EXTRA, canonical_weights, make_loras, random_adapters, write_ldm_checkpoint



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    w = canonical_weights(seed=4, dtype=torch.float32)
    write_ldm_checkpoint(d / "sd15.safetensors", w)
    random_adapters(w).save(d / "adapters.safetensors", dtype=torch.float32)
    kohya, locon, _ = make_loras(w)
    save_file_atomic({k: v.float() for k, v in kohya.items()}, d / "kohya.safetensors")
    save_file_atomic({k: v.float() for k, v in locon.items()}, d / "locon.safetensors")
    return d


def run(capsys, *args):
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_slim_then_eval(files, capsys):
    d = files
    common = ["--ckpt", d / "sd15.safetensors", "--adapters", d / "adapters.safetensors",
              "--lora", f"{d / 'kohya.safetensors'}:0.8", "--lora", f"{d / 'locon.safetensors'}:0.5"]
    rc, out, _ = run(capsys, "slim", *common, "--out", d / "slim.safetensors", "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["ratio"] < 0.9 and info["family"] == "sd15"
    assert len(info["merge"]["merged"]) == 8 and not info["merge"]["unknown"]
    tensors, meta = load_file(d / "slim.safetensors")
    for k, v in EXTRA.items():
        assert torch.equal(tensors[k], v)
    assert meta["sdslim.slim"] == "1"

    rc, out, _ = run(capsys, "eval", *common, "--seeds", "1", "--steps", "4", "--latent-size", "16", "--no-png",
                     "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["conditioning"].startswith("unconditional") and r["image"] is None
    assert "VAE" in r["image_note"]
    assert 0 < r["eps_rel_error"]["mean"] < 10 and isinstance(r["latent_psnr_db"]["mean"], float)
    assert -1 <= r["lora_effect_cosine"]["mean"] <= 1
    assert r["merge"]["ignored_text_encoder"] and not r["warnings"]

    # human output goes to stderr, nothing to stdout
    rc, out, err = run(capsys, "eval", *common, "--seeds", "1", "--steps", "2", "--latent-size", "8", "--no-png")
    assert rc == 0 and out == "" and "LoRA effect cosine" in err and "unconditional" in err


def test_eval_with_embeddings_file(files, capsys):
    d = files
    g = torch.Generator().manual_seed(0)
    save_file_atomic({"context": torch.randn(5, 64, generator=g), "uncond": torch.zeros(5, 64)},
                     d / "emb.safetensors")
    rc, out, _ = run(capsys, "eval", "--ckpt", d / "sd15.safetensors", "--adapters", d / "adapters.safetensors",
                     "--embeddings", d / "emb.safetensors", "--seeds", "1", "--steps", "2", "--latent-size", "8",
                     "--no-png", "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["conditioning"].startswith("embeddings from") and r["sampler"]["guidance"] == 7.5


def test_cli_errors_exit_2_and_write_nothing(files, capsys, tmp_path):
    d = files
    before = sorted(os.listdir(d))
    rc, out, err = run(capsys, "slim", "--ckpt", d / "sd15.safetensors", "--adapters", d / "adapters.safetensors",
                       "--out", d / "sd15.safetensors")
    assert rc == 2 and "is the input" in err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    rc, out, err = run(capsys, "slim", "--ckpt", d / "sd15.safetensors", "--adapters", d / "adapters.safetensors",
                       "--lora", bad, "--out", tmp_path / "o.safetensors")
    assert rc == 2 and str(bad) in err
    rc, out, err = run(capsys, "eval", "--ckpt", d / "sd15.safetensors", "--adapters", d / "adapters.safetensors",
                       "--prompt", "a cat")
    assert rc == 2 and str(d / "sd15.safetensors") in err and "text encoder is incomplete" in err   # a stray key only
    assert sorted(os.listdir(d)) == before and sorted(os.listdir(tmp_path)) == ["bad.safetensors"]


def test_eval_sdxl_structure_identity_is_exact(tmp_path, capsys):
    """SDXL needs pooled-text and size conditioning; identity adapters still give exactly the teacher."""
    from conftest import randomize_, tiny_config
    from sdslim_core import layout
    from sdslim_core.io import adapters
    from sdslim_core.layout import rank_policy
    from sdslim_core.modules.unet import build_diffusers_unet
    cfg = tiny_config("sdxl")
    unet = randomize_(build_diffusers_unet(cfg), seed=3)
    w = layout.to_canonical(unet.state_dict())[0]
    save_file_atomic({"model.diffusion_model." + k: v for k, v in w.items()}, tmp_path / "xl.safetensors",
                     {"sdslim.unet_config": json.dumps(cfg.to_dict())})
    adapters.AdapterSet.init_select(w, rank_policy.ranks_for_ratio(layout.sites(w), 1.0), "sdxl").save(
        tmp_path / "id.safetensors")
    rc, out, _ = run(capsys, "eval", "--ckpt", tmp_path / "xl.safetensors", "--adapters", tmp_path / "id.safetensors",
                     "--seeds", "1", "--steps", "2", "--latent-size", "8", "--no-png", "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["family"] == "sdxl" and r["eps_rel_error"]["max"] == 0 and r["latent_psnr_db"]["mean"] == "inf"


def test_breakdown_of_a_slim_file(files, capsys):
    """A slim checkpoint opens like any other (config from shapes) and counts as slim."""
    d = files
    if not (d / "slim.safetensors").exists():
        run(capsys, "slim", "--ckpt", d / "sd15.safetensors", "--adapters", d / "adapters.safetensors",
            "--out", d / "slim.safetensors")
    rc, out, _ = run(capsys, "breakdown", "--ckpt", d / "slim.safetensors", "--json")
    assert rc == 0
    slim_total = json.loads(out)["total"]
    rc, out, _ = run(capsys, "breakdown", "--ckpt", d / "sd15.safetensors", "--json")
    tensors, _ = load_file(d / "slim.safetensors")
    assert slim_total == sum(v.numel() for k, v in tensors.items() if k.startswith("model.diffusion_model."))
    assert slim_total < json.loads(out)["total"]


def test_weight_dtype_fp8_stores_the_float32_fold_rounded_once(files, capsys, tmp_path):
    """`--weight-dtype fp8_e4m3fn` (slim stacked with fp8 storage): every UNet weight of 2+ dimensions is the
    float32 slim weight rounded once to fp8; biases, norms and non-UNet tensors keep their dtypes; LoRAs can still
    be applied to the fp8 slim checkpoint, which stays fp8."""
    d = files
    common = ["--ckpt", d / "sd15.safetensors", "--adapters", d / "adapters.safetensors",
              "--lora", f"{d / 'kohya.safetensors'}:0.8"]
    assert run(capsys, "slim", *common, "--out", tmp_path / "slim32.safetensors")[0] == 0
    assert run(capsys, "slim", *common, "--out", tmp_path / "slim8.safetensors", "--weight-dtype", "fp8_e4m3fn")[0] == 0
    ref, _ = load_file(tmp_path / "slim32.safetensors")
    got, meta = load_file(tmp_path / "slim8.safetensors")
    assert set(got) == set(ref) and meta["sdslim.slim"] == "1"
    n_fp8 = 0
    for k, v in got.items():
        unet_weight = k.startswith("model.diffusion_model.") and ref[k].dim() >= 2
        if unet_weight:
            n_fp8 += 1
            assert v.dtype == torch.float8_e4m3fn, k
            assert torch.equal(v.float(), ref[k].to(torch.float8_e4m3fn).float()), k
        else:
            assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k
    assert n_fp8 > 50
    rc, _, _ = run(capsys, "slim", "--ckpt", tmp_path / "slim8.safetensors", "--lora",
                   f"{d / 'locon.safetensors'}:0.5", "--out", tmp_path / "slim8_lora.safetensors")
    assert rc == 0
    after, _ = load_file(tmp_path / "slim8_lora.safetensors")
    assert all(after[k].dtype == got[k].dtype for k in got)
    assert any(not torch.equal(after[k].float(), got[k].float()) for k in got)
    rc, _, err = run(capsys, "slim", "--ckpt", tmp_path / "slim8.safetensors", "--weight-dtype", "fp16",
                     "--out", tmp_path / "again.safetensors")
    assert rc == 2 and "already a slim checkpoint" in err and not (tmp_path / "again.safetensors").exists()


def test_weight_dtype_fp8_of_an_fp16_checkpoint_is_rounded_once_from_the_float32_fold(tmp_path, capsys):
    """The fold of fp16 weights is not rounded to fp16 on its way to fp8 (a double rounding)."""
    from sdslim_core import layout, tiny
    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.io.tensors import LazyStateDict
    from sdslim_core.ops import fold
    half = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
    lazy = LazyStateDict(tiny.DEFAULT_PATH)
    weights = {k: v.float() for k, v in layout.to_canonical({k: lazy[k] for k in lazy})[0].items()
               if k.split(".", 1)[0] in layout.UNET_TOP_MODULES}
    assert {lazy[k].dtype for k in lazy} == {torch.float16}
    folded = fold.fold_state_dict(weights, AdapterSet.load(half))
    assert run(capsys, "slim", "--ckpt", tiny.DEFAULT_PATH, "--adapters", half, "--weight-dtype", "fp8_e4m3fn",
               "--out", tmp_path / "s8.safetensors")[0] == 0
    got = LazyStateDict(tmp_path / "s8.safetensors")
    for k, v in folded.items():
        if v.dim() >= 2:
            assert torch.equal(got["model.diffusion_model." + k].float(), v.to(torch.float8_e4m3fn).float()), k
