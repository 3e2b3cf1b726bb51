"""`slim_checkpoint`: LoRA merge then exact fold, streamed to a file; loaders; refusals that write nothing."""
import hashlib
import json
import math
import os
import types

import pytest
import torch

from conftest import ldm_unet, randomize_, tiny_config
from sdslim_core import layout
from sdslim_core.apps import slim
from sdslim_core.io import adapters, slim_checkpoint
from sdslim_core.io.tensors import load_file, read_header, save_file_atomic
from sdslim_core.layout import rank_policy
from sdslim_core.modules import swap, unet as unet_mod
from sdslim_core.ops import fold

CFG = tiny_config()
PREFIX = "model.diffusion_model."
EXTRA = {"first_stage_model.decoder.conv_out.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
         "cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.linspace(0, 1, 5).half()}


# ------------------------------------------------------------------------------------------------ helpers

def canonical_weights(seed=0, dtype=torch.float64):
    from sdslim_core.modules.unet import build_diffusers_unet
    torch.manual_seed(seed)
    unet = randomize_(build_diffusers_unet(CFG, dtype=torch.float64), seed=seed)
    return {k: v.detach().to(dtype).clone() for k, v in layout.to_canonical(unet.state_dict())[0].items()}


def write_ldm_checkpoint(path, weights):
    """A single-file SD1.5-layout checkpoint: LDM UNet keys + fake VAE/text-encoder tensors to copy through."""
    meta = {"note": "tiny test model", "sdslim.unet_config": json.dumps(CFG.to_dict())}   # heads: not in shapes
    save_file_atomic({**{PREFIX + k: v for k, v in weights.items()}, **EXTRA}, path, meta)
    return path


def random_adapters(weights, ratio=0.5, seed=1):
    """Data-free init, then perturbed so nothing is a plain selection (as in test_fold)."""
    ranks = rank_policy.ranks_for_ratio(layout.sites(weights), ratio)
    aset = adapters.AdapterSet.init_select(weights, ranks, "sd15")
    g = torch.Generator().manual_seed(seed)
    for t in aset.sites.values():
        for k, v in t.items():
            t[k] = (v + 0.3 * torch.randn(v.shape, generator=g)).double()
    return aset


# LoRA targets: attention/FF linears (diffusers-derived kohya names, the SD1.x convention) and the LoCon
# targets inside folded Res sites (LDM-derived names, the SDXL convention), 3×3 down / 1×1 up.
KOHYA_TARGETS = ["input_blocks.1.1.transformer_blocks.0.attn1.to_q", "middle_block.1.transformer_blocks.0.attn2.to_v",
                 "input_blocks.4.1.transformer_blocks.0.ff.net.0.proj",
                 "output_blocks.3.1.transformer_blocks.0.ff.net.2"]
LOCON_TARGETS = ["input_blocks.1.0.in_layers.2", "output_blocks.2.0.out_layers.3", "middle_block.0.emb_layers.1",
                 "input_blocks.4.0.skip_connection"]


def make_loras(weights, seed=5):
    """(kohya LoRA, LoCon) state dicts and a float64 reference merge function."""
    g = torch.Generator().manual_seed(seed)
    kohya, locon, parts = {}, {}, []
    for module in KOHYA_TARGETS + LOCON_TARGETS:
        W = weights[module + ".weight"]
        is_locon = module in LOCON_TARGETS
        path = module if is_locon else layout.canonical_to_diffusers_key(CFG, module)
        name = "lora_unet_" + path.replace(".", "_")
        r, alpha = 4, 2.0
        down = torch.randn(r, *W.shape[1:], generator=g, dtype=torch.float64) * 0.3
        up = torch.randn(W.shape[0], r, *([1] * (W.ndim - 2)), generator=g, dtype=torch.float64) * 0.3
        target = locon if is_locon else kohya
        target.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                       f"{name}.alpha": torch.tensor(alpha)})
        parts.append((module, is_locon, (alpha / r) * (up.reshape(W.shape[0], r) @ down.reshape(r, -1)).reshape(W.shape)))
    kohya["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = torch.zeros(2, 4)

    def reference(w, s_kohya, s_locon):
        out = dict(w)
        for module, is_locon, delta in parts:
            out[module + ".weight"] = out[module + ".weight"] + (s_locon if is_locon else s_kohya) * delta
        return out
    return kohya, locon, reference


def inputs(seed=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, 16, 16, generator=g, dtype=dtype), torch.tensor([10, 700]),
            torch.randn(2, 5, CFG.context_dim, generator=g, dtype=dtype))


def run_diffusers(unet, x, t, ctx):
    with torch.no_grad():
        return unet(x, t, encoder_hidden_states=ctx).sample


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("slim")
    w = canonical_weights()
    ckpt = write_ldm_checkpoint(d / "base.safetensors", w)
    aset = random_adapters(w)
    aset.save(d / "adapters.safetensors")
    kohya, locon, reference = make_loras(w)
    save_file_atomic(kohya, d / "kohya.safetensors", {"ss_base_model_version": "sd_v1"})
    save_file_atomic(locon, d / "locon.safetensors")
    out = d / "slim.safetensors"
    result = slim.slim_checkpoint(ckpt, d / "adapters.safetensors", out,
                                  [(str(d / "kohya.safetensors"), 0.8), (str(d / "locon.safetensors"), 0.5)])
    return dict(dir=d, w=w, ckpt=ckpt, aset=aset, out=out, result=result, merged=reference(w, 0.8, 0.5))


# --------------------------------------------------------------------------------------------------- tests

def test_slim_of_base_plus_lora_equals_train_time_adapters_on_base_plus_lora(setup):
    from sdslim_core.modules.unet import load_diffusers_unet
    teacher_lora = load_diffusers_unet(setup["merged"], CFG, dtype=torch.float64)
    train, _ = swap.attach_train_adapters(teacher_lora, setup["aset"])
    loaded, cfg, meta = unet_mod.load_slim_unet(setup["out"])
    assert cfg == CFG and next(loaded.parameters()).dtype == torch.float64
    x, t, ctx = inputs()
    ref, out = run_diffusers(train, x, t, ctx), run_diffusers(loaded, x, t, ctx)
    assert rel(out, ref) < 1e-10
    plain = run_diffusers(load_diffusers_unet(setup["w"], CFG, dtype=torch.float64), x, t, ctx)
    assert rel(ref, plain) > 1e-3                       # LoRA and adapters really changed the model
    assert meta["sdslim.slim"] == 1 and meta["sdslim.family"] == "sd15"
    assert meta["sdslim.loras"] == [{"file": "kohya.safetensors", "strength": 0.8, "applied": "before folding"},
                                    {"file": "locon.safetensors", "strength": 0.5, "applied": "before folding"}]


def test_loader_matches_build_slim_module_exactly(setup):
    from sdslim_core.modules.unet import load_diffusers_unet
    merged = setup["merged"]
    teacher_lora = load_diffusers_unet(merged, CFG, dtype=torch.float64)
    built = swap.slim_module(teacher_lora, setup["aset"], merged)
    loaded, _, _ = unet_mod.load_slim_unet(setup["out"])
    x, t, ctx = inputs(seed=4)
    a, b = run_diffusers(built, x, t, ctx), run_diffusers(loaded, x, t, ctx)
    assert rel(a, b) < 1e-13
    built_sd = swap.slim_state_dict(built)
    loaded_sd = swap.slim_state_dict(loaded)
    assert built_sd.keys() == loaded_sd.keys()
    assert max(rel(loaded_sd[k], built_sd[k]) for k in built_sd if built_sd[k].norm() > 0) < 1e-13


def test_file_layout_keys_dtypes_metadata_and_passthrough(setup):
    entries, meta = read_header(setup["out"])
    src, _ = read_header(setup["ckpt"])
    assert set(entries) == set(src)                                    # same key names, no adapter tensors
    assert all(entries[k][0] == src[k][0] for k in src)                # same dtypes
    origin = json.loads(meta["sdslim.adapters"])
    assert slim_checkpoint.ADAPTER_KEY not in meta and origin["embedded"] is None
    assert origin["file"] == "adapters.safetensors" and \
        origin["sha256"] == hashlib.sha256((setup["dir"] / "adapters.safetensors").read_bytes()).hexdigest()
    r = setup["result"]
    assert r.file.total == os.path.getsize(setup["out"]) == sum(r.file.parts.values())     # sizes from disk
    assert r.adapter_bytes == 0 and r.source.total == os.path.getsize(setup["ckpt"])
    unet_bytes = sum(math.prod(s) * d.itemsize for k, (d, s) in entries.items() if k.startswith(PREFIX))
    assert r.file.parts["unet"] == unet_bytes and r.file.parts["vae"] == EXTRA[
        "first_stage_model.decoder.conv_out.weight"].nbytes
    assert r.embed_bytes == sum(v.numel() * 2 for v in setup["aset"].state_dict().values())     # as fp16
    tensors, _ = load_file(setup["out"])
    for k, v in EXTRA.items():                                         # copied through unchanged
        assert torch.equal(tensors[k], v) and tensors[k].dtype == v.dtype
    ranks = setup["aset"].ranks()
    site = "input_blocks.1.1.transformer_blocks.0.ff"
    assert entries[PREFIX + site + ".net.0.proj.weight"][1] == (2 * ranks[site], 32)
    assert meta["note"] == "tiny test model" and meta["sdslim.slim"] == "1"
    assert json.loads(meta["sdslim.norm_groups"]).keys() == {s for s in ranks if "ff" not in s}
    assert r.unet_params_after < r.unet_params_before and r.sites == len(ranks)
    assert r.merge.ignored_text_encoder == ["%s:lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"
                                            % (setup["dir"] / "kohya.safetensors")]


def test_apply_slim_state_dict_on_ldm_unet(setup):
    base = ldm_unet(CFG)
    base.load_state_dict(setup["merged"])
    train, _ = swap.attach_train_adapters(base, setup["aset"])
    target = ldm_unet(CFG)
    meta = unet_mod.apply_slim_state_dict(target, setup["out"])
    assert meta["sdslim.slim"] == 1
    for m in target.modules():          # as conftest.ldm_unet does: keep float64 in GroupNorm32 (new norms too)
        if isinstance(m, torch.nn.GroupNorm):
            m.forward = types.MethodType(torch.nn.GroupNorm.forward, m)
    x, t, ctx = inputs(seed=6)
    with torch.no_grad():
        assert rel(target(x, t, ctx), train(x, t, ctx)) < 1e-10
    assert sum(p.numel() for p in target.parameters()) < sum(p.numel() for p in base.parameters())
    norm = target.input_blocks[1][0].out_layers[0]
    assert type(norm) is type(base.input_blocks[1][0].out_layers[0])  # class kept (GroupNorm32)
    assert norm.num_groups == setup["aset"].groups("input_blocks.1.0")


def _no_output(d, name):
    return not (d / name).exists() and not [p for p in os.listdir(d) if p.startswith(f".{name}.")]


def test_refusals_write_nothing(setup, tmp_path):
    d = setup["dir"]
    ad = d / "adapters.safetensors"
    with pytest.raises(slim.SlimError, match="is the input"):
        slim.slim_checkpoint(setup["ckpt"], ad, setup["ckpt"])
    with pytest.raises(slim.SlimError, match="already a slim"):
        slim.slim_checkpoint(setup["out"], None, tmp_path / "again.safetensors")       # slim, but no LoRA to apply
    with pytest.raises(slim.SlimError, match="--select"):
        slim.slim_checkpoint(setup["out"], None, tmp_path / "again.safetensors", select=0.5)
    with pytest.raises(slim.SlimError, match=".safetensors"):
        slim.slim_checkpoint(setup["ckpt"], ad, tmp_path / "x.ckpt")
    bad = tmp_path / "bad.safetensors"
    sd = {"lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight": torch.full((2, 32, 3, 3), float("nan")),
          "lora_unet_input_blocks_1_0_in_layers_2.lora_up.weight": torch.zeros(32, 2, 1, 1)}
    save_file_atomic(sd, bad)
    with pytest.raises(ValueError, match="NaN"):
        slim.slim_checkpoint(setup["ckpt"], ad, tmp_path / "out.safetensors", [(str(bad), 1.0)])
    torch.save({}, tmp_path / "l.pt")
    with pytest.raises(ValueError, match="pickle"):
        slim.slim_checkpoint(setup["ckpt"], ad, tmp_path / "out.safetensors", [(str(tmp_path / "l.pt"), 1.0)])
    assert _no_output(tmp_path, "out.safetensors") and _no_output(tmp_path, "again.safetensors")
    assert _no_output(tmp_path, "x.ckpt")


def test_error_while_streaming_leaves_no_file(setup, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(slim.fold, "fold_site", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        slim.slim_checkpoint(setup["ckpt"], setup["dir"] / "adapters.safetensors", tmp_path / "o.safetensors")
    assert os.listdir(tmp_path) == []


def test_diffusers_folder_fp16_and_norm2_warning(tmp_path):
    w = canonical_weights(seed=2, dtype=torch.float16)
    folder = tmp_path / "model" / "unet"
    folder.mkdir(parents=True)
    save_file_atomic({layout.canonical_to_diffusers_key(CFG, k): v for k, v in w.items()},
                     folder / "diffusion_pytorch_model.safetensors", {"sdslim.unet_config": json.dumps(CFG.to_dict())})
    w32 = {k: v.float() for k, v in w.items()}
    aset = adapters.AdapterSet.init_select(w32, rank_policy.ranks_for_ratio(layout.sites(w32), 0.5), "sd15")
    lora_sd = {"lora_unet_down_blocks_0_resnets_0_norm2.w_norm": torch.full((32,), 0.1),
               "lora_unet_down_blocks_0_resnets_0_norm2.b_norm": torch.full((32,), 0.1)}
    save_file_atomic(lora_sd, tmp_path / "norm.safetensors")
    result = slim.slim_checkpoint(tmp_path / "model", aset, tmp_path / "slim.safetensors",
                                  [(str(tmp_path / "norm.safetensors"), 1.0)])
    assert any("norm2" in x and "lora_unet_down_blocks_0_resnets_0_norm2" in x for x in result.warnings)
    entries, _ = read_header(tmp_path / "slim.safetensors")
    assert "down_blocks.0.resnets.0.conv1.weight" in entries              # diffusers names kept
    assert {d for k, (d, _) in entries.items() if not k.startswith(slim_checkpoint.ADAPTER_PREFIX)} == {torch.float16}
    unet, cfg, _ = unet_mod.load_slim_unet(tmp_path / "slim.safetensors", dtype=torch.float32)
    ref = swap.build_slim_module(__import__("sdslim_core.modules.unet", fromlist=["x"]).load_diffusers_unet(w32, CFG), aset,
                                 {k: v.half().float() for k, v in fold.fold_state_dict(w32, aset).items()})
    x, t, ctx = inputs(seed=7, dtype=torch.float32)
    assert rel(run_diffusers(unet, x, t, ctx), run_diffusers(ref, x, t, ctx)) < 1e-5
