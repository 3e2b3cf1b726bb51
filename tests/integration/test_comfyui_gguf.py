"""Slim + GGUF inside a real ComfyUI with the real ComfyUI-GGUF (opt-in).

    COMFYUI_PATH=/path/to/ComfyUI /path/to/comfy-venv/bin/python -m pytest tests/integration/test_comfyui_gguf.py -q

ComfyUI-GGUF is taken from ``$COMFYUI_PATH/custom_nodes/ComfyUI-GGUF`` (or ``COMFYUI_GGUF_PATH``) and loaded the way
ComfyUI loads a custom node pack (``nodes.load_custom_node``); its requirements (``gguf``) must be installed in
ComfyUI's Python. Without it only the missing-pack message is tested. The model is the shipped tiny SD1.5-structure
teacher, its LoRA and its slim adapters; ``.gguf`` files are written by sdslim's writer. References: the gguf
package's own dequantisation in a diffusers UNet (``sdslim_core.modules.unet.load_gguf_unet``) and the LoRA's
slim-space delta computed by the core in float32, a second code path.
"""
import asyncio
import importlib
import importlib.util
import os
import sys

import pytest
import torch

COMFY = os.environ.get("COMFYUI_PATH")
GGUF_PACK = os.environ.get("COMFYUI_GGUF_PATH") or (os.path.join(COMFY, "custom_nodes", "ComfyUI-GGUF") if COMFY
                                                    else "")
pytestmark = pytest.mark.skipif(not COMFY, reason="set COMFYUI_PATH to run against a real ComfyUI")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOADER = "SdslimLoadSlimGGUF"


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI imported on CPU with the sdslim pack loaded as ComfyUI loads custom nodes."""
    sys.path.insert(0, COMFY)
    if not hasattr(sys.modules.get("nodes"), "NODE_CLASS_MAPPINGS"):
        sys.modules.pop("nodes", None)     # the repo's nodes/ package must not shadow ComfyUI's nodes.py
    from comfy.cli_args import args
    args.cpu = True
    import comfy.model_management  # noqa: F401
    import comfy.sd
    import comfy.supported_models
    import folder_paths
    import nodes
    name = "sdslim_pack_gguf"              # its own module tree: test_comfyui_real.py loads the pack afresh too
    pack = sys.modules.get(name)
    if pack is None:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "__init__.py"),
                                                      submodule_search_locations=[ROOT])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[name] = pack
        spec.loader.exec_module(pack)
    return {"pack": pack, "nodes": nodes, "folder_paths": folder_paths, "sd": comfy.sd,
            "supported_models": comfy.supported_models}


def _node(comfy, node_id):
    ext = asyncio.run(comfy["pack"].comfy_entrypoint())
    return {c.define_schema().node_id: c for c in asyncio.run(ext.get_node_list())}[node_id]


@pytest.fixture(scope="module")
def gguf_pack(comfy):
    """ComfyUI-GGUF's modules, the pack loaded by ComfyUI's own custom-node loader."""
    if not os.path.isfile(os.path.join(GGUF_PACK, "__init__.py")):
        pytest.skip(f"ComfyUI-GGUF not found at {GGUF_PACK!r} (set COMFYUI_GGUF_PATH)")
    pytest.importorskip("gguf")
    nodes = comfy["nodes"]
    if "UnetLoaderGGUF" not in nodes.NODE_CLASS_MAPPINGS:
        assert asyncio.run(nodes.load_custom_node(GGUF_PACK)), "ComfyUI failed to load ComfyUI-GGUF"
    cls = nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]
    package = sys.modules[cls.__module__].__package__
    return {"loader_node": cls, "nodes": sys.modules[cls.__module__], "ops": sys.modules[package + ".ops"],
            "dequant": sys.modules[package + ".dequant"]}


@pytest.fixture(scope="module")
def files(comfy, tmp_path_factory):
    """models/unet (diffusion_models) with the tiny teacher and its slim form written as GGUF by sdslim; ComfyUI
    told the tiny UNet's config (its detection knows SD1.5 by 320 base channels) and latent scale."""
    pytest.importorskip("gguf")
    from sdslim_core import tiny
    from sdslim_core.apps import slim as core_slim
    from sdslim_core.io.tensors import LazyStateDict
    latent_formats = importlib.import_module("comfy.latent_formats")
    model_detection = importlib.import_module("comfy.model_detection")
    folder = tmp_path_factory.mktemp("unet")
    half = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
    for q in ("Q8_0", "Q4_0"):
        core_slim.slim_checkpoint(tiny.DEFAULT_PATH, None, folder / f"teacher-{q}.gguf", quant=q)
        core_slim.slim_checkpoint(tiny.DEFAULT_PATH, half, folder / f"slim-{q}.gguf", quant=q)
    core_slim.slim_checkpoint(tiny.DEFAULT_PATH, half, folder / "slim-Q8_0-embedded.gguf", quant="Q8_0",
                              embed_adapters=True)
    comfy["folder_paths"].add_model_folder_path("diffusion_models", str(folder), is_default=True)
    lazy = LazyStateDict(tiny.DEFAULT_PATH)
    sd = {k: lazy[k] for k in lazy if k.startswith("model.diffusion_model.")}
    found = model_detection.detect_unet_config(sd, "model.diffusion_model.")
    scale = tiny.load_tiny_pipeline().scaling_factor
    sm = comfy["supported_models"]

    class TinySD15(sm.SD15):
        unet_config = {k: found[k] for k in ("context_dim", "model_channels", "use_linear_in_transformer",
                                             "adm_in_channels", "use_temporal_attention")}

        def __init__(self, unet_config):
            super().__init__(unet_config)
            self.latent_format = latent_formats.SD15(scale_factor=scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sm, "models", [TinySD15] + list(sm.models))
        yield folder, half


@pytest.fixture(scope="module")
def teacher(comfy):
    """(MODEL, CLIP, VAE) of the shipped tiny teacher (the pack's Tiny Demo node) and the probes: the (x, t,
    context) its own CFG sampling trajectories visit (the fidelity engine's, as the ladder measures them)."""
    from sdslim_core import tiny
    from sdslim_core.apps import fidelity
    from sdslim_core.apps.demo import PROMPTS_SEED
    from sdslim_core.ops.sampling import diffusers_fn
    from sdslim_core.tiny import data as tiny_data
    model, clip, vae, _ = _node(comfy, "SdslimTinyDemo").execute().args
    pipe = tiny.load_tiny_pipeline()
    captions = tiny_data.make_batch(PROMPTS_SEED, 0, 6).captions
    probe = fidelity.Probe(fn_of=diffusers_fn, context=pipe.encode_prompt(captions),
                           uncond=pipe.encode_prompt([""] * len(captions)), noise=pipe.noise(len(captions), 7),
                           schedule=pipe.schedule, steps=20, guidance=4.0, eps_points=5)
    inputs = fidelity.reference(probe, pipe.unet).inputs
    probes = [(x, t.flatten().expand(x.shape[0]).float(), c) for x, t, c in inputs]
    return model, clip, vae, probes


def _eps(model, probes):
    model.patch_model()
    try:
        with torch.no_grad():
            return torch.cat([model.model.diffusion_model(x, t, context=c) for x, t, c in probes])
    finally:
        model.unpatch_model()


def _diffusers_eps(unet, probes):
    with torch.no_grad():
        return torch.cat([unet(x, t, encoder_hidden_states=c).sample for x, t, c in probes])


def _dequantised(path):
    """(canonical weights, config) of a ``.gguf`` as ComfyUI-GGUF computes them by default: the gguf package's
    dequantisation rounded to float16 (ComfyUI-GGUF multiplies a block's fp16 scale by its integers in float16
    unless its Advanced loader is given another dequant dtype; for Q8_0 and Q4_0 that is exactly this rounding)."""
    from sdslim_core.io import gguf as io_gguf
    weights, cfg, _ = io_gguf.read_unet(path)
    types = io_gguf.GGUFFile(path).types
    return {k: v.half().float() if types[k] not in ("F32", "F16") else v for k, v in weights.items()}, cfg


def _unet(weights, cfg, norm_groups=None):
    from sdslim_core.modules.unet import load_diffusers_unet
    return load_diffusers_unet(weights, cfg, norm_groups=norm_groups).eval()


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


# --------------------------------------------------------------------------------------------------------- tests

def test_without_comfyui_gguf_the_node_names_it(comfy, monkeypatch):
    monkeypatch.delitem(comfy["nodes"].NODE_CLASS_MAPPINGS, "UnetLoaderGGUF", raising=False)
    with pytest.raises(ValueError, match=r"needs the ComfyUI-GGUF custom nodes \(city96/ComfyUI-GGUF\)"):
        _node(comfy, LOADER).execute(unet_name="any-slim-Q8_0.gguf")


def test_comfyui_gguf_reads_sdslims_files_as_the_gguf_package_does_but_cannot_load_a_slim_one(comfy, files,
                                                                                             gguf_pack, teacher):
    folder, _ = files
    probes = teacher[3]
    (full,) = gguf_pack["loader_node"]().load_unet("teacher-Q8_0.gguf")
    torch.testing.assert_close(_eps(full, probes), _diffusers_eps(_unet(*_dequantised(folder / "teacher-Q8_0.gguf")),
                                                                  probes), rtol=1e-4, atol=1e-5)
    assert _rel(_eps(full, probes), _eps(teacher[0], probes)) < 0.05       # Q8_0 of the teacher, not another model
    with pytest.raises(RuntimeError, match="size mismatch"):
        gguf_pack["loader_node"]().load_unet("slim-Q8_0.gguf")
    # Slim UNet on ComfyUI-GGUF's MODEL: refused, saying how to stack slim with GGUF
    with pytest.raises(ValueError, match=r"GGUF-quantised \(Q8_0.*sdslim slim --ckpt .* --format gguf"):
        _node(comfy, "SdslimSlimUNet").execute(model=full, adapters="tiny_sd15_slim_half.safetensors", strength=1.0,
                                               enable=True)


def test_load_slim_gguf_keeps_the_weights_quantised_and_computes_what_the_gguf_package_reads(comfy, files, gguf_pack,
                                                                                            teacher):
    from sdslim_core.io import gguf as io_gguf
    folder, half = files
    node = _node(comfy, LOADER)
    options = node.define_schema().inputs[0].options
    assert {"slim-Q8_0.gguf", "slim-Q4_0.gguf"} <= set(options) and "teacher-Q8_0.gguf" not in options
    probes = teacher[3]
    for q in ("Q8_0", "Q4_0"):
        (model,) = node.execute(unet_name=f"slim-{q}.gguf").args
        assert isinstance(model, gguf_pack["nodes"].GGUFModelPatcher)
        assert isinstance(model, comfy["pack"].nodes.patches.SlimPatcher)
        clone = model.clone()
        assert type(clone) is type(model) and clone.model.sdslim_info.space is not None
        unet = model.model.diffusion_model
        conv = unet.get_submodule("input_blocks.1.0.in_layers.2").weight
        assert gguf_pack["dequant"].is_quantized(conv) and conv.tensor_type.name == q
        meta = io_gguf.read_slim(folder / f"slim-{q}.gguf")[3]
        for site, groups in meta["sdslim.norm_groups"].items():
            norm = unet.get_submodule(f"{site}.out_layers.0")
            assert (norm.num_groups, norm.num_channels) == (groups, meta["sdslim.ranks"][site]), site
        weights, cfg = _dequantised(folder / f"slim-{q}.gguf")
        torch.testing.assert_close(_eps(model, probes), _diffusers_eps(_unet(weights, cfg, meta["sdslim.norm_groups"]),
                                                                      probes), rtol=1e-4, atol=1e-5)
    (full,) = gguf_pack["loader_node"]().load_unet("teacher-Q4_0.gguf")
    assert model.model_size() < full.model_size()


def test_loras_after_load_slim_gguf_equal_loras_before_it_within_the_formats_error(comfy, files, gguf_pack, teacher,
                                                                                  capsys):
    """ComfyUI's LoRA loader after Load Slim GGUF: the LoRA is converted into slim space and ComfyUI-GGUF adds it
    to the dequantised weights — exactly the core's slim-space delta on the gguf package's dequantisation; against
    the LoRA merged before the fold (full precision) it differs by what the format differs; its effect keeps the
    teacher's direction (the goal for Q8_0: LoRA-effect cosine >= 0.99)."""
    from sdslim_core import layout, tiny
    from sdslim_core.apps.fidelity import Candidates
    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.ops import lora
    folder, half = files
    model_t, _, _, probes = teacher
    loader = comfy["nodes"].LoraLoaderModelOnly()
    lora_name = "tiny_lora_green.safetensors"
    eps_t = _eps(model_t, probes)
    eps_t_lora = _eps(loader.load_lora_model_only(model_t, lora_name, 1.0)[0], probes)
    slim_node = _node(comfy, "SdslimSlimUNet")
    (slim,) = slim_node.execute(model=model_t, adapters="tiny_sd15_slim_half.safetensors", strength=1.0,
                                enable=True).args
    (slim_before,) = slim_node.execute(model=loader.load_lora_model_only(model_t, lora_name, 1.0)[0],
                                       adapters="tiny_sd15_slim_half.safetensors", strength=1.0, enable=True).args
    eps_s, eps_s_before = _eps(slim, probes), _eps(slim_before, probes)
    # the core's second code path: the gguf package's dequantised weights + the fold's LoRA delta, in diffusers
    pipe = tiny.load_tiny_pipeline()
    weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
    merged, _ = lora.merge_loras(weights, [(tiny.LORA_PATH, 1.0)], pipe.checkpoint.config)
    cands = Candidates(pipe.checkpoint.config, weights, merged)
    cosines = {}
    for q in ("Q8_0", "Q4_0"):
        (model,) = _node(comfy, LOADER).execute(unet_name=f"slim-{q}.gguf").args
        (after,) = loader.load_lora_model_only(model, lora_name, 1.0)
        assert type(after) is type(model)
        eps_q, eps_after = _eps(model, probes), _eps(after, probes)
        stored, _ = _dequantised(folder / f"slim-{q}.gguf")
        _, reference = cands.from_file(stored, AdapterSet.load(half))
        torch.testing.assert_close(eps_after, _diffusers_eps(reference, probes), rtol=1e-4, atol=5e-5)
        format_error = _rel(eps_q, eps_s)                 # what the format costs without the LoRA
        after_vs_before = _rel(eps_after, eps_s_before)
        assert 0 < after_vs_before < 1.5 * format_error + 1e-4, (q, after_vs_before, format_error)
        assert _rel(eps_after - eps_q, eps_s_before - eps_s) < 3 * format_error   # the LoRA's effect: off by
        cosines[q] = _cos(eps_after - eps_q, eps_t_lora - eps_t)                  # the format's order, no more
        with capsys.disabled():
            print(f"\nslim + {q} in ComfyUI-GGUF: LoRA-effect cosine vs the teacher's {cosines[q]:.4f}; "
                  f"LoRA after vs before {after_vs_before:.4f} (format alone {format_error:.4f}); "
                  f"slim (fp32) LoRA-effect cosine {_cos(eps_s_before - eps_s, eps_t_lora - eps_t):.4f}")
    assert cosines["Q8_0"] >= 0.99
    assert layout.COMFY_PREFIX + "input_blocks.1.1.transformer_blocks.0.ff.net.0.proj.weight" in after.patches


def test_sampling_the_slim_gguf_with_a_lora_in_ksampler(comfy, files, gguf_pack, teacher, caplog, capsys):
    import logging
    from sdslim_core.apps.fidelity import psnr
    model_t, clip, vae, _ = teacher
    nodes = comfy["nodes"]
    pos = nodes.CLIPTextEncode().encode(clip, "a red circle on a blue background")[0]
    neg = nodes.CLIPTextEncode().encode(clip, "")[0]
    latent = nodes.EmptyLatentImage().generate(64, 64, 2)[0]
    loader = nodes.LoraLoaderModelOnly()

    def image(m):
        return nodes.VAEDecode().decode(vae, nodes.common_ksampler(m, 0, 12, 4.0, "euler", "normal", pos, neg,
                                                                   latent)[0])[0]
    want = image(loader.load_lora_model_only(model_t, "tiny_lora_green.safetensors", 1.0)[0])
    (model,) = _node(comfy, LOADER).execute(unet_name="slim-Q8_0.gguf").args
    with caplog.at_level(logging.WARNING):
        got = image(loader.load_lora_model_only(model, "tiny_lora_green.safetensors", 1.0)[0])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert got.shape == want.shape and torch.isfinite(got).all()
    db = psnr(got, want, peak=1.0)
    with capsys.disabled():
        print(f"\nKSampler, 12 steps, 2 images: slim + Q8_0 + LoRA vs teacher + LoRA image PSNR {db:.1f} dB")
    assert db > 20


def test_compact_embedded_adapters_keep_the_loras_effect(comfy, files, gguf_pack, teacher, monkeypatch, capsys):
    """The same slim Q8_0 UNet with its adapters embedded as Q8_0 and without them (the adapter file found by its
    sha256 in models/sdslim, with an empty hash index): LoRA-effect cosine between the two >= 0.999."""
    import tempfile
    monkeypatch.setenv("SDSLIM_CACHE_DIR", tempfile.mkdtemp(prefix="sdslim-index-"))
    probes = teacher[3]
    loader = comfy["nodes"].LoraLoaderModelOnly()
    effects = {}
    for name in ("slim-Q8_0.gguf", "slim-Q8_0-embedded.gguf"):
        (model,) = _node(comfy, LOADER).execute(unet_name=name).args
        (after,) = loader.load_lora_model_only(model, "tiny_lora_green.safetensors", 1.0)
        effects[name] = _eps(after, probes) - _eps(model, probes)
    cos = _cos(effects["slim-Q8_0-embedded.gguf"], effects["slim-Q8_0.gguf"])
    with capsys.disabled():
        print(f"\nQ8_0 embedded adapters vs the float32 adapter file, ComfyUI-GGUF: LoRA-effect cosine {cos:.6f}")
    assert cos >= 0.999


def test_a_lora_after_load_slim_gguf_is_applied_on_a_gpu(comfy, files, gguf_pack, teacher):
    """Guards Load Slim GGUF + a LoRA with a GPU: ComfyUI-GGUF keeps the LoRA's patches (sdslim's slim-space
    conversion) beside each quantised weight and, every forward, applies them where it dequantised it
    (``GGMLLayer.get_weight``: ``move_patch_to_device``, then ``comfy.lora.calculate_weight``). tests/
    emulated_device.py's device cannot hold ComfyUI-GGUF's own tensor subclass (GGMLTensor), so each patched
    weight is dequantised on the CPU by ComfyUI-GGUF and handed, with the patches ComfyUI-GGUF attached to it, to
    its ``get_weight`` on the device: the weights it computes there equal the CPU's, folded layers included."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from emulated_device import emulated_device
    sys.path.pop(0)
    import comfy.model_management as mm
    (model,) = _node(comfy, LOADER).execute(unet_name="slim-Q8_0.gguf").args
    (after,) = comfy["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, "tiny_lora_green.safetensors", 1.0)
    mm.load_models_gpu([after])                   # ComfyUI-GGUF attaches the patches to the quantised weights
    try:
        layers = {n: m for n, m in after.model.diffusion_model.named_modules()
                  if getattr(getattr(m, "weight", None), "patches", None)}
        folded = "input_blocks.1.1.transformer_blocks.0.ff.net.0.proj"
        want = {n: layer.get_weight(layer.weight, torch.float32) for n, layer in layers.items()}
        plain = {n: torch.Tensor.as_subclass(gguf_pack["dequant"].dequantize_tensor(layer.weight, torch.float32),
                                             torch.Tensor) for n, layer in layers.items()}
        assert (want[folded] - plain[folded]).abs().max() > 1e-3                     # the LoRA acts on it
        with emulated_device() as dev:
            for name, layer in layers.items():
                on_dev = plain[name].to(dev)
                on_dev.patches = layer.weight.patches
                got = layer.get_weight(on_dev, torch.float32)
                assert got.device == dev
                torch.testing.assert_close(got.cpu(), want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    finally:
        mm.unload_all_models()


def test_save_slim_gguf_writes_what_load_slim_gguf_reads(comfy, files, gguf_pack, teacher):
    """Tiny teacher → Slim UNet → LoRA → Save Slim GGUF (Q8_0) → Load Slim GGUF: the file holds the slim UNet with
    the LoRA, quantised by the gguf package (checked against its own dequantisation), marked slim, no adapters. The
    teacher's UNet is loaded by ComfyUI's own loader here (the Tiny Demo node's MODEL is refused by the Save nodes:
    without this module's detection of the tiny UNet, ComfyUI cannot load what they would write)."""
    from sdslim_core import tiny
    from sdslim_core.io import gguf as io_gguf
    from sdslim_core.io.tensors import LazyStateDict
    folder, _ = files
    _, _, _, probes = teacher
    lazy = LazyStateDict(tiny.DEFAULT_PATH)
    model_t = comfy["sd"].load_diffusion_model_state_dict({k: lazy[k] for k in lazy
                                                           if k.startswith("model.diffusion_model.")})
    (slim,) = _node(comfy, "SdslimSlimUNet").execute(model=model_t, adapters="tiny_sd15_slim_half.safetensors",
                                                     strength=1.0, enable=True).args
    (with_lora,) = comfy["nodes"].LoraLoaderModelOnly().load_lora_model_only(slim, "tiny_lora_green.safetensors", 1.0)
    save = _node(comfy, "SdslimSaveSlimGGUF")
    save.execute(model=with_lora, filename="saved/slim_lora", quant="Q8_0", overwrite=False, embed_adapters=False)
    path = folder / "saved" / "slim_lora.gguf"
    assert path.is_file() and io_gguf.is_slim_gguf(path)
    f, _, _, meta = io_gguf.read_slim(path)
    assert not [k for k in f if k.startswith("sdslim.")] and meta["sdslim.gguf_type"] == "Q8_0"
    assert meta["sdslim.loras"][-1]["applied"] == "in slim space"
    (loaded,) = _node(comfy, LOADER).execute(unet_name="saved/slim_lora.gguf").args
    weights, cfg = _dequantised(path)
    torch.testing.assert_close(_eps(loaded, probes), _diffusers_eps(_unet(weights, cfg, meta["sdslim.norm_groups"]),
                                                                   probes), rtol=1e-4, atol=1e-5)
    assert _rel(_eps(loaded, probes), _eps(with_lora, probes)) < 0.02            # Q8_0 of the LoRA-ed slim model
    with pytest.raises(ValueError, match="exists"):
        save.execute(model=with_lora, filename="saved/slim_lora", quant="Q8_0", overwrite=False, embed_adapters=False)
    with pytest.raises(ValueError, match="GGUF-quantised"):
        save.execute(model=loaded, filename="saved/again", quant="Q4_0", overwrite=False, embed_adapters=False)
