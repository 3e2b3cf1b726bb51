"""LoRAs converted into slim space (lora_slim) against fold(base + ΔW) − fold(base), in float64: every format lora.py
reads, on real-width layers and on tiny UNets in both namings."""
import pytest
import torch

from conftest import tiny_config
from sdslim_core import layout
from sdslim_core.io import adapters, lora_files
from sdslim_core.ops import fold, lora, lora_slim
from test_fold import random_adapters

TOL = 1e-12
CFG15 = layout.config_for_arch("sd15")
FF = "input_blocks.1.1.transformer_blocks.0.ff"
RES = "input_blocks.1.0"
PROJ, OUT = f"{FF}.net.0.proj", f"{FF}.net.2"
CONV1, EMB, NORM2, CONV2 = (f"{RES}.{n}" for n in ("in_layers.2", "emb_layers.1", "out_layers.0", "out_layers.3"))
ATTN = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"


def rnd(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def real_width():
    """Canonical float64 weights of one real-width FF site (d=320, m=1280), one Res site (c=320, emb 1280) and an
    attention layer of SD1.5, with dense random adapters at ratio 0.5 (FF r=640, Res r=160)."""
    g = torch.Generator().manual_seed(0)
    d, m, c, e = 320, 1280, 320, 1280
    w = {f"{PROJ}.weight": rnd(g, 2 * m, d, scale=d ** -.5), f"{PROJ}.bias": rnd(g, 2 * m),
         f"{OUT}.weight": rnd(g, d, m, scale=m ** -.5), f"{OUT}.bias": rnd(g, d),
         f"{RES}.in_layers.0.weight": rnd(g, c), f"{RES}.in_layers.0.bias": rnd(g, c),
         f"{CONV1}.weight": rnd(g, c, c, 3, 3, scale=1 / 54), f"{CONV1}.bias": rnd(g, c),
         f"{EMB}.weight": rnd(g, c, e, scale=e ** -.5), f"{EMB}.bias": rnd(g, c),
         f"{NORM2}.weight": rnd(g, c), f"{NORM2}.bias": rnd(g, c),
         f"{CONV2}.weight": rnd(g, c, c, 3, 3, scale=1 / 54), f"{CONV2}.bias": rnd(g, c),
         f"{ATTN}.weight": rnd(g, d, d, scale=d ** -.5)}
    r_ff, r_res = 640, 160
    aset = adapters.AdapterSet("sd15", {
        FF: {"down_value": rnd(g, r_ff, m, scale=m ** -.5), "down_gate": rnd(g, r_ff, m, scale=m ** -.5),
             "up": rnd(g, m, r_ff, scale=r_ff ** -.5)},
        RES: {"down": rnd(g, r_res, c, scale=c ** -.5), "norm.weight": rnd(g, r_res), "norm.bias": rnd(g, r_res),
              "up": rnd(g, c, r_res, scale=r_res ** -.5)}})
    return w, aset


def kohya(module, naming="diffusers"):
    path = layout.canonical_to_diffusers_key(CFG15, module) if naming == "diffusers" else module
    return "lora_unet_" + path.replace(".", "_")


def add_lora(sd, g, module, shape, rank, alpha=None, kernel_in_down=True, tucker=False):
    """kohya LoRA/LoCon (3×3 in the down factor) or Tucker LoCon (1×1 down, 3×3 mid) on ``module``."""
    n = kohya(module)
    conv = len(shape) == 4
    if tucker:
        sd[f"{n}.lora_down.weight"] = rnd(g, rank, shape[1], 1, 1, scale=0.1)
        sd[f"{n}.lora_mid.weight"] = rnd(g, rank, rank, *shape[2:], scale=0.1)
    else:
        sd[f"{n}.lora_down.weight"] = rnd(g, rank, *shape[1:], scale=0.1)
    sd[f"{n}.lora_up.weight"] = rnd(g, shape[0], rank, *([1, 1] if conv else []), scale=0.1)
    if alpha is not None:
        sd[f"{n}.alpha"] = torch.tensor(float(alpha))


def lycoris_file(g, shapes):
    """LoHa (plain on proj, Tucker on conv2), LoKr (factorised on net.2, Tucker on conv1), full diff with bias on emb,
    LDM-style kohya names (the SDXL convention) and a norm2 delta."""
    sd = {}
    n = kohya(PROJ, "ldm")
    o, i = shapes[PROJ]
    sd.update({f"{n}.hada_w1_a": rnd(g, o, 4, scale=0.1), f"{n}.hada_w1_b": rnd(g, 4, i, scale=0.1),
               f"{n}.hada_w2_a": rnd(g, o, 4, scale=0.1), f"{n}.hada_w2_b": rnd(g, 4, i, scale=0.1),
               f"{n}.alpha": torch.tensor(2.0)})
    n = kohya(CONV2, "ldm")
    o, i = shapes[CONV2][:2]
    sd.update({f"{n}.hada_w1_a": rnd(g, 4, o, scale=0.1), f"{n}.hada_w1_b": rnd(g, 4, i, scale=0.1),
               f"{n}.hada_w2_a": rnd(g, 4, o, scale=0.1), f"{n}.hada_w2_b": rnd(g, 4, i, scale=0.1),
               f"{n}.hada_t1": rnd(g, 4, 4, 3, 3, scale=0.3), f"{n}.hada_t2": rnd(g, 4, 4, 3, 3, scale=0.3)})
    n = kohya(OUT, "ldm")                                    # [320, 1280] = kron([4, 8], [80, 160])
    sd.update({f"{n}.lokr_w1": rnd(g, 4, 8, scale=0.3), f"{n}.lokr_w2_a": rnd(g, 80, 3, scale=0.3),
               f"{n}.lokr_w2_b": rnd(g, 3, 160, scale=0.3), f"{n}.alpha": torch.tensor(1.5)})
    n = kohya(CONV1, "ldm")                                  # [320, 320, 3, 3] = kron([4, 4], [80, 80, 3, 3])
    sd.update({f"{n}.lokr_w1": rnd(g, 4, 4, scale=0.3), f"{n}.lokr_t2": rnd(g, 2, 2, 3, 3, scale=0.3),
               f"{n}.lokr_w2_a": rnd(g, 2, 80, scale=0.3), f"{n}.lokr_w2_b": rnd(g, 2, 80, scale=0.3),
               f"{n}.alpha": torch.tensor(4.0)})
    n = kohya(EMB, "ldm")
    sd.update({f"{n}.diff": rnd(g, *shapes[EMB], scale=0.01), f"{n}.diff_b": rnd(g, shapes[EMB][0], scale=0.01)})
    n = kohya(NORM2, "ldm")
    sd.update({f"{n}.w_norm": rnd(g, 320, scale=0.1), f"{n}.b_norm": rnd(g, 320, scale=0.1)})
    return sd


def slim_apply(weights, aset, loras, cfg, space=None):
    """fold(base), then every LoRA converted into slim space and added with its strength; also the conversions."""
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    space = space or lora_slim.SlimSpace(aset, shapes)
    merger = lora.LoraMerger(loras, cfg, shapes)
    slim_w = {**weights, **fold.fold_state_dict(weights, aset)}
    conversions = []
    for mods, strength in merger.parsed:
        conv = lora_slim.convert_modules(mods, space)
        conversions.append(conv)
        plan = {}
        for mod in conv.modules:
            for part in lora.module_parts(mod):
                plan.setdefault(f"{mod.target}.{part}", []).append((mod, strength, part))
        slim_w = {k: lora.apply_deltas(v, plan[k]) if k in plan else v for k, v in slim_w.items()}
    return slim_w, conversions


def fold_of_merged(weights, aset, loras, cfg):
    merged, _ = lora.merge_loras(weights, loras, cfg)
    both = {**weights, **merged}
    return {**both, **fold.fold_state_dict(both, aset)}, merged


def assert_equal_states(got, ref, base_slim):
    assert got.keys() == ref.keys()
    changed = 0
    for k in ref:
        assert got[k].shape == ref[k].shape, k
        if ref[k].norm() == 0:
            assert got[k].norm() == 0, k
            continue
        assert rel(got[k], ref[k]) < TOL, k
        changed += not torch.equal(ref[k], base_slim[k])
    return changed


# ---------------------------------------------------------------------------------------------- real width

def test_real_width_lora_locon_tucker_equal_fold_of_merged_and_keep_rank(real_width):
    w, aset = real_width
    g = torch.Generator().manual_seed(1)
    shapes = {k[:-len(".weight")]: tuple(v.shape) for k, v in w.items() if k.endswith(".weight")}
    sd = {}
    add_lora(sd, g, PROJ, shapes[PROJ], 16, alpha=8)
    add_lora(sd, g, OUT, shapes[OUT], 16)                    # no alpha: scale 1
    add_lora(sd, g, EMB, shapes[EMB], 8, alpha=2)
    add_lora(sd, g, CONV1, shapes[CONV1], 16, alpha=4)       # LoCon: 3×3 down, 1×1 up
    add_lora(sd, g, CONV2, shapes[CONV2], 16, alpha=16)
    add_lora(sd, g, ATTN, shapes[ATTN], 16, alpha=8)
    tucker = {}
    add_lora(tucker, g, CONV1, shapes[CONV1], 8, alpha=4, tucker=True)
    add_lora(tucker, g, CONV2, shapes[CONV2], 8, alpha=2, tucker=True)
    loras = [(sd, 0.8), (tucker, -0.6)]
    got, (conv, conv_t) = slim_apply(w, aset, loras, CFG15)
    ref, _ = fold_of_merged(w, aset, loras, CFG15)
    base_slim = {**w, **fold.fold_state_dict(w, aset)}
    assert assert_equal_states(got, ref, base_slim) == 6    # proj, out, emb, conv1, conv2, attn weights
    # independent check of one layer: fold(W + s·(α/r)·B·A) − fold(W) = s·(α/r)·blockdiag(A_v, A_g)·B·A
    n = kohya(PROJ)
    B, A = sd[f"{n}.lora_up.weight"], sd[f"{n}.lora_down.weight"]
    t = aset.sites[FF]
    expect = 0.8 * 8 / 16 * torch.cat([t["down_value"] @ B[:1280], t["down_gate"] @ B[1280:]]) @ A
    assert rel(got[f"{PROJ}.weight"] - base_slim[f"{PROJ}.weight"], expect) < TOL
    assert conv.counts() == {"low-rank": 5, "dense": 0, "unchanged": 1, "dropped": 0}
    assert conv_t.counts()["low-rank"] == 2
    by_target = {m.target: m for m in conv.modules + conv_t.modules if "mid" not in m.tensors}
    assert by_target[PROJ].tensors["up"].shape == (1280, 16) and by_target[PROJ].tensors["down"].shape == (16, 320)
    assert by_target[OUT].tensors["down"].shape == (16, 640)
    assert by_target[CONV1].tensors["up"].shape == (160, 16, 1, 1)
    assert by_target[CONV2].tensors["down"].shape == (16, 160, 3, 3)   # the 3×3 factor absorbed U
    mid = [m for m in conv_t.modules if m.target == CONV2][0]
    assert mid.tensors["down"].shape == (8, 160, 1, 1) and mid.tensors["mid"] is tucker[f"{kohya(CONV2)}.lora_mid.weight"]


def test_ff_intercept_moves_the_slim_bias_of_a_lora_on_net2(real_width):
    """With an ``up_bias`` c, fold(W_o + ΔW) has bias b_o + (W_o + ΔW)·c: the net.2 LoRA becomes a dense delta
    carrying ΔW·c as its bias part, and the result still equals the fold of the merged weights (float64)."""
    w, aset = real_width
    g = torch.Generator().manual_seed(3)
    sites = {s: dict(t) for s, t in aset.sites.items()}
    sites[FF]["up_bias"] = rnd(g, 1280, scale=0.5)
    with_c = adapters.AdapterSet("sd15", sites, aset.norm_groups)
    shapes = {k[:-len(".weight")]: tuple(v.shape) for k, v in w.items() if k.endswith(".weight")}
    sd = {}
    add_lora(sd, g, OUT, shapes[OUT], 16, alpha=8)
    add_lora(sd, g, PROJ, shapes[PROJ], 16, alpha=8)
    got, (conv,) = slim_apply(w, with_c, [(sd, 0.7)], CFG15)
    ref, _ = fold_of_merged(w, with_c, [(sd, 0.7)], CFG15)
    base_slim = {**w, **fold.fold_state_dict(w, with_c)}
    assert assert_equal_states(got, ref, base_slim) == 3    # proj weight, out weight and out bias
    assert not torch.equal(got[f"{OUT}.bias"], base_slim[f"{OUT}.bias"])
    assert conv.counts() == {"low-rank": 1, "dense": 1, "unchanged": 0, "dropped": 0}


def test_real_width_loha_lokr_diff_dense_and_norm2_dropped(real_width):
    w, aset = real_width
    g = torch.Generator().manual_seed(2)
    shapes = {k[:-len(".weight")]: tuple(v.shape) for k, v in w.items() if k.endswith(".weight")}
    sd = lycoris_file(g, shapes)
    n = kohya(EMB)                                           # plain LoHa of rank 24·24: dearer as a LoRA than dense
    wide = {f"{n}.hada_w1_a": rnd(g, 320, 24, scale=0.1), f"{n}.hada_w1_b": rnd(g, 24, 1280, scale=0.1),
            f"{n}.hada_w2_a": rnd(g, 320, 24, scale=0.1), f"{n}.hada_w2_b": rnd(g, 24, 1280, scale=0.1)}
    loras = [(sd, 0.7), (wide, -1.1)]
    got, (conv, conv_wide) = slim_apply(w, aset, loras, CFG15)
    ref, merged = fold_of_merged(w, aset, loras, CFG15)
    base_slim = {**w, **fold.fold_state_dict(w, aset)}
    assert f"{NORM2}.weight" in merged                      # the full-size merge did change norm2 ...
    assert torch.equal(got[f"{NORM2}.weight"], base_slim[f"{NORM2}.weight"])   # ... which the fold replaces anyway
    assert assert_equal_states(got, ref, base_slim) == 6    # proj, out, conv1, conv2 weights; emb weight and bias
    # plain LoHa on proj: exactly a rank-16 (4·4) LoRA; Tucker LoHa, LoKr and the full diff: dense
    assert conv.counts() == {"low-rank": 1, "dense": 4, "unchanged": 0, "dropped": 1}
    assert conv_wide.counts() == {"low-rank": 0, "dense": 1, "unchanged": 0, "dropped": 0}
    assert len(conv.warnings) == 2 and all(NORM2 in x and "lost" in x for x in conv.warnings)
    new = {m.target: m for m in conv.modules}
    assert new[PROJ].kind == "lora" and new[PROJ].tensors["up"].shape == (1280, 16)
    assert all(new[k].kind == "diff" for k in (OUT, CONV1, CONV2, EMB))
    assert new[OUT].tensors["diff"].shape == (320, 640) and new[CONV2].tensors["diff"].shape == (320, 160, 3, 3)
    assert new[EMB].tensors["diff_b"].shape == (160,)


def test_dora_refused_on_folded_layers_kept_elsewhere_and_untouched_modules_pass_through(real_width):
    w, aset = real_width
    g = torch.Generator().manual_seed(3)
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    space = lora_slim.SlimSpace(aset, shapes)
    sd = {}
    add_lora(sd, g, ATTN, shapes[f"{ATTN}.weight"], 4, alpha=4)
    sd[f"{kohya(ATTN)}.dora_scale"] = rnd(g, 320, 1).abs() + 0.5
    mods = lora.LoraMerger([(sd, 1.0)], CFG15, shapes).parsed[0][0]
    assert space.convert(mods[0]) is mods[0]                # untouched layer: the very same module
    bad = dict(sd)
    add_lora(bad, g, PROJ, shapes[f"{PROJ}.weight"], 4, alpha=4)
    bad[f"{kohya(PROJ)}.dora_scale"] = rnd(g, 2560, 1).abs() + 0.5
    mods = lora.LoraMerger([(bad, 1.0)], CFG15, shapes).parsed[0][0]
    with pytest.raises(lora_files.LoraError, match="DoRA.*fold it instead"):
        lora_slim.convert_modules(mods, space)


def test_for_slim_recovers_the_full_shapes_of_sd15():
    from sdslim_core.modules.unet import canonical_shapes
    shapes = canonical_shapes(CFG15)
    aset = adapters.AdapterSet.shaped_like(shapes, CFG15.family, 0.5)
    slim_shapes = fold.slim_shapes(shapes, aset.ranks())
    assert slim_shapes != shapes
    assert lora_slim.SlimSpace.for_slim(aset, slim_shapes).full_shapes == {k: tuple(v) for k, v in shapes.items()}


# ------------------------------------------------------------------------------------------- tiny UNets

def _tiny_loras(w, cfg, g):
    """kohya LoRA/LoCon on every weight (SD1 diffusers-derived names), the same layers again as ComfyUI-keyed
    LoRAs (``diffusion_model.…``), peft ``lora_A``/``lora_B`` on FF and conv layers (diffusers dotted names), and
    LoHa on every GEGLU proj (LDM kohya names)."""
    k1, comfy, peft, loha = {}, {}, {}, {}
    for key, v in w.items():
        if not key.endswith(".weight") or v.ndim < 2:
            continue
        module = key[:-len(".weight")]
        name = "lora_unet_" + layout.canonical_to_diffusers_key(cfg, module).replace(".", "_")
        r = 2 + len(module) % 3
        k1[f"{name}.lora_down.weight"] = rnd(g, r, *v.shape[1:], scale=0.2)
        k1[f"{name}.lora_up.weight"] = rnd(g, v.shape[0], r, *([1] * (v.ndim - 2)), scale=0.2)
        k1[f"{name}.alpha"] = torch.tensor(1.5)
        comfy[f"diffusion_model.{module}.lora_down.weight"] = rnd(g, 2, *v.shape[1:], scale=0.2)
        comfy[f"diffusion_model.{module}.lora_up.weight"] = rnd(g, v.shape[0], 2, *([1] * (v.ndim - 2)), scale=0.2)
        if ".ff." in module or "in_layers.2" in module or "out_layers.3" in module:
            dotted = layout.canonical_to_diffusers_key(cfg, module)
            peft[f"unet.{dotted}.lora_A.weight"] = rnd(g, 3, *v.shape[1:], scale=0.2)
            peft[f"unet.{dotted}.lora_B.weight"] = rnd(g, v.shape[0], 3, *([1] * (v.ndim - 2)), scale=0.2)
        if module.endswith(".ff.net.0.proj"):
            n = "lora_unet_" + module.replace(".", "_")
            loha.update({f"{n}.hada_w1_a": rnd(g, v.shape[0], 2, scale=0.3), f"{n}.hada_w1_b": rnd(g, 2, v.shape[1]),
                         f"{n}.hada_w2_a": rnd(g, v.shape[0], 2, scale=0.3), f"{n}.hada_w2_b": rnd(g, 2, v.shape[1])})
    return [(k1, 0.7), (comfy, -0.4), (peft, 1.3), (loha, 0.5)]


@pytest.mark.parametrize("naming", ["diffusers", "ldm"])
def test_tiny_unets_every_naming_and_strength_equal_fold_of_merged(naming, tiny_diffusers_unet, tiny_ldm_unet):
    unet = tiny_diffusers_unet if naming == "diffusers" else tiny_ldm_unet
    w, found, _ = layout.to_canonical(dict(unet.state_dict()))
    assert found == naming
    cfg = tiny_config()
    aset = random_adapters(w, 0.5)
    loras = _tiny_loras(w, cfg, torch.Generator().manual_seed(7))
    slim_shapes = fold.slim_shapes({k: tuple(v.shape) for k, v in w.items()}, aset.ranks())
    got, conversions = slim_apply(w, aset, loras, cfg, lora_slim.SlimSpace.for_slim(aset, slim_shapes))
    ref, _ = fold_of_merged(w, aset, loras, cfg)
    base_slim = {**w, **fold.fold_state_dict(w, aset)}
    assert assert_equal_states(got, ref, base_slim) > 100
    counts = [c.counts() for c in conversions]
    assert counts[0]["low-rank"] == len(aset.sites) * 2 + sum(aset.kind(s) == "res" for s in aset.sites)
    n_ff = sum(aset.kind(s) == "ff" for s in aset.sites)
    assert counts[3] == {"low-rank": n_ff, "dense": 0, "unchanged": 0, "dropped": 0}   # LoHa rank 2·2


def test_apply_deltas_in_row_slabs_matches_the_whole_tensor(monkeypatch):
    """fp16 weights with plain LoRAs go a slab of rows at a time (no whole float32 copy); same result."""
    g = torch.Generator().manual_seed(5)
    base = (torch.randn(300, 40, 3, 3, generator=g) * 0.1).half()
    entries = []
    for s, r in ((0.8, 4), (-0.3, 8)):
        mod = lora_files.LoraModule("x", f"m{r}", "layer", "lora", {"up": rnd(g, 300, r, 1, 1, scale=0.1).half(),
                              "down": rnd(g, r, 40, 3, 3, scale=0.1).half(), "alpha": torch.tensor(2.0)}, [])
        entries.append((mod, s, "weight"))
    whole = lora.apply_deltas(base, entries).half()
    monkeypatch.setattr(lora, "_SLAB_BYTES", 64 * 360 * 4)              # 64 rows a slab: 5 slabs
    slabs = lora.apply_deltas(base, entries, out_dtype=torch.float16)
    assert slabs.dtype == torch.float16 and slabs.shape == base.shape
    ref = base.double() + sum(s * 2.0 / m.tensors["down"].shape[0] * (m.tensors["up"].double().flatten(1) @
                              m.tensors["down"].double().flatten(1)).reshape(base.shape) for m, s, _ in entries)
    assert (slabs.double() - whole.double()).abs().max() <= 2 ** -10 * ref.abs().max()   # within fp16 rounding
    assert rel(slabs.double(), ref) < 1e-3 and not torch.equal(slabs, base)
    inplace = base.clone()
    assert lora.apply_deltas(inplace, entries, out=inplace) is not None and torch.equal(inplace, slabs)
