"""The node pack inside a real ComfyUI (opt-in: set COMFYUI_PATH to a ComfyUI checkout and run with its Python).

    COMFYUI_PATH=/path/to/ComfyUI /path/to/comfy-venv/bin/python -m pytest tests/integration -q

A tiny model with the SD1.5 block structure is built with ComfyUI's own ``supported_models.SD15`` classes; LoRAs go
through ComfyUI's loader, ControlNet through its controlnet loader, sampling through ``common_ksampler``.
References are computed here in float64 from the raw weights (not with sdslim_core.ops.fold).
Set COMFYUI_HTTP=1 as well to start the server once and queue a workflow over HTTP (about a minute).
"""
import importlib
import importlib.util
import json
import logging
import os
import sys

import pytest
import torch

COMFY = os.environ.get("COMFYUI_PATH")
pytestmark = pytest.mark.skipif(not COMFY, reason="set COMFYUI_PATH to run against a real ComfyUI")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FF = "input_blocks.1.1.transformer_blocks.0.ff"
RES = "input_blocks.1.0"
ATTN = "input_blocks.1.1.transformer_blocks.0.attn2.to_q"
sys.path.insert(0, os.path.join(ROOT, "tests", "comfy_standin"))
from reference import fold64  # noqa: E402  (float64 formulas; the stand-in's comfy is never imported here)
sys.path.pop(0)

TINY_SD15 = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
             "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 32,
             "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
             "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1, "use_linear_in_transformer": False,
             "context_dim": 32, "num_heads": 8, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
             "use_temporal_attention": False, "use_temporal_resblock": False}


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI imported on CPU, with the pack loaded the way ComfyUI loads custom nodes."""
    sys.path.insert(0, COMFY)
    sys.modules.pop("nodes", None)       # the repo's nodes/ package must not shadow ComfyUI's nodes.py
    from comfy.cli_args import args
    args.cpu = True
    import comfy.controlnet
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    import folder_paths
    import nodes
    assert nodes.__file__.startswith(os.path.realpath(COMFY)) or nodes.__file__.startswith(COMFY)
    spec = importlib.util.spec_from_file_location("sdslim_pack", os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["sdslim_pack"] = pack
    spec.loader.exec_module(pack)
    return {"pack": pack, "nodes": nodes, "folder_paths": folder_paths, "mm": comfy.model_management,
            "sd": comfy.sd, "controlnet": comfy.controlnet, "model_patcher": comfy.model_patcher,
            "supported_models": comfy.supported_models}


def _random_state(module_sd, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in module_sd.items():
        if v.ndim == 1:
            is_scale = k.endswith("weight") and any(n in k for n in ("norm", "in_layers.0", "out_layers.0", "out.0"))
            out[k] = (1.0 if is_scale else 0.0) + 0.1 * torch.randn(v.shape, generator=g)
        else:
            out[k] = torch.randn(v.shape, generator=g) / v[0].numel() ** 0.5
    return out


@pytest.fixture(scope="module")
def tiny(comfy):
    """(ModelPatcher of a tiny SD1.5-structure model, its UNet weights)."""
    mc = comfy["supported_models"].SD15(dict(TINY_SD15))
    mc.set_inference_dtype(torch.float32, None)
    base = mc.get_model({}, "", device="cpu")
    weights = _random_state(base.diffusion_model.state_dict(), 0)
    base.diffusion_model.load_state_dict(weights)
    patcher = comfy["model_patcher"].ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))
    return patcher, weights


@pytest.fixture(scope="module")
def adapter_dir(comfy, tiny, tmp_path_factory):
    """models/sdslim in a temp dir holding half-width and full-width adapter files for the tiny model."""
    from sdslim_core import layout
    from sdslim_core.io import adapters
    from sdslim_core.layout import rank_policy
    folder = tmp_path_factory.mktemp("sdslim_models")
    comfy["folder_paths"].add_model_folder_path("sdslim", str(folder), is_default=True)   # trained files land here
    _, weights = tiny
    for name, ratio in (("half.safetensors", 0.5), ("full.safetensors", 1.0)):
        ranks = rank_policy.ranks_for_ratio(layout.sites(weights), ratio)
        aset = adapters.AdapterSet.init_select(weights, ranks, "sd15")
        g = torch.Generator().manual_seed(1)
        if ratio < 1:   # non-trivial adapters: random mixing, not a selection
            for t in aset.sites.values():
                for n in t:
                    t[n] = t[n] + 0.05 * torch.randn(t[n].shape, generator=g)
            aset.metadata["sdslim.train"] = {"site_error": {s: i / 10 for i, s in enumerate(reversed(list(aset.sites)))}}
        aset.save(folder / name)
    return folder


def _kohya_lora(weights, keys, seed, rank=4, alpha=2.0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key in keys:
        w = weights[key + ".weight"]
        name = "lora_unet_" + key.replace(".", "_")
        if w.ndim == 4:
            up, down = torch.randn(w.shape[0], rank, 1, 1, generator=g), torch.randn(rank, *w.shape[1:], generator=g)
        else:
            up, down = torch.randn(w.shape[0], rank, generator=g), torch.randn(rank, w.shape[1], generator=g)
        sd[name + ".lora_up.weight"], sd[name + ".lora_down.weight"] = up * 0.1, down * 0.1
        sd[name + ".alpha"] = torch.tensor(alpha)
    return sd


def _lora_delta64(lora, key, shape, strength):
    name = "lora_unet_" + key.replace(".", "_")
    up, down = lora[name + ".lora_up.weight"].double(), lora[name + ".lora_down.weight"].double()
    scale = strength * float(lora[name + ".alpha"]) / down.shape[0]
    return scale * (up.flatten(1) @ down.flatten(1)).reshape(shape)


def _snapshot(patcher):
    return ({k: v.clone() for k, v in patcher.model.state_dict().items()},
            {k: list(v) for k, v in patcher.patches.items()}, patcher.patches_uuid, patcher.model_size())


def _assert_unchanged(patcher, snap):
    sd, patches, uuid_, size = snap
    now = patcher.model.state_dict()
    assert now.keys() == sd.keys()
    for k in sd:
        assert now[k].shape == sd[k].shape and torch.equal(now[k], sd[k]), k
    assert {k: list(v) for k, v in patcher.patches.items()} == patches
    assert patcher.patches_uuid == uuid_ and patcher.model_size() == size


def _node(comfy, node_id):
    return {c.define_schema().node_id: c for c in _v3_classes(comfy)}[node_id]


def _save_gguf(comfy, model, **kw) -> bool:
    """Save Slim GGUF; True when it wrote. Without the gguf package (the documented ComfyUI install without
    ComfyUI-GGUF, which brings it) the node refuses in one sentence naming what to install, and writes nothing."""
    node = _node(comfy, "SdslimSaveSlimGGUF")
    if importlib.util.find_spec("gguf") is not None:
        node.execute(model=model, **kw)
        return True
    with pytest.raises(Exception, match=r"^sdslim: GGUF files .* needs gguf, .*pip install gguf"):
        node.execute(model=model, **kw)
    return False


def _v3_classes(comfy):
    import asyncio
    ext = asyncio.run(comfy["pack"].comfy_entrypoint())
    return asyncio.run(ext.get_node_list())


def _forward(patcher, x, t, ctx, control=None):
    with torch.no_grad():
        return patcher.model.diffusion_model(x, t, context=ctx, control=control)


def _inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, 16, 16, generator=g), torch.tensor([420.0]), torch.randn(1, 5, 32, generator=g)


# --------------------------------------------------------------------------------------------------- tests

def test_registration_v3_v1_and_folder(comfy, adapter_dir):
    classes = _v3_classes(comfy)
    ids = {c.define_schema().node_id for c in classes}
    assert ids == {"SdslimSlimUNet", "SdslimLoadSlimCheckpoint", "SdslimLoadSlimGGUF", "SdslimSaveSlimCheckpoint",
                   "SdslimSaveSlimGGUF", "SdslimTrainAdapters", "SdslimVramReport", "SdslimVramMonitor",
                   "SdslimUNetBreakdown", "SdslimTinyDemo"}
    slim_schema = _node(comfy, "SdslimSlimUNet").GET_SCHEMA() if hasattr(classes[0], "GET_SCHEMA") else None
    assert slim_schema is None or slim_schema.node_id == "SdslimSlimUNet"
    v1, names = comfy["pack"].nodes.entry.v1_mappings()
    info = v1["SdslimSlimUNet"].INPUT_TYPES()
    assert {"half.safetensors", "full.safetensors"} <= set(info["required"]["adapters"][0])
    assert v1["SdslimVramReport"].IS_CHANGED() != v1["SdslimVramReport"].IS_CHANGED()   # NaN: always re-runs
    fp = comfy["folder_paths"]
    paths, exts = fp.folder_names_and_paths["sdslim"]
    assert os.path.join(fp.models_dir, "sdslim") in paths and str(adapter_dir) in paths and ".safetensors" in exts


def test_slim_matches_float64_reference_and_keeps_original(comfy, tiny, adapter_dir):
    patcher, weights = tiny
    lora = _kohya_lora(weights, [f"{FF}.net.0.proj", f"{RES}.in_layers.2", f"{RES}.out_layers.3", ATTN], seed=5)
    with_lora, _ = comfy["sd"].load_lora_for_models(patcher, None, lora, 0.8, 0.0)
    assert len(with_lora.patches) == 4
    snap_in, snap_orig = _snapshot(with_lora), _snapshot(patcher)

    slim_node = _node(comfy, "SdslimSlimUNet")
    (slim,) = slim_node.execute(model=with_lora, adapters="half.safetensors", strength=1.0, enable=True).args

    from sdslim_core.io.adapters import AdapterSet
    aset = AdapterSet.load(adapter_dir / "half.safetensors")
    deltas = {k + ".weight": _lora_delta64(lora, k, weights[k + ".weight"].shape, 0.8)
              for k in (f"{FF}.net.0.proj", f"{RES}.in_layers.2", f"{RES}.out_layers.3")}
    got = slim.model.diffusion_model.state_dict()
    for site, kind in ((FF, "ff"), (RES, "res"), ("middle_block.0", "res"), ("output_blocks.11.1.transformer_blocks.0.ff", "ff")):
        for key, ref in fold64(weights, aset.sites[site], site, kind, deltas).items():
            assert got[key].shape == ref.shape, key
            torch.testing.assert_close(got[key].double(), ref, rtol=1e-5, atol=1e-6, msg=key)
    # the attention LoRA is carried as a patch (not merged): applied when the slim model loads
    assert list(slim.patches) == ["diffusion_model." + ATTN + ".weight"]
    assert slim.model_size() < with_lora.model_size()
    assert type(slim.model.diffusion_model.input_blocks[1][0]).__name__ == "ResBlock"
    _assert_unchanged(with_lora, snap_in)
    _assert_unchanged(patcher, snap_orig)
    assert slim.model is not with_lora.model and slim.model.model_sampling is not with_lora.model.model_sampling


def test_an_fp8_model_stays_fp8_after_slim_unet(comfy, tiny, adapter_dir):
    """Slim stacked with fp8 storage in ComfyUI: a model whose weights are stored in fp8 (as with "weight_dtype
    fp8_e4m3fn") keeps its folded layers in fp8, each the float64 fold of the fp8 weights rounded once, and runs
    through ComfyUI's own cast ops."""
    from sdslim_core.io.adapters import AdapterSet
    _, weights = tiny
    mc = comfy["supported_models"].SD15(dict(TINY_SD15))
    mc.set_inference_dtype(torch.float8_e4m3fn, torch.float32)
    base = mc.get_model({}, "", device="cpu")
    stored = {k: v.to(torch.float8_e4m3fn) if v.ndim > 1 else v for k, v in weights.items()}
    base.diffusion_model.load_state_dict(stored, assign=True)
    fp8_model = comfy["model_patcher"].ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))
    (slim,) = _node(comfy, "SdslimSlimUNet").execute(model=fp8_model, adapters="half.safetensors", strength=1.0,
                                                      enable=True).args
    aset = AdapterSet.load(adapter_dir / "half.safetensors")
    dequantised = {k: v.double() for k, v in stored.items()}
    got = slim.model.diffusion_model.state_dict()
    n_exact = n_total = 0
    for site, kind in ((FF, "ff"), (RES, "res")):
        for key, ref in fold64(dequantised, aset.sites[site], site, kind, {}).items():
            if ref.dim() < 2:
                continue
            assert got[key].dtype == torch.float8_e4m3fn and got[key].shape == ref.shape, key
            want = ref.to(torch.float8_e4m3fn).double()
            torch.testing.assert_close(got[key].double(), want, rtol=0.13, atol=2 ** -9, msg=key)  # ≤ 1 fp8 step
            n_exact += int((got[key].double() == want).sum())
            n_total += want.numel()
    assert n_exact / n_total > 0.99
    # against the same fold of the same fp8 weights kept in float32: only the folded layers' rounding differs
    mc32 = comfy["supported_models"].SD15(dict(TINY_SD15))
    mc32.set_inference_dtype(torch.float32, None)
    base32 = mc32.get_model({}, "", device="cpu")
    base32.diffusion_model.load_state_dict({k: v.float() for k, v in stored.items()})
    (slim32,) = _node(comfy, "SdslimSlimUNet").execute(
        model=comfy["model_patcher"].ModelPatcher(base32, torch.device("cpu"), torch.device("cpu")),
        adapters="half.safetensors", strength=1.0, enable=True).args
    x, t, ctx = _inputs()
    out, ref_out = _forward(slim, x, t, ctx), _forward(slim32, x, t, ctx)
    rel = float((out - ref_out).norm() / ref_out.norm())
    assert 0 < rel < 0.1, rel
    assert slim.model_size() < 0.6 * slim32.model_size()


def test_full_width_adapters_reproduce_the_lora_model_and_original_is_isolated(comfy, tiny, adapter_dir):
    patcher, weights = tiny
    lora = _kohya_lora(weights, [f"{FF}.net.0.proj", f"{RES}.in_layers.2", ATTN], seed=6)
    with_lora, _ = comfy["sd"].load_lora_for_models(patcher, None, lora, 1.0, 0.0)
    snap = _snapshot(with_lora)
    (slim,) = _node(comfy, "SdslimSlimUNet").execute(model=with_lora, adapters="full.safetensors", strength=1.0,
                                                     enable=True).args
    x, t, ctx = _inputs()
    with_lora.patch_model()
    try:
        ref = _forward(with_lora, x, t, ctx)
    finally:
        with_lora.unpatch_model()
    slim.patch_model()
    try:
        out = _forward(slim, x, t, ctx)
    finally:
        slim.unpatch_model()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    _assert_unchanged(with_lora, snap)


def test_disable_passes_through_and_strength_selects_lowest_error(comfy, tiny, adapter_dir):
    patcher, _ = tiny
    node = _node(comfy, "SdslimSlimUNet")
    assert node.execute(model=patcher, adapters="half.safetensors", strength=1.0, enable=False).args[0] is patcher
    (part,) = node.execute(model=patcher, adapters="half.safetensors", strength=0.25, enable=True).args
    from sdslim_core.io.adapters import AdapterSet
    aset = AdapterSet.load(adapter_dir / "half.safetensors")
    errors = aset.site_errors()
    chosen = set(part.model.sdslim_info.ranks)
    assert len(chosen) == round(0.25 * len(aset.sites))
    assert max(errors[s] for s in chosen) < min(errors[s] for s in set(aset.sites) - chosen)


def test_sampling_lowvram_and_lora_after_slim(comfy, tiny, adapter_dir, caplog):
    patcher, weights = tiny
    snap = _snapshot(patcher)
    (slim,) = _node(comfy, "SdslimSlimUNet").execute(model=patcher, adapters="half.safetensors", strength=1.0,
                                                     enable=True).args
    late = _kohya_lora(weights, [ATTN, f"{FF}.net.0.proj"], seed=7)
    with caplog.at_level(logging.WARNING):
        slim_lora, _ = comfy["sd"].load_lora_for_models(slim, None, late, 1.0, 0.0)
    # the FF key is converted into slim space when the LoRA is added: no message, no "NOT LOADED"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert set(slim_lora.patches) == {f"diffusion_model.{ATTN}.weight", f"diffusion_model.{FF}.net.0.proj.weight"}
    # sampling through ComfyUI's KSampler path: no ERROR (shape) lines from ComfyUI's patch math, no more warnings
    cond = [[torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2)), {}]]
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    with caplog.at_level(logging.WARNING):
        (out,) = comfy["nodes"].common_ksampler(slim_lora, 1, 2, 5.0, "euler", "normal", cond, cond, latent)
    assert torch.isfinite(out["samples"]).all() and out["samples"].abs().sum() > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    record = comfy["pack"].nodes.monitor.LAST_SAMPLING
    assert record["slim"] and record["seconds"] > 0 and record["latent_shape"] == [1, 4, 16, 16]

    # the LoRA applies to the slim model, under full load and under lowvram alike
    x, t, ctx = _inputs()
    outs = {}
    for name, budget in (("full", 0), ("lowvram", 200_000)):
        slim_lora.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=budget)
        try:
            outs[name] = _forward(slim_lora, x, t, ctx)
            if budget:
                assert slim_lora.model.model_lowvram and slim_lora.lowvram_patch_counter() > 0
        finally:
            slim_lora.unpatch_model()
    torch.testing.assert_close(outs["lowvram"], outs["full"], rtol=1e-5, atol=1e-5)
    slim.patch_model()
    try:
        no_lora = _forward(slim, x, t, ctx)
    finally:
        slim.unpatch_model()
    assert (outs["full"] - no_lora).abs().max() > 1e-4
    _assert_unchanged(patcher, snap)        # shared storage: loading/patching the slim model never writes back


def _tiny_controlnet_sd(seed=9):
    """An LDM-format ('control_model.' prefix) ControlNet state dict for the tiny UNet, random weights."""
    import comfy.cldm.cldm as cldm
    import comfy.ops as ops
    cfg = {k: v for k, v in TINY_SD15.items() if k not in ("out_channels", "transformer_depth_output")}
    net = cldm.ControlNet(hint_channels=3, operations=ops.disable_weight_init, dtype=torch.float32,
                          device="cpu", **cfg)
    return {"control_model." + k: v for k, v in _random_state(net.state_dict(), seed).items()}


def test_controlnet_residuals_reach_the_slim_unet(comfy, tiny, adapter_dir, monkeypatch):
    patcher, _ = tiny
    # ComfyUI detects an unknown (tiny) ControlNet as supported_models_base.BASE, whose default 64-wide heads
    # leave a 32-channel block with no head at all; give it SD1.5's 8 heads (shapes are unaffected).
    import comfy.supported_models_base as models_base
    monkeypatch.setattr(models_base.BASE, "unet_extra_config", {"num_heads": 8, "num_head_channels": -1})
    control = comfy["controlnet"].load_controlnet_state_dict(_tiny_controlnet_sd())
    assert control is not None
    (slim,) = _node(comfy, "SdslimSlimUNet").execute(model=patcher, adapters="half.safetensors", strength=1.0,
                                                     enable=True).args
    cond = [[torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2)), {}]]
    hint = torch.rand(1, 128, 128, 3, generator=torch.Generator().manual_seed(4))
    apply = comfy["nodes"].ControlNetApplyAdvanced()
    pos, neg = apply.apply_controlnet(cond, cond, control, hint, 1.0, 0.0, 1.0)
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    (plain,) = comfy["nodes"].common_ksampler(slim, 1, 2, 5.0, "euler", "normal", cond, cond, latent)
    (ctrl,) = comfy["nodes"].common_ksampler(slim, 1, 2, 5.0, "euler", "normal", pos, neg, latent)
    assert torch.isfinite(ctrl["samples"]).all()
    assert (ctrl["samples"] - plain["samples"]).abs().max() > 1e-3


def test_report_breakdown_and_monitor_nodes(comfy, tiny, adapter_dir):
    patcher, _ = tiny
    (slim,) = _node(comfy, "SdslimSlimUNet").execute(model=patcher, adapters="half.safetensors", strength=1.0,
                                                     enable=True).args
    (mon,) = _node(comfy, "SdslimVramMonitor").execute(model=patcher).args
    assert mon is not patcher and "sdslim" in mon.wrappers["outer_sample"] and not patcher.wrappers.get("outer_sample")
    table = _node(comfy, "SdslimUNetBreakdown").execute(model=slim)
    text = table.args[0]
    assert "original vs slim" in text and table.ui.as_dict()["text"] == (text,)
    from sdslim_core.ops import breakdown
    full = breakdown.count({k: tuple(v.shape) for k, v in patcher.model.diffusion_model.state_dict().items()})
    now = breakdown.count({k: tuple(v.shape) for k, v in slim.model.diffusion_model.state_dict().items()})
    assert f"{full['total']:,}" in text and f"{now['total']:,}" in text and now["total"] < full["total"]
    comfy["mm"].load_models_gpu([slim])
    report = _node(comfy, "SdslimVramReport").execute(model=slim, model_b=patcher).args[0]
    assert "CPU only" in report and "RAM total" in report
    assert "BaseModel (slim)" in report and f"{now['total']:,}" in report
    assert _node(comfy, "SdslimVramReport").fingerprint_inputs() != _node(comfy, "SdslimVramReport").fingerprint_inputs()


def test_errors_name_the_file_and_key(comfy, tiny, adapter_dir, tmp_path):
    patcher, weights = tiny
    from sdslim_core import layout
    from sdslim_core.io import adapters
    from sdslim_core.layout import rank_policy
    ranks = rank_policy.ranks_for_ratio(layout.sites(weights), 0.5)
    other = adapters.AdapterSet.init_select(weights, ranks, "sd2")
    other.save(adapter_dir / "sd2.safetensors")
    node = _node(comfy, "SdslimSlimUNet")
    with pytest.raises(ValueError, match=r"sd2\.safetensors.*sd2.*sd15"):
        node.execute(model=patcher, adapters="sd2.safetensors", strength=1.0, enable=True)
    with pytest.raises(ValueError, match="gone.safetensors") as missing:     # sdslim.SlimError, not a bare OSError
        node.execute(model=patcher, adapters="gone.safetensors", strength=1.0, enable=True)
    assert execution_name(type(missing.value)) == "sdslim.SlimError"
    # a quantised weight (GGUF keeps raw uint8 blocks) is refused by key, before anything is built
    quant = patcher.clone()
    key = f"diffusion_model.{FF}.net.2.weight"
    kp = patcher.get_key_patches("diffusion_model.")
    kp[key] = [(torch.zeros(kp[key][0][0].shape, dtype=torch.uint8), kp[key][0][1])]
    quant.get_key_patches = lambda prefix=None: kp
    with pytest.raises(ValueError, match=f"{key}.*quantised"):
        node.execute(model=quant, adapters="half.safetensors", strength=1.0, enable=True)




# ------------------------------------------------------------------------------------------------ HTTP path

@pytest.mark.skipif(os.environ.get("COMFYUI_HTTP") != "1", reason="set COMFYUI_HTTP=1 to start the server")
def test_http_server_lists_nodes_and_runs_a_workflow(tmp_path):
    """main.py with the pack in a custom_nodes dir and models/sdslim from extra_model_paths.yaml."""
    from comfyui_server import ComfyServer
    (tmp_path / "adapters").mkdir()
    from sdslim_core.io.adapters import AdapterSet
    AdapterSet(family="sd15", sites={}, source="x").save(tmp_path / "adapters" / "from_yaml.safetensors")
    with ComfyServer(tmp_path / "comfy", {"sdslim": tmp_path / "adapters"}) as server:
        info = server.get("/object_info")
        ids = {"SdslimSlimUNet", "SdslimLoadSlimCheckpoint", "SdslimLoadSlimGGUF", "SdslimSaveSlimCheckpoint",
               "SdslimSaveSlimGGUF", "SdslimTrainAdapters", "SdslimVramReport", "SdslimVramMonitor",
               "SdslimUNetBreakdown", "SdslimTinyDemo"}
        assert ids <= set(info), server.log()[-3000:]
        assert "from_yaml.safetensors" in info["SdslimSlimUNet"]["input"]["required"]["adapters"][1]["options"]
        workflows = os.path.join(ROOT, "example_workflows")
        names = sorted(f for f in os.listdir(workflows) if f.endswith(".json"))
        assert names == sorted(os.listdir(os.path.join(workflows, "api")))      # each in UI and API format
        for name in names:
            for graph in (json.load(open(os.path.join(workflows, name))),
                          json.load(open(os.path.join(workflows, "api", name)))):
                types = {n["type"] for n in graph["nodes"]} if "nodes" in graph else \
                    {n["class_type"] for n in graph.values()}
                assert types <= set(info), (name, types - set(info))
        assert "tiny_demo" in server.get("/workflow_templates")["sdslim"]   # the template browser's list
        results = {}
        for name, output_node in (("vram_report_only", "1"), ("tiny_demo", "14")):
            prompt = json.load(open(os.path.join(workflows, "api", name + ".json")))
            entry = server.wait(server.queue(prompt))
            assert entry["status"]["status_str"] == "success", (name, entry["status"])
            results[name] = entry["outputs"][output_node]
        text = results["vram_report_only"]["text"][0]
        assert "CPU only" in text and "loaded models:" in text
        assert len(results["tiny_demo"]["images"]) == 1
        log_text = server.log()
        assert "ERROR" not in log_text and "shape" not in log_text, log_text[-3000:]


def test_recorded_signatures_match_this_comfyui(comfy):
    """tests/data/comfy_api_signatures.json (which the CI stand-in is checked against) still describes ComfyUI."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "comfy_standin"))
    try:
        import signatures
    finally:
        sys.path.pop(0)
    recorded = json.load(open(signatures.JSON_PATH))
    assert signatures.record() == recorded["names"]
    assert signatures.record_fields() == recorded["modelpatcher_fields"]


def test_train_node_writes_a_usable_adapter_file_and_resumes(comfy, tiny, adapter_dir, monkeypatch):
    import dataclasses

    from sdslim_core import layout
    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.train import config as train_config, run as train_run

    @dataclasses.dataclass
    class Quick(train_config.TrainConfig):       # tiny calibration so the test takes seconds, same code path
        n_trajectories: int = 2
        sample_steps: int = 2
        latent_size: int = 8
        tokens_per_sample: int = 16
        ff_tokens: int = 256
        res_maps: int = 8
        init_methods: tuple = ("select", "act_select")
        rank_grid: tuple = (0.5,)
    monkeypatch.setattr(train_run, "TrainConfig", Quick)
    patcher, weights = tiny
    with_lora, _ = comfy["sd"].load_lora_for_models(patcher, None, _kohya_lora(weights, [ATTN], seed=11), 1.0, 0.0)
    snap = _snapshot(with_lora)
    cond = [[torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2)), {}]]
    node = _node(comfy, "SdslimTrainAdapters")
    work = adapter_dir.parent / "sdslim_work" / "trained.safetensors.work"
    mm = comfy["mm"]
    checks = {"n": 0}
    real_check = mm.throw_exception_if_processing_interrupted

    def cancel_after_20():                           # the user presses Cancel during training
        checks["n"] += 1
        if checks["n"] > 20:
            raise mm.InterruptProcessingException()
        real_check()
    monkeypatch.setattr(mm, "throw_exception_if_processing_interrupted", cancel_after_20)
    with pytest.raises(mm.InterruptProcessingException):
        node.execute(model=with_lora, filename="trained", ratio=0.5, steps=2, seed=0, positive=cond, latent_size=6)
    monkeypatch.setattr(mm, "throw_exception_if_processing_interrupted", real_check)
    assert work.is_dir() and not list(adapter_dir.glob("*.work"))       # kept for the resume, outside models/sdslim
    out = node.execute(model=with_lora, filename="trained", ratio=0.5, steps=2, seed=0, positive=cond,
                       latent_size=6)                                   # resumes
    assert "adapters written to" in out.args[0] and out.ui.as_dict()["text"] == (out.args[0],)
    assert "no negative conditioning: CFG's unconditional branch is zeros" in out.args[0]
    assert not work.exists() and not any(p.is_dir() for p in adapter_dir.iterdir())   # removed after success
    aset = AdapterSet.load(adapter_dir / "trained.safetensors")
    assert aset.family == "sd15" and set(aset.sites) == {s.name for s in layout.sites(weights)}
    assert aset.metadata["sdslim.train"]["config"]["latent_size"] == 6
    node.execute(model=with_lora, filename="fresh", ratio=0.5, steps=2, seed=0, positive=cond, latent_size=6)
    fresh = AdapterSet.load(adapter_dir / "fresh.safetensors")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in aset.state_dict().items())   # resume is exact
    neg = [[torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(3)), {}]]
    out = node.execute(model=with_lora, filename="negative", ratio=0.5, steps=2, seed=0, positive=cond, negative=neg,
                       latent_size=6)
    assert "no negative" not in out.args[0]
    with_neg = AdapterSet.load(adapter_dir / "negative.safetensors")
    assert with_neg.metadata["sdslim.train"]["data"]["negative"] == "connected"
    theirs = with_neg.state_dict()
    assert any(not torch.equal(theirs[k], v) for k, v in aset.state_dict().items())   # the negative branch mattered
    monkeypatch.setattr(with_lora.model.model_config, "sdslim_latent_size", 4, raising=False)   # as the tiny loader
    node.execute(model=with_lora, filename="native", ratio=0.5, steps=2, seed=0, positive=cond)
    assert AdapterSet.load(adapter_dir / "native.safetensors").metadata["sdslim.train"]["config"]["latent_size"] == 4
    # only sdslim adapter files are offered by Slim UNet (not LoRAs or other safetensors placed there)
    from safetensors.torch import save_file
    save_file(_kohya_lora(weights, [ATTN], seed=1), str(adapter_dir / "a_lora.safetensors"))
    listed = _node(comfy, "SdslimSlimUNet").define_schema().inputs[1].options
    assert {"trained.safetensors", "fresh.safetensors", "native.safetensors", "negative.safetensors"} <= set(listed)
    assert "a_lora.safetensors" not in listed and not any(".work" in n for n in listed)
    (slim,) = _node(comfy, "SdslimSlimUNet").execute(model=with_lora, adapters="trained.safetensors", strength=1.0,
                                                     enable=True).args
    assert slim.model_size() < with_lora.model_size()
    _assert_unchanged(with_lora, snap)
    with pytest.raises(ValueError, match="needs calibration conditioning"):
        node.execute(model=with_lora, filename="x", ratio=0.5, steps=2, seed=0)


# ------------------------------------------------------------- the slim model is model.clone() on a new UNet

def _cond(seed=2):
    return [[torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(seed)), {}]]


def _sample(comfy, model, positive=None, negative=None, steps=2):
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    (out,) = comfy["nodes"].common_ksampler(model, 1, steps, 5.0, "euler", "normal", positive or _cond(),
                                            negative or _cond(), latent)
    return out["samples"]


def _slim(comfy, model, adapters="half.safetensors"):
    return _node(comfy, "SdslimSlimUNet").execute(model=model, adapters=adapters, strength=1.0, enable=True).args[0]


def test_torch_compile_before_slim_is_dropped_and_after_slim_compiles_the_slim_unet(comfy, tiny, adapter_dir,
                                                                                   monkeypatch, caplog):
    """TorchCompileModel's wrapper holds the compiled input UNet: carried over, it would run the teacher."""
    import torch._dynamo
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)   # ComfyUI's UNet re-traces per block
    patcher, _ = tiny
    compiled_graphs = []

    def backend(gm, example_inputs):          # a real torch.compile backend that runs the traced graph eagerly
        compiled_graphs.append(gm)
        return gm.forward
    from comfy_extras.nodes_torch_compile import TorchCompileModel
    (compiled,) = TorchCompileModel.execute(patcher, "inductor").args      # compiles lazily, at the first call
    with caplog.at_level(logging.WARNING, logger="sdslim"):
        slim_after_compile = _slim(comfy, compiled)
    assert any("torch.compile" in r.getMessage() and "after Slim UNet" in r.getMessage() for r in caplog.records)
    assert "torch_compile_kwargs" not in slim_after_compile.model_options
    slim = _slim(comfy, patcher)
    teacher, reference = _sample(comfy, patcher), _sample(comfy, slim)
    assert (teacher - reference).abs().max() > 1e-3
    torch.testing.assert_close(_sample(comfy, slim_after_compile), reference)
    compiled_slim = slim.clone()
    set_torch_compile_wrapper(compiled_slim, backend=backend)      # TorchCompileModel's call, a compiler-free backend
    torch.testing.assert_close(_sample(comfy, compiled_slim, steps=1), _sample(comfy, slim, steps=1),
                               rtol=1e-4, atol=1e-4)
    assert compiled_graphs                                          # compile after Slim UNet runs the slim UNet


def _decorate(comfy, model, calls):
    """A clone with an attention patch, a post-CFG function, an APPLY_MODEL wrapper and two callbacks that each
    change the result (or count) in ``calls``."""
    import comfy.patcher_extension as ext
    m = model.clone()

    def attn2(q, k, v, extra_options):
        calls["attn2"] = calls.get("attn2", 0) + 1
        return q * 0.8, k, v

    def post_cfg(args):
        calls["post_cfg"] = calls.get("post_cfg", 0) + 1
        return args["denoised"] * 0.9

    def apply_model(executor, *args, **kwargs):
        calls["wrapper"] = calls.get("wrapper", 0) + 1
        return executor(*args, **kwargs) * 1.05

    def pre_run(patcher):
        calls["pre_run"] = calls.get("pre_run", 0) + 1

    def on_clone(orig, new):
        calls["on_clone"] = calls.get("on_clone", 0) + 1
    m.set_model_attn2_patch(attn2)
    m.set_model_sampler_post_cfg_function(post_cfg)
    m.add_wrapper_with_key(ext.WrappersMP.APPLY_MODEL, "test", apply_model)
    m.add_callback_with_key(ext.CallbacksMP.ON_PRE_RUN, "test", pre_run)
    m.add_callback_with_key(ext.CallbacksMP.ON_CLONE, "test", on_clone)
    return m


def test_patches_wrappers_callbacks_and_hooks_act_before_and_after_slim(comfy, tiny, adapter_dir, caplog):
    """Issue 14: everything ComfyUI's clone() carries survives Slim UNet, set before it or after it."""
    hooks_api = importlib.import_module("comfy.hooks")
    patcher, weights = tiny
    before_calls, after_calls = {}, {}
    before = _slim(comfy, _decorate(comfy, patcher, before_calls))
    assert before_calls == {"on_clone": 1}                       # Slim UNet clones the way ComfyUI does
    after = _decorate(comfy, _slim(comfy, patcher), after_calls)
    plain = _slim(comfy, patcher)
    # a hook LoRA on the conditioning, on attention (kept shape) and on the FeedForward (converted)
    hook_lora = _kohya_lora(weights, [ATTN, f"{FF}.net.0.proj"], seed=12)
    hooks = hooks_api.create_hook_lora(hook_lora, strength_model=1.0, strength_clip=0.0)
    hooked = hooks_api.set_hooks_for_conditioning(_cond(), hooks)
    with caplog.at_level(logging.WARNING):
        outs = {name: _sample(comfy, m, hooked, hooked) for name, m in (("before", before), ("after", after),
                                                                           ("plain", plain))}
        again = _sample(comfy, after, hooked, hooked)
    unhooked = _sample(comfy, after)
    torch.testing.assert_close(outs["before"], outs["after"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(again, outs["after"])
    assert (outs["after"] - outs["plain"]).abs().max() > 1e-3      # the patches act ...
    assert (outs["after"] - unhooked).abs().max() > 1e-3           # ... and so does the hook LoRA
    for calls in (before_calls, after_calls):
        assert {"attn2", "post_cfg", "wrapper", "pre_run"} <= set(calls), calls
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings


@pytest.mark.parametrize("budget", [0, 200_000])
def test_slim_of_a_loaded_model_equals_slim_of_the_unloaded_one(comfy, tiny, adapter_dir, budget):
    """The input MODEL may be loaded (LoRA merged in place, or lowvram weight functions) when Slim UNet runs."""
    patcher, weights = tiny
    comfy["mm"].unload_all_models()          # patched by hand below, not by another clone left loaded by a test
    with_lora, _ = comfy["sd"].load_lora_for_models(
        patcher, None, _kohya_lora(weights, [ATTN, f"{FF}.net.0.proj", f"{RES}.in_layers.2"], seed=13), 1.0, 0.0)
    x, t, ctx = _inputs()
    with_lora.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=budget)
    try:
        loaded_ref = _forward(with_lora, x, t, ctx)
        slim_loaded = _slim(comfy, with_lora)
        assert not slim_loaded.model.model_lowvram and slim_loaded.model.model_loaded_weight_memory == 0
        assert not slim_loaded.backup and slim_loaded.parent is None
    finally:
        with_lora.unpatch_model()
    snap = _snapshot(with_lora)
    slim_fresh = _slim(comfy, with_lora)
    outs = []
    for m in (slim_loaded, slim_fresh):
        m.patch_model()
        try:
            outs.append(_forward(m, x, t, ctx))
        finally:
            m.unpatch_model()
    torch.testing.assert_close(outs[0], outs[1])
    with_lora.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=budget)
    try:
        torch.testing.assert_close(_forward(with_lora, x, t, ctx), loaded_ref)
    finally:
        with_lora.unpatch_model()
    _assert_unchanged(with_lora, snap)


# ------------------------------------------------------------------------ LoRAs after Slim UNet, in slim space

def _loha(weights, keys, seed, rank=2, alpha=1.0):
    """A LyCORIS LoHa (no Tucker cores) on the given canonical modules, kohya LDM names."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key in keys:
        w = weights[key + ".weight"]
        name = "lora_unet_" + key.replace(".", "_")
        for i in (1, 2):
            sd[f"{name}.hada_w{i}_a"] = 0.3 * torch.randn(w.shape[0], rank, generator=g)
            sd[f"{name}.hada_w{i}_b"] = 0.3 * torch.randn(rank, w[0].numel(), generator=g)
        sd[name + ".alpha"] = torch.tensor(alpha)
    return sd


@pytest.fixture(scope="module")
def intercept_adapters(adapter_dir):
    """half.safetensors plus an FF intercept (``up_bias``) on every FF site, as half_c.safetensors."""
    from sdslim_core.io.adapters import AdapterSet
    aset = AdapterSet.load(adapter_dir / "half.safetensors")
    g = torch.Generator().manual_seed(2)
    for t in aset.sites.values():
        if "down_value" in t:
            t["up_bias"] = 0.5 * torch.randn(t["up"].shape[0], generator=g)
    aset.save(adapter_dir / "half_c.safetensors")
    return "half_c.safetensors"


CONV_KEYS = [f"{RES}.in_layers.2", f"{RES}.out_layers.3", "middle_block.0.in_layers.2", "input_blocks.4.0.out_layers.3"]


@pytest.fixture(scope="module")
def lora_files(comfy, tiny, tmp_path_factory):
    """In a LoRA folder: a kohya LoRA on the GEGLU proj, net.2 (a site with an intercept), emb and attention; a
    LoCon (3×3 down factors) on ResBlock convs; a LoHa on proj, net.2 and a conv2."""
    from safetensors.torch import save_file
    folder = tmp_path_factory.mktemp("loras")
    comfy["folder_paths"].add_model_folder_path("loras", str(folder), is_default=True)
    _, weights = tiny
    ff2 = "output_blocks.4.1.transformer_blocks.0.ff"
    save_file(_kohya_lora(weights, [f"{FF}.net.0.proj", f"{FF}.net.2", f"{ff2}.net.2", f"{RES}.emb_layers.1", ATTN],
                          seed=21), str(folder / "lora.safetensors"))
    save_file(_kohya_lora(weights, CONV_KEYS, seed=22, rank=3, alpha=1.5), str(folder / "locon.safetensors"))
    save_file(_loha(weights, [f"{FF}.net.0.proj", f"{ff2}.net.2", f"{RES}.out_layers.3"], seed=23),
              str(folder / "loha.safetensors"))
    return folder


def _run(model, x, t, ctx):
    model.patch_model()
    try:
        return _forward(model, x, t, ctx)
    finally:
        model.unpatch_model()


def _count_folds(monkeypatch):
    from sdslim_core.ops import fold
    calls, real = [], fold.fold_site
    monkeypatch.setattr(fold, "fold_site", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def test_loras_after_slim_unet_equal_loras_before_it(comfy, tiny, intercept_adapters, lora_files, monkeypatch,
                                                      caplog):
    """ComfyUI's LoRA loader after Slim UNet gives the model that folding the same LoRA in gives (float32), for a
    LoRA (on a site with an FF intercept), a LoCon and a LoHa at several strengths; a strength change never folds."""
    patcher, _ = tiny
    loader = comfy["nodes"].LoraLoaderModelOnly()
    slim = _slim(comfy, patcher, intercept_adapters)
    x, t, ctx = _inputs()
    plain = _run(slim, x, t, ctx)
    calls = _count_folds(monkeypatch)
    from sdslim_core.ops import lora_slim
    converts, real_convert = [], lora_slim.SlimSpace.convert
    monkeypatch.setattr(lora_slim.SlimSpace, "convert", lambda *a, **k: converts.append(1) or real_convert(*a, **k))
    for names, strength in ((["lora"], 1.0), (["lora"], 0.4), (["locon"], -0.7), (["loha"], 0.8),
                            (["lora", "locon", "loha"], 0.6)):
        after, before = slim, patcher
        converts.clear()
        with caplog.at_level(logging.WARNING):
            for name in names:
                (after,) = loader.load_lora_model_only(after, f"{name}.safetensors", strength)
            folds = len(calls)
            got = _run(after, x, t, ctx)
        assert len(calls) == folds == 0, "adding a LoRA to a slim model must not fold"
        assert bool(converts) == (strength != 0.4), "a strength change reuses the LoRA's conversion"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
        for name in names:
            (before,) = loader.load_lora_model_only(before, f"{name}.safetensors", strength)
        want = _run(_slim(comfy, before, intercept_adapters), x, t, ctx)
        calls.clear()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{names} at {strength}: {m}")
        assert (want - plain).abs().max() > 1e-3, "the LoRA must change the output (else this proves nothing)"
    bias = after.patches[f"diffusion_model.{FF}.net.2.bias"]           # the intercept moves the slim net.2 bias
    assert [type(v[1]).__name__ for v in bias] == ["tuple"] and bias[0][1][0] == "diff"


def test_hook_lora_acts_on_the_slim_model_as_on_the_teacher(comfy, tiny, adapter_dir, intercept_adapters):
    hooks_api = importlib.import_module("comfy.hooks")
    patcher, weights = tiny
    lora = _kohya_lora(weights, [f"{FF}.net.0.proj", f"{FF}.net.2", f"{RES}.in_layers.2", f"{RES}.out_layers.3",
                                 f"{RES}.emb_layers.1", ATTN], seed=31)
    hooks = hooks_api.create_hook_lora(lora, strength_model=0.8, strength_clip=0.0)
    hooked = hooks_api.set_hooks_for_conditioning(_cond(), hooks)
    # full-width adapters: the slim model is the teacher, with the hook LoRA as without it
    teacher = _sample(comfy, patcher, hooked, hooked)
    assert (teacher - _sample(comfy, patcher)).abs().max() > 1e-3
    torch.testing.assert_close(_sample(comfy, _slim(comfy, patcher, "full.safetensors"), hooked, hooked), teacher,
                               rtol=1e-4, atol=1e-4)
    # half-width adapters with an FF intercept: the hook acts as the same LoRA folded in before Slim UNet
    merged_first, _ = comfy["sd"].load_lora_for_models(patcher, None, lora, 0.8, 0.0)
    torch.testing.assert_close(_sample(comfy, _slim(comfy, patcher, intercept_adapters), hooked, hooked),
                               _sample(comfy, _slim(comfy, merged_first, intercept_adapters)), rtol=1e-4, atol=1e-4)


def test_dora_after_slim_unet_is_refused_with_the_cores_message(comfy, tiny, adapter_dir, lora_files):
    from safetensors.torch import save_file
    patcher, weights = tiny
    dora = _kohya_lora(weights, [f"{FF}.net.0.proj", ATTN], seed=41)
    name = "lora_unet_" + f"{FF}.net.0.proj".replace(".", "_")
    dora[name + ".dora_scale"] = weights[f"{FF}.net.0.proj.weight"].norm(dim=1, keepdim=True) * 1.1
    save_file(dora, str(lora_files / "dora.safetensors"))
    loader = comfy["nodes"].LoraLoaderModelOnly()
    with pytest.raises(ValueError, match=r"DoRA on input_blocks\.1\.1\.transformer_blocks\.0\.ff\.net\.0\.proj.*"
                                         r"fold it instead.*LoRA loader before Slim UNet"):
        loader.load_lora_model_only(_slim(comfy, patcher), "dora.safetensors", 1.0)
    (before,) = loader.load_lora_model_only(patcher, "dora.safetensors", 1.0)       # before Slim UNet: folded in
    assert _slim(comfy, before).model_size() < patcher.model_size()


class _TinySD15:
    """ComfyUI's model detection knows SD1.5 by its 320 base channels; the tiny test model has 32."""
    unet_config = {"context_dim": 32, "model_channels": 32, "use_linear_in_transformer": False,
                   "adm_in_channels": None, "use_temporal_attention": False}


def test_load_slim_checkpoint_gives_the_slim_unet_and_takes_loras(comfy, tiny, intercept_adapters, lora_files,
                                                                 adapter_dir, tmp_path, monkeypatch):
    """A slim checkpoint written by `sdslim slim` (its adapter file recorded by sha256, known to the hash index),
    which ComfyUI's own loader cannot open: the node's MODEL equals Slim UNet's, and LoRAs after it equal LoRAs
    folded in first."""
    from safetensors.torch import save_file

    from sdslim_core.apps import slim as core_slim
    patcher, weights = tiny
    sm = comfy["supported_models"]
    tiny_cls = type("TinySD15", (sm.SD15,), {"unet_config": _TinySD15.unet_config})
    monkeypatch.setattr(sm, "models", [tiny_cls] + list(sm.models))
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in weights.items()},
              str(ckpts / "plain.safetensors"))
    core_slim.slim_checkpoint(ckpts / "plain.safetensors", adapter_dir / intercept_adapters, ckpts / "slim.safetensors")
    comfy["folder_paths"].add_model_folder_path("checkpoints", str(ckpts), is_default=True)
    with pytest.raises(RuntimeError, match="size mismatch"):
        comfy["nodes"].CheckpointLoaderSimple().load_checkpoint("slim.safetensors")
    node = _node(comfy, "SdslimLoadSlimCheckpoint")
    options = node.define_schema().inputs[0].options
    assert "slim.safetensors" in options and "plain.safetensors" not in options
    model, clip, vae = node.execute(ckpt_name="slim.safetensors").args
    assert clip is None and model.model.sdslim_info.space is not None
    x, t, ctx = _inputs()
    reference = _slim(comfy, patcher, intercept_adapters)
    torch.testing.assert_close(_run(model, x, t, ctx), _run(reference, x, t, ctx), rtol=1e-5, atol=1e-6)
    assert model.model_size() == reference.model_size()
    loader = comfy["nodes"].LoraLoaderModelOnly()
    for name, strength in (("lora", 0.9), ("locon", 0.5), ("loha", -0.6)):
        (after,) = loader.load_lora_model_only(model, f"{name}.safetensors", strength)
        (before,) = loader.load_lora_model_only(patcher, f"{name}.safetensors", strength)
        torch.testing.assert_close(_run(after, x, t, ctx), _run(_slim(comfy, before, intercept_adapters), x, t, ctx),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not a slim checkpoint"):
        node.execute(ckpt_name="plain.safetensors")


def _tiny_detection(comfy, monkeypatch, tmp_path):
    sm = comfy["supported_models"]
    monkeypatch.setattr(sm, "models", [type("TinySD15", (sm.SD15,), {"unet_config": _TinySD15.unet_config})]
                        + list(sm.models))
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir(exist_ok=True)
    comfy["folder_paths"].add_model_folder_path("checkpoints", str(ckpts), is_default=True)
    return ckpts


def test_load_slim_checkpoint_finds_its_adapter_file_by_hash_in_models_sdslim(comfy, tiny, intercept_adapters,
                                                                             lora_files, adapter_dir, tmp_path,
                                                                             monkeypatch):
    """Another machine (an empty hash index): the slim file's adapter file, renamed, in a models/sdslim folder of
    extra_model_paths.yaml, is found by its sha256 when the first LoRA comes; without it, loading and sampling
    work and a LoRA on a folded layer stops with one message naming the sha256 and the recorded name."""
    import shutil

    from safetensors.torch import save_file

    from sdslim_core.apps import slim as core_slim
    patcher, weights = tiny
    ckpts = _tiny_detection(comfy, monkeypatch, tmp_path)
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in weights.items()},
              str(ckpts / "plain2.safetensors"))
    core_slim.slim_checkpoint(ckpts / "plain2.safetensors", adapter_dir / intercept_adapters,
                              ckpts / "slim_by_hash.safetensors")
    loader = comfy["nodes"].LoraLoaderModelOnly()
    x, t, ctx = _inputs()
    (before,) = loader.load_lora_model_only(patcher, "lora.safetensors", 0.9)
    want = _run(_slim(comfy, before, intercept_adapters), x, t, ctx)
    monkeypatch.setenv("SDSLIM_CACHE_DIR", str(tmp_path / "empty-index"))
    shelf = tmp_path / "yaml_sdslim"
    shelf.mkdir()
    shutil.copy(adapter_dir / intercept_adapters, shelf / "renamed.safetensors")
    table = comfy["folder_paths"].folder_names_and_paths
    saved = table["sdslim"]
    monkeypatch.setitem(table, "sdslim", ([str(tmp_path / "no_such_folder"), str(shelf)], saved[1]))
    node = _node(comfy, "SdslimLoadSlimCheckpoint")
    model, _, _ = node.execute(ckpt_name="slim_by_hash.safetensors").args
    (after,) = loader.load_lora_model_only(model, "lora.safetensors", 0.9)
    torch.testing.assert_close(_run(after, x, t, ctx), want, rtol=1e-4, atol=1e-5)
    (shelf / "renamed.safetensors").unlink()
    monkeypatch.setenv("SDSLIM_CACHE_DIR", str(tmp_path / "empty-index-2"))
    model, _, _ = node.execute(ckpt_name="slim_by_hash.safetensors").args
    _sample(comfy, model)                                        # sampling needs no adapter file
    sha = model.model.sdslim_info.record["sdslim.adapters"]["sha256"]
    with pytest.raises(ValueError) as err:
        loader.load_lora_model_only(model, "lora.safetensors", 0.9)
    assert sha in str(err.value) and intercept_adapters in str(err.value) and "merge the LoRA before" in str(err.value)
    assert str(shelf) in str(err.value)


def execution_name(cls) -> str:
    """The exception's name as ComfyUI's error dialog shows it."""
    import execution
    return execution.full_type_name(cls)


def test_each_example_save_workflow_writes_what_its_load_workflow_loads(comfy, tiny, intercept_adapters, lora_files,
                                                                        adapter_dir, tmp_path, monkeypatch):
    """save_slim_checkpoint → slim_checkpoint_lora in sequence, with the workflows' own file names and widget
    values (a tiny model for the checkpoint and adapter files they name): the saved file loads under the name the
    loading workflow gives, and its LoRA, applied once after loading, equals the same LoRA folded in first."""
    api = os.path.join(ROOT, "example_workflows", "api")
    save_graph, load_graph = (json.load(open(os.path.join(api, f"{n}.json")))
                              for n in ("save_slim_checkpoint", "slim_checkpoint_lora"))
    patcher, _ = tiny
    ckpts = _tiny_detection(comfy, monkeypatch, tmp_path)
    (save_id,) = [k for k, v in save_graph.items() if v["class_type"] == "SdslimSaveSlimCheckpoint"]
    (load_id,) = [k for k, v in load_graph.items() if v["class_type"] == "SdslimLoadSlimCheckpoint"]
    widgets = {k: v for k, v in save_graph[save_id]["inputs"].items() if not isinstance(v, list)}
    slim = _slim(comfy, patcher, intercept_adapters)
    _node(comfy, "SdslimSaveSlimCheckpoint").execute(model=slim, **widgets)
    name = load_graph[load_id]["inputs"]["ckpt_name"]
    assert (ckpts / name).is_file()
    loaded, _, _ = _node(comfy, "SdslimLoadSlimCheckpoint").execute(ckpt_name=name).args
    (lora_id,) = [k for k, v in load_graph.items() if v["class_type"] == "LoraLoader"]
    strength = load_graph[lora_id]["inputs"]["strength_model"]
    loader = comfy["nodes"].LoraLoaderModelOnly()
    (after_load,) = loader.load_lora_model_only(loaded, "lora.safetensors", strength)
    (before,) = loader.load_lora_model_only(patcher, "lora.safetensors", strength)
    x, t, ctx = _inputs()
    torch.testing.assert_close(_run(after_load, x, t, ctx), _run(_slim(comfy, before, intercept_adapters), x, t, ctx),
                               rtol=2e-2, atol=2e-2)                                       # fp16 storage


def test_save_nodes_refuse_the_tiny_demo_model_in_one_sentence(comfy, adapter_dir):
    """The tiny demo's files are not ComfyUI's: the Save nodes say so (and that Slim UNet is the way), as a
    sdslim.SlimError, never a bare AttributeError."""
    model, clip, vae, _ = _node(comfy, "SdslimTinyDemo").execute().args
    slim = _node(comfy, "SdslimSlimUNet").execute(model=model, adapters="tiny_sd15_slim_half.safetensors",
                                                  strength=1.0, enable=True).args[0]
    for node, extra in (("SdslimSaveSlimCheckpoint", {"destination": "output", "clip": clip, "vae": vae}),
                        ("SdslimSaveSlimGGUF", {"quant": "Q8_0"})):
        with pytest.raises(ValueError) as refused:
            _node(comfy, node).execute(model=slim, filename="tiny", overwrite=False, embed_adapters=False, **extra)
        assert "tiny demo model cannot be saved" in str(refused.value) and str(refused.value).count(". ") == 0
        assert execution_name(type(refused.value)) == "sdslim.SlimError"


def test_save_slim_checkpoint_writes_what_load_slim_checkpoint_reads(comfy, tiny, intercept_adapters, lora_files,
                                                                    adapter_dir, tmp_path, monkeypatch):
    """Slim UNet → a LoRA → Save Slim Checkpoint → Load Slim Checkpoint: the same model, its record, no adapter
    tensors unless asked; an existing file is kept unless overwrite; a MODEL that is not slim is refused."""
    from sdslim_core.io.sizes import file_size
    from sdslim_core.io.tensors import read_header
    patcher, _ = tiny
    ckpts = _tiny_detection(comfy, monkeypatch, tmp_path)
    (lora_model,) = comfy["nodes"].LoraLoaderModelOnly().load_lora_model_only(_slim(comfy, patcher, intercept_adapters),
                                                                             "lora.safetensors", 0.7)
    save = _node(comfy, "SdslimSaveSlimCheckpoint")
    save.execute(model=lora_model, filename="sub/saved", destination="checkpoints", overwrite=False,
                 embed_adapters=False)
    path = ckpts / "sub" / "saved.safetensors"
    assert path.is_file()
    entries, meta = read_header(path)
    assert meta["sdslim.slim"] == "1" and not [k for k in entries if k.startswith("sdslim.")]
    assert json.loads(meta["sdslim.adapters"])["file"] == intercept_adapters
    assert json.loads(meta["sdslim.loras"])[-1]["applied"] == "in slim space"
    assert file_size(path).parts["adapters"] == 0
    # the default dtype: the source's; these random float32 weights are exact in no 16-bit dtype, so fp16
    assert {d for k, (d, _) in entries.items() if k.startswith("model.diffusion_model.")} == {torch.float16}
    model, _, _ = _node(comfy, "SdslimLoadSlimCheckpoint").execute(ckpt_name="sub/saved.safetensors").args
    x, t, ctx = _inputs()
    reference = _run(lora_model, x, t, ctx)
    torch.testing.assert_close(_run(model, x, t, ctx), reference, rtol=2e-2, atol=2e-2)       # fp16 storage
    assert model.model.sdslim_info.source_dtype == torch.float16                            # the file's
    held = save.execute(model=lora_model, filename="sub/held", destination="checkpoints", overwrite=False,
                        embed_adapters=False, dtype="as held")
    assert "UNet part" in held.ui.as_dict()["text"][0]
    model, _, _ = _node(comfy, "SdslimLoadSlimCheckpoint").execute(ckpt_name="sub/held.safetensors").args
    torch.testing.assert_close(_run(model, x, t, ctx), reference, rtol=1e-5, atol=1e-6)    # float32 as held
    before = path.read_bytes()
    from sdslim_core.io.files import OutputExists
    with pytest.raises(ValueError) as refused:
        save.execute(model=lora_model, filename="sub/saved", destination="checkpoints", overwrite=False,
                     embed_adapters=False)
    assert str(refused.value) == "sdslim: " + OutputExists(path).message("overwrite")
    assert execution_name(type(refused.value)) == "sdslim.SlimError"
    assert path.read_bytes() == before
    save.execute(model=lora_model, filename="sub/saved", destination="checkpoints", overwrite=True,
                 embed_adapters=True)
    entries, meta = read_header(path)
    own = [k for k in entries if k.startswith("sdslim.adapters.")]
    assert own and {entries[k][0] for k in own} == {torch.float16} and file_size(path).parts["adapters"] > 0
    with pytest.raises(ValueError, match="not slim"):
        save.execute(model=patcher, filename="plain", destination="output", overwrite=False, embed_adapters=False)
    with pytest.raises(ValueError, match="not a file name inside"):
        save.execute(model=lora_model, filename="../escape", destination="output", overwrite=False,
                     embed_adapters=False)
    assert not list(ckpts.glob("**/*.tmp")) and not list(ckpts.glob("**/.*.tmp"))


def test_saving_never_changes_what_the_model_computes_afterwards(comfy, tiny, intercept_adapters, lora_files,
                                                              adapter_dir, tmp_path, monkeypatch, capsys):
    """The bug: a LoRA added after Slim UNet on a slim MODEL that Save Slim Checkpoint had just written computed the
    slim model without the LoRA. The save's forced load (``load_models_gpu(force_patch_weights=True)``, as ComfyUI's
    Save Checkpoint) left the slim BaseModel loaded, every module marked patched, and the LoRA clone's
    ``patch_model()`` (not ComfyUI's loader, which detaches the loaded clone first) skipped them all; ComfyUI's own
    Save Checkpoint leaves its model so (measured and printed here). Save Slim Checkpoint and Save Slim GGUF now
    unload what they loaded: the saved MODEL (with a LoRA, forced into the weights its parent shares), its parent and
    a LoRA added later compute what they computed before, patched either way, the LoRA folded in before Slim UNet
    being the reference."""
    patcher, _ = tiny
    mm = comfy["mm"]
    _tiny_detection(comfy, monkeypatch, tmp_path)
    comfy["folder_paths"].add_model_folder_path("diffusion_models", str(tmp_path), is_default=True)
    loader = comfy["nodes"].LoraLoaderModelOnly()
    x, t, ctx = _inputs()
    mm.unload_all_models()
    slim = _slim(comfy, patcher, intercept_adapters)
    plain = _run(slim, x, t, ctx)
    want = _run(_slim(comfy, loader.load_lora_model_only(patcher, "lora.safetensors", 0.9)[0], intercept_adapters),
                x, t, ctx)
    comfy["sd"].save_checkpoint(str(tmp_path / "comfyui_save.safetensors"), slim)
    comfyui_left = (_run(loader.load_lora_model_only(slim, "lora.safetensors", 0.9)[0], x, t, ctx) - want).abs().max()
    mm.unload_all_models()
    save = _node(comfy, "SdslimSaveSlimCheckpoint")
    save.execute(model=slim, filename="plain", destination="checkpoints", overwrite=False, embed_adapters=False)
    after = _run(loader.load_lora_model_only(slim, "lora.safetensors", 0.9)[0], x, t, ctx)
    torch.testing.assert_close(after, want, rtol=1e-4, atol=1e-5)
    assert not mm.current_loaded_models
    (saved,) = loader.load_lora_model_only(slim, "lora.safetensors", 0.9)
    snap = _snapshot(saved)
    save.execute(model=saved, filename="lora", destination="checkpoints", overwrite=False, embed_adapters=False)
    _save_gguf(comfy, saved, filename="lora", quant="Q8_0", overwrite=False, embed_adapters=False)
    _assert_unchanged(saved, snap)
    assert not mm.current_loaded_models
    torch.testing.assert_close(_run(slim, x, t, ctx), plain)
    torch.testing.assert_close(_run(saved, x, t, ctx), want, rtol=1e-4, atol=1e-5)
    with capsys.disabled():
        print(f"\nafter ComfyUI's Save Checkpoint, a LoRA clone patched by patch_model(): max abs diff "
              f"{comfyui_left:.4f} from the LoRA; after Save Slim Checkpoint: "
              f"{(after - want).abs().max():.2e} (the LoRA's own effect: {(want - plain).abs().max():.4f})")


# ------------------------------------------------------------ with a GPU: tests/emulated_device.py's second device

@pytest.fixture
def gpu(comfy, monkeypatch):
    """ComfyUI as on a machine with a GPU: its torch device is emulated_device.py's (CUDA's placement rules, the
    CPU's values), the load device of the models made here, the CPU their offload device. ComfyUI's memory figures
    for it are the system's, as ComfyUI gives them for MPS (its CUDA queries cannot run here). Nothing is loaded
    before or after."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from emulated_device import emulated_device
    sys.path.pop(0)
    mm = comfy["mm"]

    def system(real):
        return lambda dev=None, *args, **kwargs: real(torch.device("cpu"), *args, **kwargs)
    for name in ("get_total_memory", "get_free_memory"):
        monkeypatch.setattr(mm, name, system(getattr(mm, name)))
    mm.unload_all_models()
    with emulated_device() as dev:
        monkeypatch.setattr(mm, "get_torch_device", lambda: dev)
        try:
            yield dev
        finally:
            for device in (dev, torch.device("cpu")):
                mm.free_memory(1e30, device)


def _lowvram(comfy, monkeypatch, vram):
    """``--novram`` (every layer cast per forward from the CPU) for ``vram == "lowvram"``."""
    if vram == "lowvram":
        monkeypatch.setattr(comfy["mm"], "vram_state", comfy["mm"].VRAMState.NO_VRAM)


def _loaded_forward(comfy, model, device, x, t, ctx, lowvram):
    """What ``model`` computes loaded onto ``device`` by ComfyUI's loader, on the CPU; unloaded again."""
    comfy["mm"].load_models_gpu([model])
    try:
        unet = model.model.diffusion_model
        assert model.model.model_lowvram == lowvram
        assert {p.device for p in unet.parameters()} == ({torch.device("cpu")} if lowvram else {device})
        return _forward(model, x.to(device), t.to(device), ctx.to(device)).cpu()
    finally:
        comfy["mm"].free_memory(1e30, device)


@pytest.mark.parametrize("vram", ["full", "lowvram"])
def test_slim_unet_and_a_lora_after_it_on_a_gpu(comfy, tiny, intercept_adapters, lora_files, gpu, vram, monkeypatch):
    """Guards Slim UNet with a GPU, in ComfyUI itself: the first GPU run's crash (the fold on the load device, the
    adapter tensors read on the CPU). The MODEL's load device is the GPU: Slim UNet folds there (the code before the
    fix, f134183, folded on the CPU for every load device but CUDA), and the slim model with a LoRA after it, loaded
    by ComfyUI (fully, or --novram: layers cast per forward with the LoRA applied by ComfyUI's LowVramPatch),
    computes on the GPU what it computes on the CPU, and a KSampler run on the GPU gives the CPU's latent."""
    from sdslim_core.ops import fold
    patcher, _ = tiny
    _lowvram(comfy, monkeypatch, vram)
    folded_on, real_fold = set(), fold.fold_site
    monkeypatch.setattr(fold, "fold_site", lambda site, kind, get, tensors: real_fold(
        site, kind, lambda k: folded_on.add(getattr(get(k), "device", None)) or get(k), tensors))
    loader = comfy["nodes"].LoraLoaderModelOnly()
    x, t, ctx = _inputs()
    (on_cpu,) = loader.load_lora_model_only(_slim(comfy, patcher, intercept_adapters), "lora.safetensors", 0.9)
    want, want_latent = _run(on_cpu, x, t, ctx), _sample(comfy, on_cpu)
    comfy["mm"].unload_all_models()
    on_gpu = comfy["model_patcher"].ModelPatcher(patcher.model, gpu, torch.device("cpu"))
    folded_on.clear()
    (after,) = loader.load_lora_model_only(_slim(comfy, on_gpu, intercept_adapters), "lora.safetensors", 0.9)
    assert folded_on - {None} == {gpu}
    assert {p.device for p in after.model.parameters()} == {torch.device("cpu")}       # waits on the offload device
    got = _loaded_forward(comfy, after, gpu, x, t, ctx, vram == "lowvram")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_sample(comfy, after), want_latent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vram", ["full", "lowvram"])
def test_load_slim_checkpoint_and_a_lora_after_it_on_a_gpu(comfy, tiny, intercept_adapters, lora_files, adapter_dir,
                                                           gpu, vram, tmp_path, monkeypatch):
    """Guards Load Slim Checkpoint with a GPU: its MODEL takes ComfyUI's load device (the GPU) and offload device,
    and a LoRA after it (converted with the adapter file the slim file records) computes on the GPU, fully loaded or
    --novram, what ComfyUI's patching computes on the CPU."""
    from sdslim_core.apps import slim as core_slim
    from safetensors.torch import save_file
    patcher, weights = tiny
    _lowvram(comfy, monkeypatch, vram)
    ckpts = _tiny_detection(comfy, monkeypatch, tmp_path)
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "full.st"))
    core_slim.slim_checkpoint(tmp_path / "full.st", adapter_dir / intercept_adapters, ckpts / "gpu.safetensors")
    model, _, _ = _node(comfy, "SdslimLoadSlimCheckpoint").execute(ckpt_name="gpu.safetensors").args
    assert (model.load_device, model.offload_device) == (gpu, torch.device("cpu"))
    (after,) = comfy["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, "lora.safetensors", 0.9)
    x, t, ctx = _inputs()
    want = _run(after, x, t, ctx)                                  # ComfyUI's patching on the CPU
    assert (want - _run(model, x, t, ctx)).abs().max() > 1e-3
    torch.testing.assert_close(_loaded_forward(comfy, after, gpu, x, t, ctx, vram == "lowvram"), want, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("vram", ["full", "lowvram"])
def test_save_nodes_write_from_a_gpu_what_they_write_from_the_cpu(comfy, tiny, intercept_adapters, lora_files, gpu,
                                                                  vram, tmp_path, monkeypatch):
    """Guards the Save nodes with a GPU: their forced load puts the patched weights on the GPU (--novram: patched in
    place on the CPU) and both writers read them from there. A slim MODEL with a LoRA after it, loaded on the GPU
    before the save (as after a sampling), is written byte for byte as the same MODEL on the CPU is, stays loaded and
    computes what it computed."""
    from sdslim_core.io.tensors import load_file
    patcher, _ = tiny
    _lowvram(comfy, monkeypatch, vram)
    ckpts = _tiny_detection(comfy, monkeypatch, tmp_path)
    comfy["folder_paths"].add_model_folder_path("diffusion_models", str(tmp_path), is_default=True)
    loader = comfy["nodes"].LoraLoaderModelOnly()
    x, t, ctx = _inputs()
    for name, device in (("cpu", torch.device("cpu")), ("gpu", gpu)):
        m = comfy["model_patcher"].ModelPatcher(patcher.model, device, torch.device("cpu"))
        (after,) = loader.load_lora_model_only(_slim(comfy, m, intercept_adapters), "lora.safetensors", 0.9)
        before = _loaded_forward(comfy, after, device, x, t, ctx, vram == "lowvram" and name == "gpu")
        comfy["mm"].load_models_gpu([after])
        _node(comfy, "SdslimSaveSlimCheckpoint").execute(model=after, filename=name, destination="checkpoints",
                                                         overwrite=False, embed_adapters=False, dtype="as held")
        wrote_gguf = _save_gguf(comfy, after, filename=name, quant="Q8_0", overwrite=False, embed_adapters=False)
        assert [lm.model for lm in comfy["mm"].current_loaded_models] == [after]
        comfy["mm"].free_memory(1e30, device)
        torch.testing.assert_close(_loaded_forward(comfy, after, device, x, t, ctx, vram == "lowvram" and
                                                   name == "gpu"), before, rtol=0, atol=0)
    cpu, got = (load_file(ckpts / f"{n}.safetensors")[0] for n in ("cpu", "gpu"))
    assert got.keys() == cpu.keys() and all(torch.equal(got[k], cpu[k]) for k in cpu)
    if wrote_gguf:
        assert (tmp_path / "gpu.gguf").read_bytes() == (tmp_path / "cpu.gguf").read_bytes()
    else:
        assert not list(tmp_path.glob("*.gguf"))


def test_vram_report_on_a_gpu_names_it_and_what_is_loaded_there(comfy, tiny, adapter_dir, gpu):
    """Guards VRAM Report with a GPU that is not CUDA (MPS, XPU, DirectML): it said "CPU only: no GPU" for every
    device but CUDA. After a KSampler run of a slim MODEL on the (emulated) GPU, the report names the device, ComfyUI's
    memory figures for it, the slim model loaded there and the sampling's device. (CUDA's own counters are not
    emulated: bench/gpu_suite.py reads them on a GPU.)"""
    patcher, _ = tiny
    slim = _slim(comfy, comfy["model_patcher"].ModelPatcher(patcher.model, gpu, torch.device("cpu")))
    _sample(comfy, slim)
    text = _node(comfy, "SdslimVramReport").execute(model=slim, model_b=patcher).args[0]
    assert "CPU only" not in text and f"device: {gpu.type}\nmemory total" in text, text
    assert "BaseModel (slim): weights" in text and f"on {gpu}" in text
    assert f"s on {gpu}, slim BaseModel" in text and f"{gpu}: no VRAM peak" in text


# ---------------------------------------------------------------------------------- the shipped tiny demo

def test_tiny_demo_node_gives_comfyui_objects_that_match_the_core_pipeline(comfy, caplog):
    """MODEL/CLIP/VAE/CONTROL_NET of the shipped tiny assets, used by ComfyUI's own nodes; each part equals the
    core's diffusers pipeline (a second code path) on the same inputs."""
    from sdslim_core import tiny
    nodes = comfy["nodes"]
    model, clip, vae, control = _node(comfy, "SdslimTinyDemo").execute().args
    pipe = tiny.load_tiny_pipeline()
    prompt = "a red circle on a blue background"
    pos, neg = nodes.CLIPTextEncode().encode(clip, prompt)[0], nodes.CLIPTextEncode().encode(clip, "")[0]
    ctx = pipe.encode_prompt([prompt])
    torch.testing.assert_close(pos[0][0], ctx)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 4, 8, 8, generator=g), torch.tensor([500.0])
    model.patch_model()
    try:
        out = _forward(model, x, t, ctx)
    finally:
        model.unpatch_model()
    with torch.no_grad():
        torch.testing.assert_close(out, pipe.unet(x, t, encoder_hidden_states=ctx).sample, rtol=1e-4, atol=1e-4)
        image = nodes.VAEDecode().decode(vae, {"samples": x})[0]
        torch.testing.assert_close(image, pipe.decode(x * pipe.scaling_factor).movedim(1, -1), rtol=1e-4, atol=1e-4)
    assert model.model.model_config.sdslim_latent_size == 8
    # ComfyUI's own LoRA loader finds and applies the shipped LoRA; the shipped adapter file is offered to Slim UNet
    lora_file = comfy["folder_paths"].get_full_path("loras", "tiny_lora_green.safetensors")
    from safetensors import safe_open
    with safe_open(lora_file, "pt") as f:
        n_modules = sum(k.endswith(".lora_up.weight") for k in f.keys())
    with caplog.at_level(logging.WARNING):
        lora_model, lora_clip = nodes.LoraLoader().load_lora(model, clip, "tiny_lora_green.safetensors", 1.0, 1.0)
    assert len(lora_model.patches) == n_modules and not caplog.records
    assert "tiny_sd15_slim_half.safetensors" in _node(comfy, "SdslimSlimUNet").define_schema().inputs[1].options
    slim = _slim(comfy, lora_model, "tiny_sd15_slim_half.safetensors")
    assert slim.model_size() < 0.8 * model.model_size()
    # the demo images: the LoRA paints green, the mask ControlNet moves the shape onto the mask
    latent = nodes.EmptyLatentImage().generate(64, 64, 1)[0]
    mask = torch.zeros(1, 32, 32, 3)
    mask[:, 2:14, 2:14] = 1
    cpos, cneg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, control, mask, 1.0, 0.0, 1.0)

    def image(m, p, n):
        return nodes.VAEDecode().decode(vae, nodes.common_ksampler(m, 0, 20, 4.0, "euler", "normal", p, n, latent)[0])[0]
    green, controlled = image(slim, pos, neg), image(slim, cpos, cneg)
    plain = image(_slim(comfy, model, "tiny_sd15_slim_half.safetensors"), pos, neg)

    def frac_green(img):
        return ((img[..., 1] > 0.5) & (img[..., 0] < 0.4)).float().mean().item()

    def shape_in_mask(img):      # share of the non-background (non-blue) pixels inside the mask's square
        shape = (img[..., 2] < 0.5) | (img[..., 0] > 0.5) | (img[..., 1] > 0.5)
        return (shape & (mask[..., 0] > 0)).float().sum().item() / max(shape.float().sum().item(), 1)
    assert frac_green(green) > frac_green(plain) + 0.05
    assert shape_in_mask(controlled) > shape_in_mask(green) + 0.2


# ------------------------------------------------------------------------- lifetime under ComfyUI's executor

class _QuietServer:
    """What PromptExecutor needs of the server: no client, messages dropped."""
    client_id = None
    last_node_id = None
    last_prompt_id = None

    def send_sync(self, *args, **kwargs):
        pass


def _demo_graph(enable=True, adapters="tiny_sd15_slim_half.safetensors", strength=1.0, seed=0):
    """Load Tiny Demo Model → LoRA → Slim UNet → LoRA (after it) → KSampler → VAE Decode → Preview Image, plus
    VRAM Report; ComfyUI's built-in nodes only."""
    return {
        "1": {"class_type": "SdslimTinyDemo", "inputs": {}},
        "2": {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "strength_model": 1.0,
                                                     "lora_name": "tiny_lora_green.safetensors", "strength_clip": 1.0}},
        "3": {"class_type": "SdslimSlimUNet", "inputs": {"model": ["2", 0], "adapters": adapters,
                                                         "strength": strength, "enable": enable}},
        "4": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["3", 0], "strength_model": 0.5,
                                                              "lora_name": "tiny_lora_green.safetensors"}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 1],
                                                         "text": "a red circle on a blue background"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 1], "text": ""}},
        "7": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["5", 0], "negative": ["6", 0],
                                                   "latent_image": ["7", 0], "seed": seed, "steps": 2, "cfg": 4.0,
                                                   "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["1", 2]}},
        "10": {"class_type": "PreviewImage", "inputs": {"images": ["9", 0]}},
        "11": {"class_type": "SdslimVramReport", "inputs": {"model": ["4", 0], "trigger": ["8", 0]}},
    }


def test_no_slim_model_outlives_its_graph_in_comfyuis_executor(comfy, monkeypatch, tmp_path):
    """ComfyUI's own PromptExecutor with its default (classic) cache, as the server runs prompts: a slim model
    (its ModelPatcher, the LoRA clone after it, its BaseModel and UNet) lives while ComfyUI caches its node's
    output, and is freed once a prompt with other Slim UNet inputs, or one that passes the MODEL through, has
    run; sdslim itself holds no slim model."""
    import gc
    import uuid
    import weakref

    import execution
    nodes, fp = comfy["nodes"], comfy["folder_paths"]
    monkeypatch.setattr(fp, "temp_directory", str(tmp_path))
    for node_id, cls in {c.define_schema().node_id: c for c in _v3_classes(comfy)}.items():
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node_id, cls)
    folding = importlib.import_module("sdslim_pack.nodes.folding")
    made = []
    real = folding.slim_patcher

    def tracked(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append([weakref.ref(o) for o in (out, out.model, out.model.diffusion_model)])
        return out
    monkeypatch.setattr(folding, "slim_patcher", tracked)
    executor = execution.PromptExecutor(_QuietServer(), cache_type=execution.CacheType.CLASSIC)

    def run(graph):
        executor.execute(graph, str(uuid.uuid4()), {}, ["10", "11"])
        assert executor.success, executor.status_messages[-1]
        gc.collect()
        return [all(r() is not None for r in refs) for refs in made]

    assert run(_demo_graph()) == [True]                       # cached: the slim model of the prompt that ran
    assert run(_demo_graph(seed=1)) == [True]                 # the same Slim UNet inputs: the same slim model
    assert run(_demo_graph(strength=0.5)) == [False, True]    # other inputs: the first one is freed
    assert not any(r() is not None for r in made[0])
    assert run(_demo_graph(enable=False)) == [False, False]   # Slim UNet passes the MODEL through
    assert not any(r() is not None for refs in made for r in refs)
    report = executor.history_result["outputs"]["11"]["text"][0]
    assert "(slim)" not in report                              # ComfyUI lists no slim model as loaded
