"""ComfyUI node logic without ComfyUI: the pack runs against tests/comfy_standin (checked against the recorded
real signatures in test_comfy_standin.py). References are float64 formulas or a second code path."""
import copy
import importlib
import importlib.util
import logging
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from conftest import ldm_unet, randomize_, tiny_config
from emulated_device import accelerators, on
from sdslim_core import layout
from sdslim_core.io import adapters, files
from sdslim_core.layout import rank_policy
from sdslim_core.ops import breakdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "comfy_standin")
FF = "input_blocks.1.1.transformer_blocks.0.ff"
RES = "input_blocks.1.0"


@pytest.fixture(scope="module")
def pack():
    """The pack's ``nodes`` package imported against the stand-in; sys.modules/sys.path restored afterwards."""
    saved_path = list(sys.path)
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("comfy", "folder_paths", "reference")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, STANDIN)
    spec = importlib.util.spec_from_file_location("sdslim_nodes_under_test", os.path.join(ROOT, "nodes", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(ROOT, "nodes")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pkg
    spec.loader.exec_module(pkg)
    mods = {name: importlib.import_module(f"{spec.name}.{name}")
            for name in ("paths", "specs", "v1", "folding", "monitor", "patches", "report")}
    mods["comfy"] = importlib.import_module("comfy.model_management"), importlib.import_module("comfy.utils")
    mods["folder_paths"] = importlib.import_module("folder_paths")
    mods["fold64"] = importlib.import_module("reference").fold64
    yield types.SimpleNamespace(**mods)
    for k in [k for k in sys.modules if k.split(".")[0] in ("comfy", "folder_paths", "reference", spec.name)]:
        del sys.modules[k]
    sys.modules.update(saved)
    sys.path[:] = saved_path


def _comfy_classes(unet, ops):
    """Give the LDM layers ComfyUI's op classes (the stand-in's) and their forward (cast per layer when ComfyUI says),
    as ComfyUI builds them."""
    for m in unet.modules():
        for plain, op in ((torch.nn.Linear, ops.disable_weight_init.Linear), (torch.nn.Conv2d, ops.disable_weight_init.Conv2d),
                          (torch.nn.GroupNorm, ops.disable_weight_init.GroupNorm),
                          (torch.nn.LayerNorm, ops.disable_weight_init.LayerNorm)):
            if isinstance(m, plain) and not hasattr(m, "comfy_cast_weights"):
                m.__class__ = op
                m.__dict__.pop("forward", None)          # ldm_unet's float64 GroupNorm forward
    return unet


@pytest.fixture
def model(pack):
    """(stand-in ModelPatcher over a tiny float64 LDM UNet, canonical weights copy)."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.ops
    torch.manual_seed(0)
    unet = _comfy_classes(randomize_(ldm_unet(tiny_config())).eval(), comfy.ops)
    base = comfy.model_base.BaseModel()
    base.diffusion_model = unet
    base.model_sampling = torch.nn.Module()
    weights = {k: v.clone() for k, v in unet.state_dict().items()}
    return comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu")), weights


def _aset(weights, ratio, seed=1):
    ranks = rank_policy.ranks_for_ratio(layout.sites(weights), ratio)
    aset = adapters.AdapterSet.init_select(weights, ranks, "sd15")
    if ratio < 1:
        g = torch.Generator().manual_seed(seed)
        for t in aset.sites.values():
            for n in t:
                t[n] = (t[n] + 0.05 * torch.randn(t[n].shape, generator=g, dtype=torch.float64)).to(t[n].dtype)
    return aset


def _forward(unet, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 16, 16, generator=g, dtype=torch.float64)
    ctx = torch.randn(1, 5, 64, generator=g, dtype=torch.float64)
    with torch.no_grad():
        return unet(x, torch.tensor([300.0]), context=ctx)


# ---------------------------------------------------------------------------------------- registration

def test_root_init_is_inert_without_comfyui():
    code = ("import importlib, importlib.util, sys\n"
            "m = importlib.import_module('__init__')\n"
            "spec = importlib.util.spec_from_file_location('pack', '__init__.py', submodule_search_locations=['.'])\n"
            "p = importlib.util.module_from_spec(spec); sys.modules['pack'] = p; spec.loader.exec_module(p)\n"
            "for mod in (m, p):\n"
            "    assert mod.NODE_CLASS_MAPPINGS is None and not hasattr(mod, 'comfy_entrypoint')\n"
            "heavy = [k for k in ('torch', 'comfy', 'folder_paths', 'sdslim_core') if k in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_folder_registration_keeps_yaml_paths_and_is_idempotent(pack, tmp_path):
    fp = pack.folder_paths
    fp.models_dir = str(tmp_path / "models")
    fp.folder_names_and_paths.clear()
    fp.folder_names_and_paths["sdslim"] = ([str(tmp_path / "yaml")], set())        # from extra_model_paths.yaml
    default = os.path.join(fp.models_dir, "sdslim")
    assert pack.paths.register(fp) == [str(tmp_path / "yaml"), default]
    assert pack.paths.register(fp) == [str(tmp_path / "yaml"), default]
    assert fp.folder_names_and_paths["sdslim"][1] == {".safetensors"}
    fp.folder_names_and_paths.clear()
    assert pack.paths.register(fp) == [default]


def _adapter_file(path):
    adapters.AdapterSet(family="sd15", sites={}, source=str(path)).save(path)


def test_adapter_lookup_and_output_names(pack, tmp_path):
    fp = pack.folder_paths
    fp.folder_names_and_paths.clear()
    fp.folder_names_and_paths["sdslim"] = ([str(tmp_path)], {".safetensors"})
    _adapter_file(tmp_path / "a.safetensors")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty.safetensors").write_bytes(b"")                       # not a safetensors file
    from safetensors.torch import save_file
    save_file({"lora_unet_x.lora_up.weight": torch.zeros(2, 2)}, str(tmp_path / "lora.safetensors"))
    (tmp_path / "old.safetensors.work").mkdir()                              # a work folder of an older version
    _adapter_file(tmp_path / "old.safetensors.work" / "init.safetensors")
    assert pack.paths.adapter_files(fp) == ["a.safetensors"]
    assert pack.paths.work_dir(fp, pack.paths.output_path(fp, "sub/m")) == str(
        tmp_path.parent / "sdslim_work" / "sub" / "m.safetensors.work")
    assert pack.paths.resolve(fp, "a.safetensors") == str(tmp_path / "a.safetensors")
    with pytest.raises(FileNotFoundError, match=r"'b\.safetensors' not found in models/sdslim.*" + str(tmp_path)):
        pack.paths.resolve(fp, "b.safetensors")
    assert pack.paths.output_path(fp, "mine") == str(tmp_path / "mine.safetensors")
    for bad in ("", "../x", "/abs/x", "a/../../x"):
        with pytest.raises(ValueError, match="relative name inside models/sdslim"):
            pack.paths.output_path(fp, bad)


def test_v1_classes_follow_the_specs(pack, tmp_path):
    fp = pack.folder_paths
    fp.folder_names_and_paths.clear()
    fp.folder_names_and_paths["sdslim"] = ([str(tmp_path)], {".safetensors"})
    _adapter_file(tmp_path / "half.safetensors")
    classes = {s.node_id: pack.v1.node_class(s) for s in pack.specs.SPECS}
    slim = classes["SdslimSlimUNet"].INPUT_TYPES()
    assert list(slim["required"]) == ["model", "adapters", "strength", "enable"]
    assert slim["required"]["adapters"][0] == ["half.safetensors"]
    assert slim["required"]["strength"] == ("FLOAT", {"tooltip": slim["required"]["strength"][1]["tooltip"],
                                                      "default": 1.0, "min": 0.0, "max": 1.0, "step": 0.05})
    assert classes["SdslimSlimUNet"].RETURN_TYPES == ("MODEL",) and not classes["SdslimSlimUNet"].OUTPUT_NODE
    report = classes["SdslimVramReport"]
    assert report.OUTPUT_NODE and math.isnan(report.IS_CHANGED())
    assert not any(hasattr(c, "IS_CHANGED") for n, c in classes.items() if n != "SdslimVramReport")
    trigger = report.INPUT_TYPES()["optional"]["trigger"][0]
    assert not (trigger != "LATENT") and not (trigger != "IMAGE")          # the wildcard matches any type

    class Echo(pack.specs.NodeSpec):
        def run(self, **inputs):
            return pack.specs.Result((inputs["x"] * 2,), f"x={inputs['x']}")
    echo = pack.v1.node_class(Echo("E", "E", "", (pack.specs.In("x", "INT", 1),), (pack.specs.Out("INT", "y"),), ""))
    assert echo().run(x=4) == {"ui": {"text": ["x=4"]}, "result": (8,)}


# ------------------------------------------------------------------------------------------------ folding

def test_slim_equals_float64_reference_after_lora_and_leaves_input_untouched(pack, model):
    patcher, weights = model
    g = torch.Generator().manual_seed(5)
    lora = {k: 0.05 * torch.randn(weights[k].shape, generator=g, dtype=torch.float64)
            for k in (f"{FF}.net.0.proj.weight", f"{RES}.in_layers.2.weight", f"{RES}.out_layers.0.weight",
                      f"{FF}.net.2.bias", "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight")}
    with_lora = patcher.clone()
    with_lora.add_patches({"diffusion_model." + k: ("diff", (d,)) for k, d in lora.items()}, 0.7)
    with_lora.model_options["transformer_options"]["mine"] = [1]
    before = {k: v.clone() for k, v in with_lora.model.state_dict().items()}
    patches_before = {k: list(v) for k, v in with_lora.patches.items()}
    aset = _aset(weights, 0.5)
    seen = []
    slim = pack.folding.slim_patcher(with_lora, aset, progress=lambda d, n: seen.append((d, n)))

    assert seen == [(i + 1, len(aset.sites)) for i in range(len(aset.sites))]
    deltas = {k: 0.7 * d for k, d in lora.items()}
    got = slim.model.diffusion_model.state_dict()
    for site in aset.sites:
        for key, ref in pack.fold64(weights, aset.sites[site], site, aset.kind(site), deltas).items():
            torch.testing.assert_close(got[key], ref, rtol=1e-9, atol=1e-10, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(got[f"{FF}.net.2.bias"], weights[f"{FF}.net.2.bias"] + deltas[f"{FF}.net.2.bias"])
    # unslimmed keys keep their patches (lazy), norm2's patch is dropped, options/wrappers carried
    assert list(slim.patches) == ["diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"]
    assert slim.model_options["transformer_options"]["mine"] == [1]
    assert slim.model_options is not with_lora.model_options
    assert "sdslim" in slim.wrappers["outer_sample"] and "outer_sample" not in with_lora.wrappers
    # built from the op classes, ResBlock still the LDM ResBlock, GroupNorm' with the adapter's groups
    res = slim.model.diffusion_model.input_blocks[1][0]
    assert type(res).__name__ == "ResBlock" and res is not with_lora.model.diffusion_model.input_blocks[1][0]
    norm = res.out_layers[0]
    assert hasattr(norm, "comfy_cast_weights") and norm.num_groups == aset.groups(RES)
    assert norm.num_channels == aset.rank(RES)
    # the input: same tensors, same patches, same model object, untouched modules not shared
    for k, v in with_lora.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert {k: list(v) for k, v in with_lora.patches.items()} == patches_before
    assert slim.model is not with_lora.model
    shared = {id(p) for p in with_lora.model.parameters()} & {id(p) for p in slim.model.parameters()}
    assert not shared
    assert slim.model.sdslim_info.slim_keys and slim.model_size() < with_lora.model_size()


def test_full_width_adapters_reproduce_the_patched_model(pack, model):
    """Second code path: the LoRA-patched original's forward (weights patched by hand) vs the slim model's."""
    patcher, weights = model
    g = torch.Generator().manual_seed(8)
    delta = 0.05 * torch.randn(weights[f"{FF}.net.0.proj.weight"].shape, generator=g, dtype=torch.float64)
    with_lora = patcher.clone()
    with_lora.add_patches({f"diffusion_model.{FF}.net.0.proj.weight": ("diff", (delta,))})
    slim = pack.folding.slim_patcher(with_lora, _aset(weights, 1.0))
    ref_unet = copy.deepcopy(patcher.model.diffusion_model)
    with torch.no_grad():
        ref_unet.get_submodule(f"{FF}.net.0.proj").weight += delta
    torch.testing.assert_close(_forward(slim.model.diffusion_model), _forward(ref_unet), rtol=1e-9, atol=1e-9)


def test_interrupt_stops_the_fold_and_changes_nothing(pack, model):
    patcher, weights = model
    mm, utils = pack.comfy
    before = {k: v.clone() for k, v in patcher.model.state_dict().items()}
    mm.CHECKS.clear()
    mm.INTERRUPT["after"] = 3
    try:
        with pytest.raises(mm.InterruptProcessingException):
            pack.folding.slim_patcher(patcher, _aset(weights, 0.5))
    finally:
        mm.INTERRUPT["after"] = None
    assert len(mm.CHECKS) == 4
    assert all(torch.equal(v, before[k]) for k, v in patcher.model.state_dict().items())


def test_refuses_quantised_weights_and_foreign_adapters(pack, model):
    patcher, weights = model
    key = f"diffusion_model.{FF}.net.2.weight"
    quant = patcher.clone()
    kp = patcher.get_key_patches("diffusion_model.")
    kp[key] = [(torch.zeros(kp[key][0][0].shape, dtype=torch.uint8), kp[key][0][1])]
    quant.get_key_patches = lambda prefix=None: kp
    with pytest.raises(pack.folding.SlimError, match=f"'{key}'.*uint8.*quantised"):
        pack.folding.slim_patcher(quant, _aset(weights, 0.5))
    sdxl = adapters.AdapterSet(family="sdxl", sites={}, source="x.safetensors")
    with pytest.raises(adapters.AdapterError, match=r"x\.safetensors.*sdxl.*sd15"):
        pack.folding.slim_patcher(patcher, sdxl)
    other = {k: v for k, v in weights.items()}
    other[f"{FF}.net.2.weight"] = torch.zeros(64, 64, dtype=torch.float64)      # width 64, model has 128
    other[f"{FF}.net.0.proj.weight"] = torch.zeros(128, 64, dtype=torch.float64)
    wrong = adapters.AdapterSet.init_select(other, {FF: 32}, "sd15")
    with pytest.raises(adapters.AdapterError, match=f"{FF}.*width 64.*128"):
        pack.folding.slim_patcher(patcher, wrong)


# ------------------------------------------------------------------------------------------------ monitor

class HookRef:
    pass


class Hook:
    def __init__(self):
        self.hook_ref = HookRef()


def _with_intercept(aset, seed=4):
    """``aset`` with an FF intercept (``up_bias``) on every FF site."""
    g = torch.Generator().manual_seed(seed)
    for site, t in aset.sites.items():
        if "down_value" in t:
            t["up_bias"] = 0.3 * torch.randn(t["up"].shape[0], generator=g, dtype=torch.float64)
    return aset


def _late_loras(pack, weights, g):
    """Patches made for the full-size model, as ComfyUI's LoRA loader makes them (key → value), and their float64
    ΔW per canonical key (strength 1): a LoRA on the GEGLU proj and on net.2 (under the intercept), a 3×3 LoCon on
    conv1, a LoHa on conv2, a LoKr on emb, a full diff on a proj bias, and a LoRA on attention (not folded)."""
    import comfy.weight_adapter as wa

    def r(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)
    proj, out, conv1, conv2, emb = (f"{FF}.net.0.proj", f"{FF}.net.2", f"{RES}.in_layers.2", f"{RES}.out_layers.3",
                                    f"{RES}.emb_layers.1")
    attn = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    patches, deltas = {}, {}
    for layer, rank, alpha in ((proj, 4, 2.0), (out, 3, None), (conv1, 2, 1.0), (attn, 2, 4.0)):
        w = weights[layer + ".weight"]
        up, down = r(w.shape[0], rank, *([1, 1] if w.ndim == 4 else [])), r(rank, *w.shape[1:])
        patches[f"diffusion_model.{layer}.weight"] = wa.LoRAAdapter(set(), (up, down, alpha, None, None, None))
        deltas[layer + ".weight"] = (1.0 if alpha is None else alpha / rank) * (up.flatten(1) @ down.flatten(1)
                                                                                ).reshape(w.shape)
    w = weights[conv2 + ".weight"]
    w1a, w1b, w2a, w2b = r(w.shape[0], 2), r(2, w[0].numel()), r(w.shape[0], 2), r(2, w[0].numel())
    patches[f"diffusion_model.{conv2}.weight"] = wa.LoHaAdapter(set(), (w1a, w1b, 3.0, w2a, w2b, None, None, None))
    deltas[conv2 + ".weight"] = 1.5 * ((w1a @ w1b) * (w2a @ w2b)).reshape(w.shape)
    w = weights[emb + ".weight"]
    w1, w2a, w2b = r(2, 2), r(w.shape[0] // 2, 2), r(2, w.shape[1] // 2)
    patches[f"diffusion_model.{emb}.weight"] = wa.LoKrAdapter(set(), (w1, None, 4.0, None, None, w2a, w2b, None, None))
    deltas[emb + ".weight"] = 2.0 * torch.kron(w1, w2a @ w2b)
    b = r(weights[proj + ".bias"].shape[0])
    patches[f"diffusion_model.{proj}.bias"] = ("diff", (b,))
    deltas[proj + ".bias"] = b
    return patches, deltas


def _patched_unet(model):
    """The slim model's UNet with its patches applied (the stand-in's ComfyUI patch math), as a state dict."""
    import comfy.lora
    sd = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    for key, entries in model.patches.items():
        sd[key[len("diffusion_model."):]] = comfy.lora.calculate_weight(entries, sd[key[len("diffusion_model."):]], key,
                                                                        intermediate_dtype=torch.float64)
    return sd


def test_loras_after_slim_are_converted_and_equal_the_fold_of_the_merged_weights(pack, model, monkeypatch):
    """A LoRA added after Slim UNet equals fold(W + s·ΔW) in float64 (the float64 formulas of the fold), for every
    form and strength, with ComfyUI patches of the slim size, and adding it never folds again."""
    import comfy.weight_adapter as wa
    patcher, weights = model
    aset = _with_intercept(_aset(weights, 0.5))
    slim = pack.folding.slim_patcher(patcher, aset)
    patches, deltas = _late_loras(pack, weights, torch.Generator().manual_seed(6))
    from sdslim_core.ops import fold, lora_slim
    calls, converts = [], []
    real, real_convert = fold.fold_site, lora_slim.SlimSpace.convert
    monkeypatch.setattr(fold, "fold_site", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(lora_slim.SlimSpace, "convert", lambda *a, **k: converts.append(1) or real_convert(*a, **k))
    for i, strength in enumerate((1.0, 0.35, -0.8)):
        later = slim.clone()
        added = later.add_patches(patches, strength)
        assert set(patches) <= set(added)
        assert converts if i == 0 else not converts, "the same LoRA at another strength is not converted again"
        converts.clear()
        got = _patched_unet(later)
        scaled = {k: strength * d for k, d in deltas.items()}
        for site in (FF, RES):
            for key, ref in pack.fold64(weights, aset.sites[site], site, aset.kind(site), scaled).items():
                torch.testing.assert_close(got[key], ref, rtol=1e-9, atol=1e-10, msg=lambda m: f"{key}: {m}")
        attn = "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
        torch.testing.assert_close(got[attn], weights[attn] + scaled[attn], rtol=1e-12, atol=1e-12)
    assert not calls                                                        # strength changes: no fold
    proj_patch = later.patches[f"diffusion_model.{FF}.net.0.proj.weight"][0]
    assert isinstance(proj_patch[1], wa.LoRAAdapter) and proj_patch[0] == -0.8          # same rank, slim rows
    assert proj_patch[1].weights[0].shape == (2 * aset.rank(FF), 4) and proj_patch[1].weights[1].shape[0] == 4
    bias_patch = later.patches[f"diffusion_model.{FF}.net.2.bias"][0]                   # the intercept's shift
    assert bias_patch[1][0] == "diff" and bias_patch[0] == -0.8
    loha = later.patches[f"diffusion_model.{RES}.out_layers.3.weight"][0][1]     # plain LoHa: a rank-2·2 LoRA
    assert isinstance(loha, wa.LoRAAdapter) and loha.weights[1].shape == (4, aset.rank(RES), 3, 3)
    lokr = later.patches[f"diffusion_model.{RES}.emb_layers.1.weight"][0][1]      # LoKr: dense, slim size
    assert lokr[0] == "diff" and lokr[1][0].shape == (aset.rank(RES), weights[f"{RES}.emb_layers.1.weight"].shape[1])


def test_lora_conversions_are_bounded_per_slim_model_and_freed_with_it(pack, model, monkeypatch):
    """The only cache Slim UNet keeps: each slim model's conversions of LoRAs added after it, keyed weakly by its
    SlimSpace, at most ``_CACHED`` of them (oldest first out), an entry dropped once its LoRA's tensors are
    gone. Nothing else holds the slim model: once it and its LoRA clones are dropped, weakrefs to the patcher,
    its BaseModel, its UNet and its cache entry are dead."""
    import gc
    import weakref
    patcher, weights = model
    slim = pack.folding.slim_patcher(patcher, _aset(weights, 0.5))
    space = slim.model.sdslim_info.space
    import comfy.weight_adapter as wa

    def lora(seed):                                        # LoRAs on the 6 layers of two folded sites
        g = torch.Generator().manual_seed(seed)
        out = {}
        for site, layers in ((FF, ("net.0.proj", "net.2")), (RES, ("in_layers.2", "emb_layers.1", "out_layers.3")),
                             ("middle_block.0", ("in_layers.2",))):
            for layer in layers:
                w = weights[f"{site}.{layer}.weight"]
                up = torch.randn(w.shape[0], 2, *([1, 1] if w.ndim == 4 else []), generator=g, dtype=torch.float64)
                down = torch.randn(2, *w.shape[1:], generator=g, dtype=torch.float64)
                out[f"diffusion_model.{site}.{layer}.weight"] = wa.LoRAAdapter(set(), (up, down, 1.0, None, None, None))
        return out
    monkeypatch.setattr(pack.patches, "_CACHED", 16)
    kept = []
    for seed in range(4):                                  # 4 LoRAs with 6 folded modules each
        patches = lora(10 + seed)
        later = slim.clone()
        later.add_patches(patches, 1.0)
        kept.append((patches, later))
        assert len(pack.patches._CONVERSIONS[space]) == min(16, 6 * (seed + 1))
    del kept[:3]                                           # three LoRAs (and their clones) gone
    gc.collect()
    patches = lora(20)
    slim.clone().add_patches(patches, 1.0)
    cache = pack.patches._CONVERSIONS[space]               # the 4th LoRA's 6 and the new one's 6
    assert len(cache) == 12 and all(r() is not None for refs, _ in cache.values() for r in refs)
    refs = [weakref.ref(o) for o in (slim, slim.model, slim.model.diffusion_model, space)]
    del slim, space, cache, patches, kept, later
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def test_tucker_locon_and_tucker_loha_after_slim_equal_the_fold_of_the_merged_weights(pack, model):
    """The LyCORIS forms whose ΔW needs lycoris-lora's math (a 3×3 LoCon with a Tucker core on conv1, a LoHa with
    Tucker cores on conv2), added after Slim UNet: float64 fold of W + s·ΔW, ΔW written out by hand here."""
    import comfy.weight_adapter as wa
    patcher, weights = model
    aset = _aset(weights, 0.5)
    slim = pack.folding.slim_patcher(patcher, aset)
    g = torch.Generator().manual_seed(8)

    def r(*shape):
        return 0.2 * torch.randn(*shape, generator=g, dtype=torch.float64)
    conv1, conv2 = f"{RES}.in_layers.2", f"{RES}.out_layers.3"
    w1, w2 = weights[conv1 + ".weight"], weights[conv2 + ".weight"]
    up, mid, down = r(w1.shape[0], 3, 1, 1), r(3, 3, 3, 3), r(3, w1.shape[1], 1, 1)
    t1, a1, b1, t2, a2, b2 = r(2, 2, 3, 3), r(2, w2.shape[0]), r(2, w2.shape[1]), r(2, 2, 3, 3), \
        r(2, w2.shape[0]), r(2, w2.shape[1])
    patches = {f"diffusion_model.{conv1}.weight": wa.LoRAAdapter(set(), (up, down, 1.5, mid, None, None)),
               f"diffusion_model.{conv2}.weight": wa.LoHaAdapter(set(), (a1, b1, 4.0, a2, b2, t1, t2, None))}
    tucker = lambda t, a, b: torch.einsum("ijkl,io,jc->ockl", t, a, b)  # noqa: E731 (LyCORIS' Tucker rebuild)
    deltas = {conv1 + ".weight": 0.5 * torch.einsum("oa,abkl,bi->oikl", up.flatten(1), mid, down.flatten(1)),
              conv2 + ".weight": 2.0 * tucker(t1, a1, b1) * tucker(t2, a2, b2)}
    for strength in (1.0, -0.6):
        later = slim.clone()
        assert set(later.add_patches(patches, strength)) == set(patches)
        got = _patched_unet(later)
        scaled = {k: strength * d for k, d in deltas.items()}
        for key, ref in pack.fold64(weights, aset.sites[RES], RES, "res", scaled).items():
            torch.testing.assert_close(got[key], ref, rtol=1e-9, atol=1e-10, msg=lambda m: f"{key}: {m}")


def test_forms_that_need_the_full_weight_are_refused_and_the_rest_dropped_once(pack, model, caplog):
    import comfy.weight_adapter as wa
    patcher, weights = model
    slim = pack.folding.slim_patcher(patcher, _aset(weights, 0.5))
    later = slim.clone()
    full = weights[f"{FF}.net.0.proj.weight"].shape
    up, down = torch.zeros(full[0], 4, dtype=torch.float64), torch.zeros(4, full[1], dtype=torch.float64)
    dora = {f"diffusion_model.{FF}.net.0.proj.weight": wa.LoRAAdapter(set(), (up, down, 1.0, None,
                                                                               torch.ones(full[0]), None))}
    with pytest.raises(ValueError, match=r"DoRA on .*ff\.net\.0\.proj.*fold it instead.*before Slim UNet"):
        later.add_patches(dora)
    with pytest.raises(ValueError, match=r"OFT patch on .*ff\.net\.0\.proj.*before Slim UNet"):
        later.add_patches({f"diffusion_model.{FF}.net.0.proj.weight": wa.OFTAdapter(set(), (None,))})
    assert later.patches == {}                                       # a refusal adds nothing
    sd = slim.model.diffusion_model.state_dict()
    attn = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    norm2 = f"diffusion_model.{RES}.out_layers.0.weight"
    lora = {f"diffusion_model.{FF}.net.2.weight": ("unknown form", None),
            f"diffusion_model.{RES}.in_layers.2.weight": ("diff", (torch.zeros(sd[f"{RES}.in_layers.2.weight"].shape),)),
            norm2: ("diff", (torch.zeros(weights[norm2[len("diffusion_model."):]].shape),)),
            attn: ("diff", (torch.zeros(sd[attn[len("diffusion_model."):]].shape),))}
    with caplog.at_level(logging.WARNING, logger="sdslim"):
        added = later.add_patches(lora)
    assert set(added) == set(lora)                           # dropped keys count as handled (no "NOT LOADED")
    assert set(later.patches) == {attn, f"diffusion_model.{RES}.in_layers.2.weight"}   # the slim-sized one is kept
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "1 weight patch(es)" in msgs[0] and f"{FF}.net.2.weight" in msgs[0]
    assert f"{RES}.out_layers.0.weight" in msgs[1] and "lost" in msgs[1]
    caplog.clear()
    hook = Hook()
    with caplog.at_level(logging.WARNING, logger="sdslim"):
        for _ in range(3):                                    # ComfyUI registers hook patches at every sampling
            later.add_hook_patches(hook, lora)
    assert set(later.hook_patches[hook.hook_ref]) == {attn, f"diffusion_model.{RES}.in_layers.2.weight"}
    assert len(caplog.records) == 2 and all("hook" in r.getMessage() for r in caplog.records)
    # an original model's patcher is not a slim one: nothing is filtered
    plain = patcher.clone()
    assert set(plain.add_patches(dora)) == set(dora)


def test_hook_loras_on_the_slim_model_are_converted_like_loras(pack, model):
    """Hook patches (added at sampling, or registered before Slim UNet) become the same slim patches as a LoRA."""
    patcher, weights = model
    aset = _with_intercept(_aset(weights, 0.5))
    patches, _ = _late_loras(pack, weights, torch.Generator().manual_seed(7))
    src = patcher.clone()
    before = Hook()
    src.hook_patches = {before.hook_ref: {k: [(0.6, v, 1.0, None, None)] for k, v in patches.items()}}
    slim = pack.folding.slim_patcher(src, aset)
    hook = Hook()
    later = slim.clone()
    later.add_hook_patches(hook, patches, 0.6)
    as_lora = slim.clone()
    as_lora.add_patches(patches, 0.6)
    for table in (later.hook_patches[hook.hook_ref], slim.hook_patches[before.hook_ref]):
        assert set(table) == set(as_lora.patches)
        for key, entries in table.items():
            (want,) = as_lora.patches[key]
            assert [e[0] for e in entries] == [want[0]]
            import comfy.lora
            w = slim.model.diffusion_model.state_dict()[key[len("diffusion_model."):]]
            torch.testing.assert_close(comfy.lora.calculate_weight(entries, w.clone(), key),
                                       comfy.lora.calculate_weight([want], w.clone(), key), rtol=0, atol=0)


def test_slim_model_is_a_clone_without_what_held_the_old_unet(pack, model, caplog):
    """clone() carries everything; wrappers/callbacks/object patches holding the old UNet and patches on
    slimmed keys are dropped by name; the clone's backups and parent link start afresh."""
    import comfy.model_patcher
    import comfy.patcher_extension as ext
    patcher, weights = model
    src = patcher.clone()
    old_unet = src.model.diffusion_model
    compiled = {"diffusion_model": torch.nn.Module()}
    compiled["diffusion_model"]._orig_mod = old_unet           # what torch.compile's OptimizedModule holds

    def compile_wrapper(executor, *a, **k):
        return compiled, executor(*a, **k)

    def keep_wrapper(executor, *a, **k):
        return executor(*a, **k)
    clones = []
    src.add_wrapper_with_key(ext.WrappersMP.APPLY_MODEL, "torch.compile", compile_wrapper)
    src.add_wrapper_with_key(ext.WrappersMP.APPLY_MODEL, "mine", keep_wrapper)
    src.add_callback_with_key(ext.CallbacksMP.ON_CLONE, "mine", lambda orig, new: clones.append((orig, new)))
    src.model_options["torch_compile_kwargs"] = {"backend": "inductor"}
    attn = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1"
    src.object_patches = {"diffusion_model": old_unet, attn: torch.nn.Identity(), "model_sampling": "ms"}
    src.weight_wrapper_patches = {f"diffusion_model.{FF}.net.2.weight": [len], attn + ".to_q.weight": [len]}
    hook = Hook()
    src.hook_patches = {hook.hook_ref: {f"diffusion_model.{FF}.net.2.weight": [(1.0, ("diff", (torch.zeros(1),)), 1.0, None, None)],
                                        attn + ".to_q.weight": [(1.0, ("diff", (torch.zeros(1),)), 1.0, None, None)]}}
    theirs = comfy.model_patcher.Backup(weights["out.2.weight"], False)
    src.backup["diffusion_model.out.2.weight"] = theirs
    with caplog.at_level(logging.WARNING, logger="sdslim"):
        slim = pack.folding.slim_patcher(src, _aset(weights, 0.5))
    msgs = " | ".join(r.getMessage() for r in caplog.records)
    assert "'torch.compile'" in msgs and "after Slim UNet" in msgs and "'diffusion_model'" in msgs
    assert list(slim.wrappers["apply_model"]) == ["torch.compile", "mine"]
    assert slim.wrappers["apply_model"]["torch.compile"] == [] and slim.wrappers["apply_model"]["mine"] == [keep_wrapper]
    assert "torch_compile_kwargs" not in slim.model_options and "torch_compile_kwargs" in src.model_options
    assert set(slim.object_patches) == {attn, "model_sampling"}
    assert set(slim.weight_wrapper_patches) == {attn + ".to_q.weight"}
    assert set(slim.hook_patches[hook.hook_ref]) == {attn + ".to_q.weight"}
    assert len(src.hook_patches[hook.hook_ref]) == 2 and len(src.object_patches) == 3     # the input keeps all
    assert len(clones) == 1 and clones[0][0] is src                  # ON_CLONE ran: Slim UNet is a clone
    assert slim.backup == {} and src.backup == {"diffusion_model.out.2.weight": theirs}
    assert slim.parent is None and slim.model is not src.model and slim.model.model_lowvram is False
    assert slim.model_size() < src.model_size()
    assert slim.clone().model is slim.model and type(slim.clone()) is type(slim)


def test_outer_sample_wrapper_records_even_when_sampling_fails(pack, model):
    patcher, _ = model
    guider = types.SimpleNamespace(model_patcher=patcher)

    class Executor:
        class_obj = guider

        def __init__(self, fail):
            self.fail = fail

        def __call__(self, *args, **kwargs):
            if self.fail:
                raise RuntimeError("boom")
            return args[0] + 1

    noise = torch.zeros(2, 4, 8, 8)
    assert torch.equal(pack.monitor.outer_sample_wrapper(Executor(False), noise), noise + 1)
    rec = dict(pack.monitor.LAST_SAMPLING)
    assert rec["device"] == "cpu" and rec["latent_shape"] == [2, 4, 8, 8] and rec["rss_after"] > 0
    assert not rec["slim"] and "peak_allocated" not in rec
    with pytest.raises(RuntimeError, match="boom"):
        pack.monitor.outer_sample_wrapper(Executor(True), noise[:1])
    assert pack.monitor.LAST_SAMPLING["latent_shape"] == [1, 4, 8, 8]
    assert "CPU: no VRAM peak" in "\n".join(pack.report.sampling_lines(pack.monitor.LAST_SAMPLING))


def test_report_sections(pack, model):
    patcher, weights = model
    slim = pack.folding.slim_patcher(patcher, _aset(weights, 0.5))
    text = pack.report.breakdown_text(slim, "m")
    full = breakdown.count({k: tuple(v.shape) for k, v in weights.items()})
    now = breakdown.count({k: tuple(v.shape) for k, v in slim.model.diffusion_model.state_dict().items()})
    assert now["total"] < full["total"]
    assert "original vs slim" in text and f"{full['total']:,}" in text and f"{now['total']:,}" in text
    assert "(original)" in pack.report.breakdown_text(patcher)
    mm, _ = pack.comfy
    lines = pack.report.device_lines(mm, torch)
    assert lines[1].startswith("CPU only") and "RAM total" in lines[2]
    assert pack.report.loaded_models_lines(mm) == ["loaded models:", "  none"]
    assert files.format_bytes(3 * 2 ** 30) == "3.00 GiB" and files.format_bytes(5 * 2 ** 20) == "5.0 MiB"


def test_vram_estimate_counts_the_model_dtype_once_per_curve(pack, model):
    """fp16 weights are estimated as 2-byte weights; the original behind both inputs is estimated once; one
    batch point prints no fit line; a sampling estimate names no optimizer."""
    patcher, weights = model
    slim = pack.folding.slim_patcher(patcher, _aset(weights, 0.5))
    assert [pack.report.precision_of(d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
            ] == ["fp32", "full-bf16", "full-bf16", "full-bf16"]
    for m in (patcher, slim):
        m.model_dtype = lambda: torch.float16                      # as ComfyUI keeps SD on a GPU
    jobs = pack.report.estimate_jobs([("model", slim), ("model_b", patcher)], 64, 64)
    n_sites = len(slim.model.sdslim_info.ranks)
    assert [(n, s.precision, bool(s.slim_ranks), base) for n, s, base in jobs] == [
        ("sd15 original (float16)", "full-bf16", False, "sd15 original (float16)"),
        (f"model slim ({n_sites} sites at its ranks)", "full-bf16", True, "sd15 original (float16)")]
    text = "\n".join(pack.report.estimate_lines(jobs[:1], 64, 64, 1))
    assert "2-byte weights" in text and "adamw" not in text and "fit:" not in text, text
    n_params = sum(v.numel() for v in weights.values())
    assert f"{n_params:,} UNet parameters" in text, text           # this MODEL's UNet, not a published one


def test_vram_estimate_builds_the_unet_each_model_really_has(pack, model):
    """The estimate of a slim MODEL runs the UNet of its own ranks, site by site (not an average ratio): the UNet
    the estimator builds from the job has exactly the slim MODEL's shapes, and the original's job the original's."""
    from sdslim_core.vram import harness
    patcher, weights = model
    aset = _aset(weights, 0.5)
    sites = list(aset.sites)
    aset.sites[sites[0]] = {k: v[: max(1, v.shape[0] // 3)] if k != "up" else v[:, : max(1, v.shape[1] // 3)]
                            for k, v in aset.sites[sites[0]].items()} if aset.kind(sites[0]) == "ff" else \
        aset.sites[sites[0]]                        # uneven ranks: an average ratio could not give these shapes
    slim = pack.folding.slim_patcher(patcher, aset)
    jobs = pack.report.estimate_jobs([("model", slim)], 64, 64)
    assert len(jobs) == 2
    for (_, settings, _), m in zip(jobs, (patcher, slim)):
        with torch.device("meta"):
            built = harness.build_model(settings)
        built_shapes = {k: tuple(v.shape) for k, v in layout.to_canonical(built.state_dict())[0].items()}
        assert built_shapes == {k: tuple(v.shape) for k, v in m.model.diffusion_model.state_dict().items()}


# ------------------------------------------------------------------------------------------------------- GGUF

class _GGMLTensor(torch.Tensor):
    """What ComfyUI-GGUF's loader puts in a model: raw blocks, with the GGUF type (its ``tensor_type``)."""
    tensor_type = types.SimpleNamespace(name="Q4_K")


def test_slim_unet_refuses_a_gguf_model_saying_how_to_stack_slim_with_gguf(pack, model):
    patcher, weights = model
    key = f"diffusion_model.{RES}.in_layers.2.weight"
    gguf_model = copy.deepcopy(patcher)
    conv = gguf_model.model.diffusion_model.get_submodule(f"{RES}.in_layers.2")
    conv.weight = torch.nn.Parameter(torch.zeros(100, dtype=torch.uint8).as_subclass(_GGMLTensor), requires_grad=False)
    gguf_model.get_key_patches = None          # ComfyUI-GGUF's fake state-dict entries break it: never reached
    with pytest.raises(pack.folding.SlimError, match=rf"'{key}' is GGUF-quantised \(Q4_K.*two quantisation errors.*"
                                                     r"sdslim slim --ckpt .* --format gguf --quant Q4_0.*Load Slim "
                                                     r"GGUF"):
        pack.folding.slim_patcher(gguf_model, _aset(weights, 0.5))


def test_load_slim_gguf_lists_slim_gguf_files_and_names_comfyui_gguf_when_it_is_missing(pack, tmp_path):
    pytest.importorskip("gguf")
    from sdslim_core import tiny
    from sdslim_core.apps import slim as core_slim
    gg = importlib.import_module(pack.folding.__name__.rsplit(".", 1)[0] + ".gguf")
    fp = pack.folder_paths
    unet_dir = tmp_path / "unet"
    (unet_dir / "sub").mkdir(parents=True)
    fp.folder_names_and_paths["diffusion_models"] = ([str(unet_dir)], {".safetensors"})
    core_slim.slim_checkpoint(tiny.DEFAULT_PATH, tiny.ASSETS / "tiny_sd15_slim_half.safetensors",
                              unet_dir / "sub" / "slim.gguf", quant="Q8_0")
    core_slim.slim_checkpoint(tiny.DEFAULT_PATH, None, unet_dir / "full.gguf", quant="Q8_0")
    (unet_dir / "broken.gguf").write_bytes(b"not a gguf")
    assert pack.paths.slim_ggufs(fp) == ["sub/slim.gguf"]
    assert pack.paths.resolve_gguf(fp, "sub/slim.gguf") == str(unet_dir / "sub" / "slim.gguf")
    with pytest.raises(FileNotFoundError, match="'gone.gguf' not found in models/diffusion_models"):
        pack.paths.resolve_gguf(fp, "gone.gguf")
    with pytest.raises(pack.folding.SlimError, match=r"needs the ComfyUI-GGUF custom nodes \(city96/ComfyUI-GGUF\).*"
                                                     r"ComfyUI-Manager.*git clone https://github.com/city96/ComfyUI-GGUF"):
        gg.load(str(unet_dir / "sub" / "slim.gguf"))
    del fp.folder_names_and_paths["diffusion_models"]
    assert pack.paths.slim_ggufs(fp) == []


def test_slim_unet_measures_how_far_the_model_is_from_the_adapters_base(pack, model, caplog):
    """The distance of the merged weights (LoRAs included) from the adapter file's base fingerprint: 0 on the base,
    the exact relative change otherwise, a console warning past the threshold."""
    from sdslim_core.ops import fingerprint, fold
    patcher, weights = model
    aset = _aset(weights, 0.5)
    aset.metadata["sdslim.base"] = {"sketches": fingerprint.sketches(((s, aset.kind(s)) for s in aset.sites),
                                                                     weights.get)}
    with caplog.at_level(logging.INFO, logger="sdslim"):
        same = pack.folding.slim_patcher(patcher, aset).model.sdslim_info.distance
    assert same.overall == 0.0 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    keys = [k for s in aset.sites for k in fold.site_keys(s, aset.kind(s)) if k in weights]
    g = torch.Generator().manual_seed(7)
    deltas = {k: torch.randn(weights[k].shape, generator=g, dtype=torch.float64) for k in keys}
    deltas = {k: 0.3 * weights[k].norm() / d.norm() * d for k, d in deltas.items()}
    moved = patcher.clone()
    moved.add_patches({"diffusion_model." + k: ("diff", (d,)) for k, d in deltas.items()}, 1.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sdslim"):
        far = pack.folding.slim_patcher(moved, aset).model.sdslim_info.distance
    exact = math.sqrt(sum(float(deltas[k].pow(2).sum()) for k in keys) / sum(float(weights[k].pow(2).sum()) for k in keys))
    assert far.overall == pytest.approx(exact, rel=0.15)
    slimmed = pack.folding.slim_patcher(moved, aset)
    assert f"folded weights {far.overall:.1%} from the adapters' base" in pack.report.breakdown_text(slimmed)
    assert any(r.levelno == logging.WARNING and "from the adapters' base" in r.getMessage() for r in caplog.records)


def test_damaged_files_are_left_out_of_every_list_and_never_fail_it(pack, tmp_path, caplog):
    """Cut at every byte of the header, garbage, text, broken links, in models/sdslim, checkpoints and unet: the
    three loaders' lists (built at start-up and on every /object_info) hold just the intact files."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import save_file

    from conftest import damaged_copies
    from sdslim_core.io import gguf as io_gguf
    fp = pack.folder_paths
    fp.folder_names_and_paths.clear()
    folders = {kind: tmp_path / kind for kind in ("sdslim", "checkpoints", "diffusion_models")}
    for kind, folder in folders.items():
        folder.mkdir()
        fp.folder_names_and_paths[kind] = ([str(folder)], {".safetensors"})
    _adapter_file(folders["sdslim"] / "good.safetensors")
    save_file({"input_blocks.0.0.bias": torch.ones(4)}, str(folders["checkpoints"] / "good.safetensors"),
              metadata={"sdslim.slim": "1"})
    w = {"input_blocks.0.0.weight": torch.ones(64, 4, 3, 3), "input_blocks.0.0.bias": torch.ones(64)}
    io_gguf.write(folders["diffusion_models"] / "good.gguf", [io_gguf.plan(k, v.shape, "Q8_0") for k, v in w.items()],
                  w.__getitem__, "sd1", {"sdslim.slim": "1"})
    for kind, folder in folders.items():
        good = folder / ("good.gguf" if kind == "diffusion_models" else "good.safetensors")
        header = gguf.GGUFReader(good).data_offset if good.suffix == ".gguf" else 8 + int.from_bytes(
            good.read_bytes()[:8], "little")
        damaged_copies(good, folder / "damaged", header)
        damaged_copies(folders["checkpoints"] / "good.safetensors", folder / "damaged-st", 40)
    classes = {s.node_id: pack.v1.node_class(s) for s in pack.specs.SPECS}
    lists = {node: classes[node].INPUT_TYPES()["required"][name][0] for node, name in (
        ("SdslimSlimUNet", "adapters"), ("SdslimLoadSlimCheckpoint", "ckpt_name"), ("SdslimLoadSlimGGUF", "unet_name"))}
    assert lists == {"SdslimSlimUNet": ["good.safetensors"], "SdslimLoadSlimCheckpoint": ["good.safetensors"],
                     "SdslimLoadSlimGGUF": ["good.gguf"]}
    pack.paths._HEADER_CHECKS.clear()

    def broken_reader(path):
        raise RuntimeError("a reader's own bug")
    original = io_gguf.is_slim_gguf
    io_gguf.is_slim_gguf = broken_reader
    try:
        with caplog.at_level(logging.WARNING, logger="sdslim"):
            assert pack.paths.slim_ggufs(fp) == []
    finally:
        io_gguf.is_slim_gguf = original
        pack.paths._HEADER_CHECKS.clear()
        fp.folder_names_and_paths.clear()
    assert f"{folders['diffusion_models'] / 'good.gguf'} not listed: reading its header failed (RuntimeError: a " \
           "reader's own bug)" in caplog.text


# ------------------------------------------------------------------------------------------------ training

def test_train_node_recipes_and_start_from_adapters(pack, model, tmp_path):
    """The Train node's 'recipe', 'start_from' and 'adapter_dtype' inputs: data-free writes the weight-norm
    selection (computed here on the patcher's own weights, without the node) with the MODEL's fingerprint, stored
    fp16 unless asked for fp32; a refit from the fp16 file keeps its sites and ranks and trains only a short
    stage 2."""
    import importlib
    from sdslim_core.ops import fingerprint
    training = importlib.import_module("sdslim_nodes_under_test.training")
    fp = pack.folder_paths
    fp.folder_names_and_paths.clear()
    fp.folder_names_and_paths["sdslim"] = ([str(tmp_path / "sdslim")], {".safetensors"})
    (tmp_path / "sdslim").mkdir()
    node = pack.v1.node_class(pack.specs.TRAIN).INPUT_TYPES()["optional"]
    assert node["recipe"][0] == ["full", "quick", "data-free"] and node["start_from"][0] == ["(none)"]
    assert node["adapter_dtype"][0] == ["fp16", "bf16", "fp32"]              # the first is the default
    patcher, weights = model
    canon, _, _ = layout.to_canonical(weights)
    want = adapters.AdapterSet.init_select(canon, rank_policy.ranks_for_ratio(layout.sites(canon), 0.5), "sd15")
    for name, dtype in (("df32", "fp32"), ("df", None)):
        text = training.run(patcher, name, ratio=0.5, steps=1, seed=0, recipe="data-free", adapter_dtype=dtype)
        assert "lowest fidelity" in text
        got = adapters.AdapterSet.load(tmp_path / "sdslim" / f"{name}.safetensors")
        stored = torch.float32 if dtype == "fp32" else torch.float16
        assert got.ranks() == want.ranks()
        assert all(t.dtype == stored for site in got.sites.values() for t in site.values())
        assert all(torch.equal(got.sites[s][k].double(), want.sites[s][k].to(stored).double()) for s in want.sites
                   for k in want.sites[s])
    meter = fingerprint.DistanceMeter(got.metadata["sdslim.base"])
    for site in got.sites:
        for key in fingerprint.site_keys(site, got.kind(site)):
            meter.add(site, key, canon[key])
    assert meter.result().overall < 1e-6
    node = pack.v1.node_class(pack.specs.TRAIN).INPUT_TYPES()["optional"]
    assert node["start_from"][0] == ["(none)", "df.safetensors", "df32.safetensors"]
    g = torch.Generator().manual_seed(0)
    positive = [[torch.randn(1, 77, 64, generator=g), {}]]
    with pytest.raises(ValueError, match=r"^sdslim: start_from keeps .* clear 'budget'$"):     # in the node's words
        training.run(patcher, "refit", ratio=0.5, steps=2, seed=0, positive=positive, latent_size=4,
                     start_from="df.safetensors", budget="1M")
    assert not (tmp_path / "sdslim" / "refit.safetensors").exists()
    text = training.run(patcher, "refit", ratio=0.5, steps=2, seed=0, positive=positive, latent_size=4,
                        start_from="df.safetensors")
    refit = adapters.AdapterSet.load(tmp_path / "sdslim" / "refit.safetensors")
    assert refit.ranks() == got.ranks() and refit.metadata["sdslim.train"]["steps"] == {"stage1_per_site": 0,
                                                                                       "stage2": 2}
    assert "adapters written to" in text


# --------------------------------------------------------------------------------------- example workflows

LORA_LOADERS = {"LoraLoader", "LoraLoaderModelOnly"}


def _model_chain(graph: dict, node_id: str) -> list:
    """Class types on the MODEL path into ``node_id``, from it back to the loader."""
    chain = []
    while node_id is not None:
        node = graph[node_id]
        chain.append(node["class_type"])
        link = node["inputs"].get("model")
        node_id = link[0] if isinstance(link, list) else None
    return chain


@pytest.mark.parametrize("save, load, suffix, folder, name_input", [
    ("save_slim_checkpoint", "slim_checkpoint_lora", ".safetensors", "checkpoints", "ckpt_name"),
    ("save_slim_gguf", "slim_gguf_lora", ".gguf", "diffusion_models", "unet_name")])
def test_each_save_workflow_writes_the_file_its_load_workflow_loads(pack, tmp_path, save, load, suffix, folder,
                                                                    name_input):
    """The pair in sequence, as docs/comfyui.md tells it: the file the save workflow's node writes (its own target
    rule, a real slim file written there) is the one the load workflow names (the Load node's own list and
    lookup, subfolder included), and the LoRA is applied once over the two."""
    import json

    from sdslim_core import tiny
    from sdslim_core.apps.slim import slim_checkpoint
    if suffix == ".gguf":
        pytest.importorskip("gguf")
    saving = importlib.import_module(pack.specs.__package__ + ".saving")
    api = os.path.join(ROOT, "example_workflows", "api")
    save_graph, load_graph = (json.load(open(os.path.join(api, f"{n}.json"))) for n in (save, load))
    (save_id,) = [k for k, v in save_graph.items() if v["class_type"].startswith("SdslimSave")]
    (load_id,) = [k for k, v in load_graph.items() if v["class_type"].startswith("SdslimLoad")]
    fp = pack.folder_paths
    fp.folder_names_and_paths.clear()
    root = tmp_path / folder
    fp.folder_names_and_paths[folder] = ([str(root)], {".safetensors", ".gguf"} if suffix == ".gguf" else
                                         {".safetensors"})
    inputs = save_graph[save_id]["inputs"]
    assert inputs.get("destination", "checkpoints") == "checkpoints"
    path = saving.target(str(root), inputs["filename"], suffix, inputs["overwrite"])
    slim_checkpoint(tiny.DEFAULT_PATH, tiny.DEFAULT_PATH.parent / "tiny_sd15_slim_half.safetensors", path,
                    quant=inputs["quant"] if suffix == ".gguf" else None)
    name = load_graph[load_id]["inputs"][name_input]
    listed = pack.paths.slim_ggufs(fp) if suffix == ".gguf" else pack.paths.slim_checkpoints(fp)
    assert listed == [name], (listed, name)
    found = pack.paths.resolve_gguf(fp, name) if suffix == ".gguf" else fp.get_full_path(folder, name)
    assert os.path.samefile(found, path)
    (sampler,) = [k for k, v in load_graph.items() if v["class_type"] == "KSampler"]
    chain = _model_chain(load_graph, sampler) + _model_chain(save_graph, save_id)
    assert chain[-1] == "CheckpointLoaderSimple" and len([c for c in chain if c in LORA_LOADERS]) == 1, chain


def test_node_errors_are_one_sdslim_error_with_the_cores_message(pack, model, tmp_path):
    """What a user can trigger reaches ComfyUI as ``sdslim.SlimError`` (the name its error dialog shows), with the
    core's message; an existing file is refused in the CLI's words, naming the node's overwrite input."""
    fp = pack.folder_paths
    fp.folder_names_and_paths.clear()
    for name in ("sdslim", "checkpoints"):
        (tmp_path / name).mkdir()
        fp.folder_names_and_paths[name] = ([str(tmp_path / name)], {".safetensors"})
    patcher, weights = model
    _aset(weights, 0.5).save(tmp_path / "sdslim" / "a.safetensors")
    with pytest.raises(ValueError) as missing:
        pack.specs.SLIM.run(model=patcher, adapters="gone.safetensors", strength=1.0, enable=True)
    cls = type(missing.value)
    assert f"{cls.__module__}.{cls.__qualname__}" == "sdslim.SlimError"
    assert str(missing.value).startswith("sdslim: adapter file 'gone.safetensors' not found in models/sdslim")
    (slim,) = pack.specs.SLIM.run(model=patcher, adapters="a.safetensors", strength=1.0, enable=True).values
    existing = tmp_path / "checkpoints" / "slim" / "mine.safetensors"
    existing.parent.mkdir()
    existing.write_bytes(b"mine")
    with pytest.raises(ValueError) as refused:
        pack.specs.SAVE_SLIM.run(model=slim, filename="slim/mine", destination="checkpoints", overwrite=False,
                                 embed_adapters=False)
    assert type(refused.value) is cls
    assert str(refused.value) == "sdslim: " + files.OutputExists(existing).message("overwrite")
    assert existing.read_bytes() == b"mine"
    with pytest.raises(ValueError, match="dtype 'fp64' is not one of source, fp16"):
        pack.specs.SAVE_SLIM.run(model=slim, filename="slim/other", destination="checkpoints", overwrite=False,
                                 embed_adapters=False, dtype="fp64")


def test_save_slim_checkpoint_stores_the_dtype_the_source_was_stored_in(pack):
    """The source's dtype is read off the weights ComfyUI holds (an fp16 file loaded as float32 is exactly fp16),
    and the node's dtype input maps to the file's dtypes, fp16 where the source's is unknown."""
    saving = importlib.import_module(pack.specs.__package__ + ".saving")
    g = torch.Generator().manual_seed(0)
    trained = [torch.randn(64, 32, generator=g), torch.randn(8, 4, 3, 3, generator=g), torch.randn(64, generator=g)]
    source_dtype = pack.folding.source_dtype
    assert source_dtype(trained) is None
    assert source_dtype([t.half().float() for t in trained]) == torch.float16
    assert source_dtype([(t * 1e-6).bfloat16().float() for t in trained]) == torch.bfloat16    # not exact in fp16
    assert source_dtype([t.half() for t in trained]) == torch.float16                           # held as stored
    assert source_dtype([t.to(torch.float8_e4m3fn) for t in trained[:2]]) == torch.float8_e4m3fn
    f16, bf16, f8 = torch.float16, torch.bfloat16, torch.float8_e4m3fn
    assert [saving.storage_dtypes(choice, src) for choice, src in [
        ("source", None), ("source", bf16), ("source", f8), ("fp16", bf16), ("bf16", None), ("fp8_e4m3fn", bf16),
        ("as held", f16)]] == [(f16, f16), (bf16, bf16), (f8, f16), (f16, f16), (bf16, bf16), (f8, f16), (None, None)]


def _merged_loras(pack, weights) -> dict:
    """The patches of :func:`_late_loras` that the stand-in's ComfyUI merges itself (LoRA, LoCon, diff; its LoHa and
    LoKr compute nothing), so the same LoRA goes before Slim UNet too."""
    patches, _ = _late_loras(pack, weights, torch.Generator().manual_seed(6))
    return {k: v for k, v in patches.items() if isinstance(v, tuple) or type(v).__name__ == "LoRAAdapter"}


def _folders(fp, tmp_path, *names):
    fp.folder_names_and_paths.clear()
    for name in names:
        (tmp_path / name).mkdir(exist_ok=True)
        fp.folder_names_and_paths[name] = ([str(tmp_path / name)], {".safetensors"})


def _run(m, seed=3):
    """What ``m`` computes patched the way a custom node or script patches a model: ``patch_model()`` directly."""
    m.patch_model()
    try:
        return _forward(m.model.diffusion_model, seed)
    finally:
        m.unpatch_model()


def _load_state(m) -> dict:
    """Where the MODEL's BaseModel stands: its tensors (device, dtype, a hash of the values), ComfyUI's load marks on
    its modules and on it."""
    import hashlib
    marks = {n: (getattr(x, "comfy_patched_weights", None), getattr(x, "comfy_cast_weights", None),
                 len(getattr(x, "weight_function", ()))) for n, x in m.model.named_modules()}
    tensors = {k: (v.device, v.dtype, hashlib.sha256(v.detach().cpu().contiguous().numpy().tobytes()).hexdigest())
               for k, v in m.model.state_dict().items()}
    return {"tensors": tensors, "marks": marks, "uuid": m.model.current_weight_patches_uuid,
            "lowvram": m.model.model_lowvram, "loaded": m.model.model_loaded_weight_memory}


def test_saving_never_changes_what_the_model_computes_afterwards(pack, model, tmp_path):
    """The bug: a LoRA added after Slim UNet, on a slim MODEL that Save Slim Checkpoint had just written, computed
    the slim model without the LoRA (max abs diff 0.35 in a real ComfyUI). The save's forced load
    (``load_models_gpu(force_patch_weights=True)``, as ComfyUI's Save Checkpoint) left the slim BaseModel loaded,
    every module marked patched, so the LoRA clone's ``patch_model()`` skipped them all. The save now unloads what it
    loaded: the saved MODEL (here with a LoRA, patched into the shared weights by the save), its parent and a LoRA
    added afterwards compute what they computed before, the same LoRA folded in before Slim UNet being the reference;
    the CLIP it saves (with a patch) is unloaded again too; a model loaded before the save stays loaded."""
    import comfy.model_management as mm
    import comfy.model_patcher

    class Clip:
        """What the save asks of ComfyUI's CLIP: its tensors, and its patcher loaded (``load_model``)."""
        def __init__(self):
            self.patcher = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"),
                                                            torch.device("cpu"))
            self.patcher.add_patches({"weight": ("diff", (torch.ones(2, 2),))})

        def get_sd(self):
            return {"cond_stage_model." + k: v for k, v in self.patcher.model.state_dict().items()}

        def load_model(self):
            mm.load_models_gpu([self.patcher])
            return self.patcher
    fp = pack.folder_paths
    _folders(fp, tmp_path, "sdslim", "checkpoints")
    patcher, weights = model
    _with_intercept(_aset(weights, 0.5)).save(tmp_path / "sdslim" / "a.safetensors")
    lora = _merged_loras(pack, weights)

    def slim(m):
        return pack.specs.SLIM.run(model=m, adapters="a.safetensors", strength=1.0, enable=True).values[0]

    def with_lora(m, strength):
        m = m.clone()
        m.add_patches(lora, strength)
        return m
    plain = slim(patcher)
    reference = _run(plain)
    want = {s: _run(slim(with_lora(patcher, s))) for s in (0.6, -0.9)}
    assert (want[0.6] - reference).abs().max() > 1e-3                 # the LoRA matters

    def save(m, name, clip=None):
        state, loaded = _load_state(m), list(mm.current_loaded_models)
        pack.specs.SAVE_SLIM.run(model=m, filename=name, destination="checkpoints", overwrite=False,
                                 embed_adapters=False, clip=clip)
        assert (tmp_path / "checkpoints" / f"{name}.safetensors").is_file()
        return state, loaded
    clip = Clip()
    clip_weight = clip.patcher.model.weight.detach().clone()
    state, loaded = save(plain, "plain", clip)
    torch.testing.assert_close(_run(with_lora(plain, -0.9)), want[-0.9], rtol=1e-5, atol=1e-6)   # the bug
    assert _load_state(plain) == state and mm.current_loaded_models == loaded
    assert torch.equal(clip.patcher.model.weight, clip_weight) and not clip.patcher.backup
    saved = with_lora(plain, 0.6)
    state, loaded = save(saved, "with_lora")                          # its LoRA forced into the shared weights
    assert _load_state(saved) == state and mm.current_loaded_models == loaded
    torch.testing.assert_close(_run(plain), reference)
    torch.testing.assert_close(_run(saved), want[0.6], rtol=1e-5, atol=1e-6)
    mm.load_models_gpu([saved])                                      # through ComfyUI's loader: the same
    torch.testing.assert_close(_forward(saved.model.diffusion_model), want[0.6], rtol=1e-5, atol=1e-6)
    save(saved, "loaded")
    assert [lm.model for lm in mm.current_loaded_models] == [saved]   # loaded before the save: stays loaded
    mm.unload_all_models()
    torch.testing.assert_close(_run(plain), reference)


# ------------------------------------------------------------------------------ on a GPU load device (emulated)
# ComfyUI with a GPU gives every MODEL a load device (the GPU) and an offload device (the CPU): weights wait on the
# CPU, load_models_gpu moves them and computes the patches there (comfy.lora.calculate_weight brings each patch's
# tensors to the weight), and --lowvram / --novram keep layers on the CPU, cast per forward with their patches.
# The load device here is emulated_device.py's (CUDA's placement rules, the CPU's values), and cuda too where a GPU is
# present (pytest -k cuda, CLOSE: its kernels round otherwise than the CPU's). Load Slim GGUF runs on the emulated one
# in tests/integration/test_comfyui_gguf.py only: a stand-in for ComfyUI-GGUF (its tensor class, ops, loader and
# patcher) would be a second ComfyUI-GGUF, testing itself.

CLOSE = {"emulated": dict(rtol=1e-6, atol=1e-7), "cuda": dict(rtol=2e-2, atol=2e-3)}
SAME = {"emulated": dict(rtol=0, atol=0), "cuda": CLOSE["cuda"]}       # the same computation, twice


@pytest.fixture(params=accelerators())
def acc(request):
    return request.param


def _on(patcher, device):
    """A ModelPatcher over ``patcher``'s BaseModel with ``device`` as its load device and the CPU as offload."""
    import comfy.model_patcher
    return comfy.model_patcher.ModelPatcher(patcher.model, device, torch.device("cpu"))


def _sampled(m, device, lowvram: bool, monkeypatch):
    """What ``m`` computes loaded by ComfyUI's loader onto ``device`` (lowvram, where the device is not the CPU:
    every layer left on the CPU and cast per forward), on the CPU; the model is unloaded again."""
    import comfy.model_management as mm
    lowvram = lowvram and device.type != "cpu"
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NO_VRAM if lowvram else mm.VRAMState.NORMAL_VRAM)
    monkeypatch.setattr(mm, "get_torch_device", lambda: device)
    mm.load_models_gpu([m])
    try:
        params = {p.device.type for p in m.model.diffusion_model.parameters()}
        assert params == ({"cpu"} if lowvram else {device.type}), params
        assert m.model.model_lowvram == lowvram
        g = torch.Generator().manual_seed(3)
        x, ctx = (torch.randn(*shape, generator=g, dtype=m.model_dtype()).to(device)
                  for shape in ((1, 4, 16, 16), (1, 5, 64)))
        with torch.no_grad():
            out = m.model.diffusion_model(x, torch.tensor([300.0]).to(device), context=ctx)
        assert out.device == device
        return out.cpu()
    finally:
        mm.unload_all_models()


@pytest.mark.parametrize("lowvram", [False, True], ids=["full", "lowvram"])
def test_slim_unet_folds_on_the_load_device_and_a_lora_after_it_computes_there(pack, model, tmp_path, lowvram, acc,
                                                                              monkeypatch):
    """Guards the first GPU run's ComfyUI crash: Slim UNet folded the weights on the load device with the adapter
    tensors read on the CPU ("Expected all tensors to be on the same device"). Slim UNet (the input with a LoRA)
    folds on the load device, keeps the result on the offload device, and the slim model with a LoRA after it,
    loaded by ComfyUI's loader (fully, or lowvram: weights cast per layer, the LoRA applied to the cast weight),
    computes on the device what the same models compute on the CPU. On the code before the fix (f134183) it fails:
    that code folded on the CPU for every load device but CUDA. Not emulated: an input already loaded on the device
    (weights there are the emulation's tensor subclass, which Slim UNet refuses as it refuses quantised ones)."""
    from sdslim_core.ops import fold
    fp = pack.folder_paths
    _folders(fp, tmp_path, "sdslim")
    patcher, weights = model
    _with_intercept(_aset(weights, 0.5)).save(tmp_path / "sdslim" / "a.safetensors")
    lora = _merged_loras(pack, weights)
    folded_on = set()
    real_fold = fold.fold_site
    monkeypatch.setattr(fold, "fold_site", lambda site, kind, get, tensors: real_fold(
        site, kind, lambda k: folded_on.add(None if get(k) is None else get(k).device) or get(k), tensors))
    outs = {}
    for name in ("cpu", "device"):
        with on(acc) as dev:
            device = dev if name == "device" else torch.device("cpu")
            before = _on(patcher, device).clone()
            before.add_patches(lora, 0.7)
            folded_on.clear()
            slim = pack.specs.SLIM.run(model=before, adapters="a.safetensors", strength=1.0, enable=True).values[0]
            assert folded_on - {None} == {device}
            assert {t.device.type for t in slim.model.state_dict().values()} == {"cpu"}
            after = slim.clone()
            after.add_patches(lora, -0.4)
            outs[name] = _sampled(after, device, lowvram, monkeypatch)
            outs[name + " without"] = _sampled(slim, device, lowvram, monkeypatch)
    assert (outs["device"] - outs["device without"]).abs().max() > 1e-3           # the LoRA acts
    torch.testing.assert_close(outs["device"], outs["cpu"], **CLOSE[acc])


class _TinyConfig:
    """The config ComfyUI's detection would find for the tiny LDM UNet: it builds ComfyUI's BaseModel over an LDM
    UNet with the stand-in's op classes, in the inference dtype ComfyUI chose."""
    scaled_fp8 = None
    unet_config = {}
    supported_inference_dtypes = [torch.float32]

    @classmethod
    def matches(cls, state_dict, prefix):
        return state_dict[prefix + "input_blocks.0.0.weight"].shape[0] == tiny_config().model_channels

    def set_inference_dtype(self, dtype, manual_cast_dtype):
        self.dtype = dtype

    def get_model(self, state_dict, prefix="", device=None):
        import comfy.model_base
        import comfy.ops
        with torch.device(device):
            base = comfy.model_base.BaseModel(self)
            base.diffusion_model = _comfy_classes(ldm_unet(tiny_config(), self.dtype).eval(), comfy.ops)
        return base

    def process_unet_state_dict(self, state_dict):
        return state_dict


@pytest.mark.parametrize("lowvram", [False, True], ids=["full", "lowvram"])
def test_load_slim_checkpoint_and_a_lora_after_it_on_a_gpu_load_device(pack, model, tmp_path, lowvram, acc,
                                                                       monkeypatch):
    """Guards Load Slim Checkpoint with a GPU: its MODEL takes ComfyUI's load device and offload device, its weights
    wait on the CPU, and a LoRA after it (converted with the adapter file the slim file records, found in
    models/sdslim) is computed on the device by ComfyUI's patch math, fully loaded or lowvram; the result is what the
    same file and LoRA compute on the CPU. The stand-in stands in for ComfyUI's model detection and BaseModel
    construction (:class:`_TinyConfig`), not for the loader's own work: meta build, slim layers, assignment."""
    from sdslim_core.apps.slim import slim_checkpoint
    from sdslim_core.io.tensors import save_file_atomic
    import comfy.supported_models
    fp = pack.folder_paths
    _folders(fp, tmp_path, "sdslim", "checkpoints", "embeddings")
    monkeypatch.setattr(comfy.supported_models, "models", [_TinyConfig])
    patcher, weights = model
    _with_intercept(_aset(weights, 0.5)).save(tmp_path / "sdslim" / "a.safetensors")
    save_file_atomic({layout.CHECKPOINT_PREFIX + k: v.float() for k, v in weights.items()}, tmp_path / "full.st")
    slim_checkpoint(tmp_path / "full.st", tmp_path / "sdslim" / "a.safetensors",
                    tmp_path / "checkpoints" / "slim.safetensors")
    lora = _merged_loras(pack, weights)
    outs = {}
    for name in ("cpu", "device"):
        with on(acc) as dev:
            device = dev if name == "device" else torch.device("cpu")
            monkeypatch.setattr(pack.comfy[0], "get_torch_device", lambda: device)
            loaded, clip, vae = pack.specs.LOAD_SLIM.run(ckpt_name="slim.safetensors").values
            assert (loaded.load_device, loaded.offload_device) == (device, torch.device("cpu")) and clip is None
            after = loaded.clone()
            after.add_patches(lora, 0.8)
            outs[name] = _sampled(after, device, lowvram, monkeypatch)
            outs[name + " without"] = _sampled(loaded, device, lowvram, monkeypatch)
    assert (outs["device"] - outs["device without"]).abs().max() > 1e-3           # the LoRA acts
    torch.testing.assert_close(outs["device"], outs["cpu"], **CLOSE[acc])


def _slim_with_lora(pack, patcher, device, lora):
    """Slim UNet (adapters a.safetensors of models/sdslim) over ``patcher``'s BaseModel with ``device`` as the load
    device, and a LoRA after it."""
    slim = pack.specs.SLIM.run(model=_on(patcher, device), adapters="a.safetensors", strength=1.0,
                               enable=True).values[0]
    after = slim.clone()
    after.add_patches(lora, -0.4)
    return after


@pytest.mark.parametrize("lowvram", [False, True], ids=["full", "lowvram"])
def test_save_nodes_write_from_a_gpu_what_they_write_from_the_cpu(pack, model, tmp_path, lowvram, acc, monkeypatch):
    """Guards the Save nodes with a GPU: their forced load puts the patched weights on the load device (lowvram: the
    layers ComfyUI keeps on the CPU are patched there in place) and both writers read them from there (the
    safetensors stream, the GGUF quantiser). A slim MODEL with a LoRA after it, loaded on the device before the save
    (as after a sampling), is written byte for byte as from the CPU, stays loaded and computes what it computed;
    saved when not loaded, it is left unloaded, its weights back on the CPU."""
    import comfy.model_management as mm
    from sdslim_core.io.tensors import load_file
    pytest.importorskip("gguf")
    fp = pack.folder_paths
    _folders(fp, tmp_path, "sdslim", "checkpoints", "diffusion_models")
    patcher, weights = model
    _with_intercept(_aset(weights, 0.5)).save(tmp_path / "sdslim" / "a.safetensors")
    lora = _merged_loras(pack, weights)
    for name in ("cpu", "device"):
        with on(acc) as dev:
            device = dev if name == "device" else torch.device("cpu")
            m = _slim_with_lora(pack, patcher, device, lora)
            before = _sampled(m, device, lowvram, monkeypatch)
            mm.load_models_gpu([m])
            pack.specs.SAVE_SLIM.run(model=m, filename=name, destination="checkpoints", overwrite=False,
                                     embed_adapters=False, dtype="as held")
            pack.specs.SAVE_GGUF.run(model=m, filename=name, quant="Q8_0", overwrite=False, embed_adapters=False)
            assert [lm.model for lm in mm.current_loaded_models] == [m]
            mm.unload_all_models()
            state = _load_state(m)
            pack.specs.SAVE_SLIM.run(model=m, filename=f"{name}_unloaded", destination="checkpoints",
                                     overwrite=False, embed_adapters=False, dtype="as held")
            assert _load_state(m) == state and not mm.current_loaded_models            # loaded by it: unloaded
            torch.testing.assert_close(_sampled(m, device, lowvram, monkeypatch), before, **SAME[acc])
    cpu, got = (load_file(tmp_path / "checkpoints" / f"{n}.safetensors")[0] for n in ("cpu", "device"))
    assert got.keys() == cpu.keys()
    for k in cpu:
        torch.testing.assert_close(got[k], cpu[k], **SAME[acc])
    if acc == "emulated":                 # on cuda a weight rounded otherwise may quantise to the next step
        gguf = [(tmp_path / "diffusion_models" / f"{n}.gguf").read_bytes() for n in ("cpu", "device")]
        assert gguf[0] == gguf[1]


def test_vram_report_names_a_gpu_that_is_not_cuda_and_what_is_loaded_on_it(pack, model, tmp_path, monkeypatch):
    """Guards VRAM Report on a GPU that is not CUDA (MPS, XPU, DirectML): it said "CPU only: no GPU, VRAM n/a" for
    every device but CUDA. With a slim model loaded on the (emulated) device by ComfyUI's loader and sampled through
    Slim UNet's monitor, the report names the device and ComfyUI's memory figures for it, the slim model loaded
    there and the sampling's device. (CUDA's own counters are not emulated: bench/gpu_suite.py reads them.)"""
    from emulated_device import emulated_device
    import comfy.model_management as mm
    fp = pack.folder_paths
    _folders(fp, tmp_path, "sdslim")
    patcher, weights = model
    _aset(weights, 0.5).save(tmp_path / "sdslim" / "a.safetensors")

    class Executor:
        def __init__(self, slim):
            self.class_obj = types.SimpleNamespace(model_patcher=slim)

        def __call__(self, noise):
            return noise + 1
    with emulated_device() as dev:
        monkeypatch.setattr(mm, "get_torch_device", lambda: dev)
        slim = pack.specs.SLIM.run(model=_on(patcher, dev), adapters="a.safetensors", strength=1.0,
                                   enable=True).values[0]
        mm.load_models_gpu([slim])
        pack.monitor.outer_sample_wrapper(Executor(slim), torch.zeros(1, 4, 8, 8, device=dev))
        (text,) = pack.specs.VRAM_REPORT.run(model=slim, model_b=patcher).values
        mm.unload_all_models()
    assert "CPU only" not in text and f"device: {dev}\nmemory total" in text, text
    assert f"BaseModel (slim): weights {files.format_bytes(slim.model_size())}, on {dev}" in text
    assert f"s on {dev}, slim BaseModel" in text and f"{dev}: no VRAM peak" in text


def test_train_node_trains_on_the_models_load_device(pack, tmp_path, acc, monkeypatch):
    """Guards Train Slim Adapters with a GPU: the node trains on the MODEL's load device, the teacher merged from the
    MODEL's patches. The first GPU run's training stopped on the device in stage 2 (ops/fold.py out_bias_shift, an
    FF intercept left on the CPU) and in the plan's warm-up (modules/swap.py ResDown): tests/test_device_placement.py
    guards those in the core; here a refit from the node (start_from: the file's sites and ranks, a short stage 2)
    runs its stage 2 on the device and writes finite adapters of those sites and ranks. Its values are not compared
    with a CPU run's: the initialisation's linear algebra is float64 on the CPU and float32 on an accelerator by
    design, so selections may differ. The UNet is the smallest with SD1.5's structure (the initialisation's many
    small steps are slow on the emulated device). Not emulated: a MODEL already loaded on the device (the
    emulation's tensor subclass is refused as quantised weights are)."""
    import comfy.model_base
    import comfy.ops
    import sdslim_core.train
    from sdslim_core.modules import swap
    training = importlib.import_module("sdslim_nodes_under_test.training")
    fp = pack.folder_paths
    _folders(fp, tmp_path, "sdslim")
    micro = layout.UNetConfig(family="sd15", in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2),
                              num_res_blocks=1, transformer_depth=(1, 0), mid_transformer_depth=1, context_dim=32,
                              use_linear_proj=False, adm_in_channels=None, num_heads=2, time_embed_dim=128)
    base = comfy.model_base.BaseModel()
    base.diffusion_model = _comfy_classes(randomize_(ldm_unet(micro)).eval(), comfy.ops)
    weights = {k: v.clone() for k, v in base.diffusion_model.state_dict().items()}
    start = _with_intercept(_aset(weights, 0.5))
    start.save(tmp_path / "sdslim" / "start.safetensors")
    lora = _merged_loras(pack, weights)
    positive = [[torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(0)), {}]]
    calls, real_train, real_slim = [], sdslim_core.train.train_adapters, swap.slim_module
    monkeypatch.setattr(sdslim_core.train, "train_adapters", lambda *a, **k: calls.append(k["device"]) or real_train(
        *a, **{**k, "n_trajectories": 2, "sample_steps": 2}))
    monkeypatch.setattr(swap, "slim_module", lambda unet, *a, **k: calls.append(next(unet.parameters()).device)
                        or real_slim(unet, *a, **k))                # stage 2's measure: the folded UNet
    mm, real_free = comfy.model_management, comfy.model_management.free_memory
    monkeypatch.setattr(mm, "free_memory", lambda need, device, *a, **k: calls.append(("free", need, device))
                        or real_free(need, device, *a, **k))
    with on(acc) as dev:
        m = _on(types.SimpleNamespace(model=base), dev).clone()
        m.add_patches(lora, 0.5)
        calls.clear()
        training.run(m, "refit", ratio=0.5, steps=2, seed=0, positive=positive, latent_size=4,
                     start_from="start.safetensors")
    # ComfyUI's models leave the device first (all of them: the trainer holds its own teacher there)
    assert calls[0] == ("free", 1e30, torch.device(dev)) and calls[1] == str(dev) and dev in calls[2:], calls[:3]
    got = adapters.AdapterSet.load(tmp_path / "sdslim" / "refit.safetensors")
    assert got.ranks() == start.ranks() and got.metadata["sdslim.train"]["steps"]["stage2"] == 2
    assert all(torch.isfinite(t).all() for tensors in got.sites.values() for t in tensors.values())
