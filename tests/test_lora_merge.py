"""LoRA/LyCORIS/peft merge into canonical weights, each format against an independent float64 reference."""
import math

import pytest
import torch

from conftest import randomize_, tiny_config
from sdslim_core import layout
from sdslim_core.io import lora_files
from sdslim_core.io.tensors import save_file_atomic
from sdslim_core.ops import lora

TOL = 1e-12
CFG = tiny_config()

# Canonical modules used as targets: attention and FF linears, 1×1 proj conv, 3×3 Res convs, emb linear, skip.
ATTN_Q = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
ATTN_K2 = "output_blocks.3.1.transformer_blocks.0.attn2.to_k"
FF_PROJ = "input_blocks.4.1.transformer_blocks.0.ff.net.0.proj"
FF_OUT = "middle_block.1.transformer_blocks.0.ff.net.2"
PROJ_IN = "input_blocks.1.1.proj_in"
CONV1 = "input_blocks.1.0.in_layers.2"
CONV2 = "output_blocks.2.0.out_layers.3"
EMB = "middle_block.0.emb_layers.1"
SKIP = "output_blocks.0.0.skip_connection"


@pytest.fixture(scope="module")
def base():
    """(diffusers state dict, canonical weights) of a random float64 tiny SD1.5-structure UNet."""
    from sdslim_core.modules.unet import build_diffusers_unet
    torch.manual_seed(0)
    unet = randomize_(build_diffusers_unet(CFG, dtype=torch.float64))
    sd = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    return sd, layout.to_canonical(sd)[0]


def rnd(g, *shape, scale=0.3):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def rounded_once_to_fp16(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether float16 ``got`` is float32 ``ref`` rounded once: within half an fp16 step of it (plus float32's own
    rounding, as the merge's matmul and the reference's need not round alike). A sum done in float16, or a delta
    rounded to float16 before it is added, is off by more than that somewhere."""
    _, e = torch.frexp(ref)
    half_step = torch.maximum(torch.ldexp(torch.ones_like(ref), e - 12), torch.full_like(ref, 2.0 ** -25))
    return got.dtype == torch.float16 and bool(((got.float() - ref).abs() <= half_step * (1 + 2 ** -10)
                                                + ref.abs() * 2 ** -22).all())


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def diffusers_name(canon_module):
    return layout.canonical_to_diffusers_key(CFG, canon_module)


def check(merged, weights, expected):
    """``merged`` holds exactly the keys of ``expected`` (key → reference tensor) and matches each."""
    assert set(merged) == set(expected)
    for k, ref in expected.items():
        assert merged[k].dtype == weights[k].dtype
        assert rel(merged[k], ref) < TOL, k
        assert rel(ref, weights[k]) > 1e-4, k          # the reference really changed the weight


# -------------------------------------------------------------------------------------------- kohya LoRA

def test_kohya_lora_both_namings_linear_and_conv(base):
    _, w = base
    g = torch.Generator().manual_seed(1)
    sd, expected = {}, {}
    # SD1.x kohya names come from diffusers module paths, SDXL kohya names from LDM paths: use both.
    targets = [(ATTN_Q, "diffusers"), (ATTN_K2, "ldm"), (FF_PROJ, "diffusers"), (FF_OUT, "ldm"),
               (PROJ_IN, "diffusers"), (EMB, "ldm"), (SKIP, "diffusers")]
    strength = 0.8
    for i, (module, naming) in enumerate(targets):
        path = diffusers_name(module) if naming == "diffusers" else module
        name = "lora_unet_" + path.replace(".", "_")
        W = w[module + ".weight"]
        r, alpha = 2 + i % 3, 1.0 + i
        down, up = rnd(g, r, *W.shape[1:]), rnd(g, W.shape[0], r, *([1] * (W.ndim - 2)))
        sd.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                   f"{name}.alpha": torch.tensor(alpha)})
        delta = (up.reshape(W.shape[0], r) @ down.reshape(r, -1)).reshape(W.shape)
        expected[module + ".weight"] = W + strength * alpha / r * delta
    merged, report = lora.merge_loras(w, [(sd, strength)], CFG)
    check(merged, w, expected)
    assert not report.unknown and not report.warnings
    assert len(report.merged) == len(targets)


def test_locon_3x3_down_1x1_up_and_tucker_mid(base, tmp_path):
    _, w = base
    g = torch.Generator().manual_seed(2)
    sd, expected = {}, {}
    W1, W2 = w[CONV1 + ".weight"], w[CONV2 + ".weight"]
    r = 4
    # plain LoCon on conv1 (diffusers kohya name), 3×3 down and 1×1 up
    n1 = "lora_unet_" + diffusers_name(CONV1).replace(".", "_")
    down, up = rnd(g, r, W1.shape[1], 3, 3), rnd(g, W1.shape[0], r, 1, 1)
    sd.update({f"{n1}.lora_down.weight": down, f"{n1}.lora_up.weight": up, f"{n1}.alpha": torch.tensor(2.0)})
    ref = torch.einsum("or,rikl->oikl", up[:, :, 0, 0], down)
    expected[CONV1 + ".weight"] = W1 + 2.0 / r * ref
    # Tucker LoCon on conv2 (LDM kohya name): 1×1 down, 3×3 mid, 1×1 up
    n2 = "lora_unet_" + CONV2.replace(".", "_")
    down2, mid, up2 = rnd(g, r, W2.shape[1], 1, 1), rnd(g, r, r, 3, 3), rnd(g, W2.shape[0], r, 1, 1)
    sd.update({f"{n2}.lora_down.weight": down2, f"{n2}.lora_mid.weight": mid, f"{n2}.lora_up.weight": up2,
               f"{n2}.alpha": torch.tensor(8.0)})
    ref2 = torch.einsum("op,pqkl,qi->oikl", up2[:, :, 0, 0], mid, down2[:, :, 0, 0])
    expected[CONV2 + ".weight"] = W2 + 8.0 / r * ref2
    path = tmp_path / "locon.safetensors"
    save_file_atomic(sd, path)
    merged, report = lora.merge_loras(w, [(str(path), 1.0)], CFG)
    check(merged, w, expected)
    assert report.loras[0]["formats"] == ["locon"]


# ------------------------------------------------------------------------------------------ LyCORIS

def test_loha_plain_and_tucker(base):
    _, w = base
    g = torch.Generator().manual_seed(3)
    sd, expected = {}, {}
    s = 0.6
    Wq = w[ATTN_Q + ".weight"]
    r = 3
    n = "lora_unet_" + ATTN_Q.replace(".", "_")
    w1a, w1b, w2a, w2b = rnd(g, Wq.shape[0], r), rnd(g, r, Wq.shape[1]), rnd(g, Wq.shape[0], r), rnd(g, r, Wq.shape[1])
    sd.update({f"{n}.hada_w1_a": w1a, f"{n}.hada_w1_b": w1b, f"{n}.hada_w2_a": w2a, f"{n}.hada_w2_b": w2b,
               f"{n}.alpha": torch.tensor(1.5)})
    expected[ATTN_Q + ".weight"] = Wq + s * 1.5 / r * (w1a @ w1b) * (w2a @ w2b)
    # Tucker LoHa on a 3×3 conv: w?_a [r, out], w?_b [r, in], t? [r, r, 3, 3]
    W1 = w[CONV1 + ".weight"]
    n = "lora_unet_" + diffusers_name(CONV1).replace(".", "_")
    t1, t2 = rnd(g, r, r, 3, 3), rnd(g, r, r, 3, 3)
    a1, b1, a2, b2 = rnd(g, r, W1.shape[0]), rnd(g, r, W1.shape[1]), rnd(g, r, W1.shape[0]), rnd(g, r, W1.shape[1])
    sd.update({f"{n}.hada_w1_a": a1, f"{n}.hada_w1_b": b1, f"{n}.hada_w2_a": a2, f"{n}.hada_w2_b": b2,
               f"{n}.hada_t1": t1, f"{n}.hada_t2": t2, f"{n}.alpha": torch.tensor(3.0)})
    half1 = torch.einsum("pqkl,po,qi->oikl", t1, a1, b1)
    half2 = torch.einsum("pqkl,po,qi->oikl", t2, a2, b2)
    expected[CONV1 + ".weight"] = W1 + s * 3.0 / r * half1 * half2
    # plain LoHa on a 3×3 conv stores flattened [r, in·9] factors
    W2 = w[CONV2 + ".weight"]
    n = "lora_unet_" + CONV2.replace(".", "_")
    c1a, c1b, c2a, c2b = (rnd(g, W2.shape[0], r), rnd(g, r, W2[0].numel()), rnd(g, W2.shape[0], r),
                          rnd(g, r, W2[0].numel()))
    sd.update({f"{n}.hada_w1_a": c1a, f"{n}.hada_w1_b": c1b, f"{n}.hada_w2_a": c2a, f"{n}.hada_w2_b": c2b})
    expected[CONV2 + ".weight"] = W2 + s * ((c1a @ c1b) * (c2a @ c2b)).reshape(W2.shape)   # no alpha: scale 1
    merged, report = lora.merge_loras(w, [(sd, s)], CFG)
    check(merged, w, expected)
    assert report.loras[0]["formats"] == ["loha"]


def test_lokr_full_factorised_conv_and_tucker(base):
    _, w = base
    g = torch.Generator().manual_seed(4)
    sd, expected = {}, {}
    # full w1 and w2 (no alpha scaling even with alpha present)
    W = w[FF_OUT + ".weight"]                      # [64, 256]
    n = "lora_unet_" + FF_OUT.replace(".", "_")
    k1, k2 = rnd(g, 4, 8), rnd(g, 16, 32)
    sd.update({f"{n}.lokr_w1": k1, f"{n}.lokr_w2": k2, f"{n}.alpha": torch.tensor(7.0)})
    expected[FF_OUT + ".weight"] = W + torch.kron(k1, k2)
    # factorised w1 and w2 on a linear: scale α/r
    W = w[ATTN_K2 + ".weight"]                     # [64, 64]
    n = "lora_unet_" + diffusers_name(ATTN_K2).replace(".", "_")
    r = 2
    a1, b1, a2, b2 = rnd(g, 4, r), rnd(g, r, 8), rnd(g, 16, r), rnd(g, r, 8)
    sd.update({f"{n}.lokr_w1_a": a1, f"{n}.lokr_w1_b": b1, f"{n}.lokr_w2_a": a2, f"{n}.lokr_w2_b": b2,
               f"{n}.alpha": torch.tensor(1.0)})
    expected[ATTN_K2 + ".weight"] = W + 1.0 / r * torch.kron(a1 @ b1, a2 @ b2)
    # conv, w2 factorised without Tucker: w2_b [r, in/c, 3, 3]
    W = w[CONV1 + ".weight"]                       # [32, 32, 3, 3]
    n = "lora_unet_" + CONV1.replace(".", "_")
    w1 = rnd(g, 4, 4)
    w2a, w2b = rnd(g, 8, r), rnd(g, r, 8, 3, 3)
    sd.update({f"{n}.lokr_w1": w1, f"{n}.lokr_w2_a": w2a, f"{n}.lokr_w2_b": w2b, f"{n}.alpha": torch.tensor(4.0)})
    w2 = torch.einsum("br,rdkl->bdkl", w2a, w2b).contiguous()
    expected[CONV1 + ".weight"] = W + 4.0 / r * torch.kron(w1[:, :, None, None], w2)
    # conv with a Tucker core on w2: t2 [r, r, 3, 3], w2_a [r, b], w2_b [r, d]
    W = w[CONV2 + ".weight"]                       # [64, 64, 3, 3]
    n = "lora_unet_" + diffusers_name(CONV2).replace(".", "_")
    w1 = rnd(g, 4, 4)
    t2, ta, tb = rnd(g, r, r, 3, 3), rnd(g, r, 16), rnd(g, r, 16)
    sd.update({f"{n}.lokr_w1": w1, f"{n}.lokr_t2": t2, f"{n}.lokr_w2_a": ta, f"{n}.lokr_w2_b": tb,
               f"{n}.alpha": torch.tensor(2.0)})
    w2 = torch.einsum("pqkl,pb,qd->bdkl", t2, ta, tb).contiguous()
    expected[CONV2 + ".weight"] = W + 2.0 / r * torch.kron(w1[:, :, None, None], w2)
    merged, report = lora.merge_loras(w, [(sd, 1.0)], CFG)
    check(merged, w, expected)
    assert report.loras[0]["formats"] == ["lokr"]


def _dora_ref(W, delta, m, strength, axis):
    merged = W + delta
    if axis == "out":
        norm = merged.reshape(W.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (W.ndim - 1))
        mm = m.reshape(norm.shape)
    else:
        norm = merged.transpose(0, 1).reshape(W.shape[1], -1).norm(dim=1).reshape(1, -1, *[1] * (W.ndim - 2))
        mm = m.reshape(norm.shape)
    return W + strength * (merged * mm / norm - W)


def test_dora_scale_on_both_axes_with_strength(base):
    _, w = base
    g = torch.Generator().manual_seed(5)
    sd, expected = {}, {}
    s = 0.7
    W = w[ATTN_Q + ".weight"]
    n = "lora_unet_" + ATTN_Q.replace(".", "_")
    down, up = rnd(g, 2, W.shape[1]), rnd(g, W.shape[0], 2)
    m = W.norm(dim=1, keepdim=True) * (1 + rnd(g, W.shape[0], 1))       # LyCORIS wd_on_out: [out, 1]
    sd.update({f"{n}.lora_down.weight": down, f"{n}.lora_up.weight": up, f"{n}.alpha": torch.tensor(1.0),
               f"{n}.dora_scale": m})
    expected[ATTN_Q + ".weight"] = _dora_ref(W, 0.5 * up @ down, m, s, "out")
    W = w[CONV1 + ".weight"]
    n = "lora_unet_" + CONV1.replace(".", "_")
    down, up = rnd(g, 3, W.shape[1], 3, 3), rnd(g, W.shape[0], 3, 1, 1)
    m = (1 + rnd(g, 1, W.shape[1], 1, 1)).abs()                          # kohya-style input axis: [1, in, 1, 1]
    sd.update({f"{n}.lora_down.weight": down, f"{n}.lora_up.weight": up, f"{n}.dora_scale": m})
    delta = torch.einsum("or,rikl->oikl", up[:, :, 0, 0], down)
    expected[CONV1 + ".weight"] = _dora_ref(W, delta, m, s, "in")
    merged, report = lora.merge_loras(w, [(sd, s)], CFG)
    check(merged, w, expected)
    assert report.loras[0]["formats"] == ["locon+dora", "lora+dora"]


# ------------------------------------------------------------------------------ diffusers / peft / ComfyUI

def test_peft_file_from_real_peft_adapter_with_dora_and_alpha_metadata(base, tmp_path):
    """A LoRA saved the diffusers way (peft state dict, ``unet.`` prefix, alpha in lora_adapter_metadata),
    checked against the float64 formula and against peft's own merge."""
    import json
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from sdslim_core.modules.unet import build_diffusers_unet
    sd_full, w = base
    unet = build_diffusers_unet(CFG, device="cpu", dtype=torch.float64)
    unet.load_state_dict(sd_full)
    targets = ["attn1.to_q", "attn2.to_k", "ff.net.2", "conv1", "time_emb_proj"]
    unet.add_adapter(LoraConfig(r=4, lora_alpha=6, target_modules=targets, use_dora=True))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_" in name:
                p.copy_(rnd(g, *p.shape))
    peft_sd = get_peft_model_state_dict(unet)
    assert any(k.endswith("lora_magnitude_vector") for k in peft_sd)
    path = tmp_path / "pytorch_lora_weights.safetensors"
    save_file_atomic({"unet." + k: v for k, v in peft_sd.items()}, path,
                     {"lora_adapter_metadata": json.dumps({"unet.r": 4, "unet.lora_alpha": 6, "unet.use_dora": True})})
    merged, report = lora.merge_loras(w, [(str(path), 1.0)], CFG)
    # float64 formula per module
    expected = {}
    for k in peft_sd:
        if not k.endswith("lora_A.weight"):
            continue
        mod = k[:-len(".lora_A.weight")]
        canon = layout.diffusers_to_canonical_key(CFG, mod)
        W = w[canon + ".weight"]
        A, B, m = peft_sd[k], peft_sd[mod + ".lora_B.weight"], peft_sd[mod + ".lora_magnitude_vector"]
        delta = (B.reshape(B.shape[0], -1) @ A.reshape(A.shape[0], -1)).reshape(W.shape) * 6 / 4
        expected[canon + ".weight"] = _dora_ref(W, delta, m, 1.0, "out")
    check(merged, w, expected)
    # peft's own merge agrees
    from peft.tuners.tuners_utils import BaseTunerLayer
    for name, module in unet.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            canon = layout.diffusers_to_canonical_key(CFG, name)
            assert rel(merged[canon + ".weight"], module.get_base_layer().weight.detach()) < 1e-10, name
    assert len(report.merged) == len(expected) and not report.unknown


def test_diffusers_lora_down_up_processor_and_comfy_prefixes(base):
    _, w = base
    g = torch.Generator().manual_seed(7)
    sd, expected = {}, {}

    def add(key_down, key_up, module, alpha_key=None, alpha=None):
        W = w[module + ".weight"]
        r = 2
        down, up = rnd(g, r, *W.shape[1:]), rnd(g, W.shape[0], r, *([1] * (W.ndim - 2)))
        sd[key_down], sd[key_up] = down, up
        scale = 1.0
        if alpha_key:
            sd[alpha_key] = torch.tensor(alpha)
            scale = alpha / r
        expected[module + ".weight"] = W + scale * (up.reshape(W.shape[0], r) @ down.reshape(r, -1)).reshape(W.shape)

    d = "unet." + diffusers_name(ATTN_Q)
    add(f"{d}.lora.down.weight", f"{d}.lora.up.weight", ATTN_Q, f"{d}.alpha", 4.0)
    attn = "unet." + diffusers_name(ATTN_K2).rsplit(".", 1)[0]
    add(f"{attn}.processor.to_k_lora.down.weight", f"{attn}.processor.to_k_lora.up.weight", ATTN_K2)
    out0 = ATTN_K2.rsplit(".", 1)[0] + ".to_out.0"
    add(f"{attn}.processor.to_out_lora.down.weight", f"{attn}.processor.to_out_lora.up.weight", out0)
    c = "diffusion_model." + CONV1                                         # ComfyUI-style
    add(f"{c}.lora_down.weight", f"{c}.lora_up.weight", CONV1, f"{c}.alpha", 1.0)
    c2 = "model.diffusion_model." + FF_PROJ
    add(f"{c2}.lora_A.weight", f"{c2}.lora_B.weight", FF_PROJ)
    merged, report = lora.merge_loras(w, [(sd, 1.0)], CFG)
    check(merged, w, expected)
    assert not report.unknown


def test_text_encoder_and_unknown_keys_are_reported_by_name(base):
    _, w = base
    g = torch.Generator().manual_seed(8)
    W = w[ATTN_Q + ".weight"]
    n = "lora_unet_" + ATTN_Q.replace(".", "_")
    sd = {f"{n}.lora_down.weight": rnd(g, 2, W.shape[1]), f"{n}.lora_up.weight": rnd(g, W.shape[0], 2),
          "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": rnd(g, 2, 8),
          "lora_te1_text_model_encoder_layers_0_mlp_fc1.alpha": torch.tensor(1.0),
          "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": rnd(g, 8, 2),
          "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": rnd(g, 2, 8),
          "lora_unet_" + ATTN_Q.replace(".", "_") + ".on_input": rnd(g, 4),        # (IA)³: not supported
          "something_else.weight": rnd(g, 3),
          "bundle_emb.mytoken.string_to_param.*": rnd(g, 1, 8)}
    merged, report = lora.merge_loras(w, [(sd, 1.0)], CFG)
    assert set(merged) == {ATTN_Q + ".weight"}
    te = {k.split(":", 1)[1] for k in report.ignored_text_encoder}
    assert te == {k for k in sd if k.startswith(("lora_te", "text_encoder."))}
    assert {k.split(":", 1)[1] for k in report.unknown} == {n + ".on_input", "something_else.weight"}
    assert any("bundle_emb.mytoken" in k for k in report.ignored)
    assert any("not understood" in x and "something_else.weight" in x for x in report.warnings)


def test_norm2_delta_is_warned_by_key_and_only_changed_keys_returned(base):
    _, w = base
    g = torch.Generator().manual_seed(9)
    site = "input_blocks.1.0"
    sd = {f"lora_unet_{site.replace('.', '_')}_out_layers_0.w_norm": rnd(g, 32),
          f"lora_unet_{site.replace('.', '_')}_out_layers_0.b_norm": rnd(g, 32),
          f"diffusion_model.{SKIP}.diff": rnd(g, *w[SKIP + ".weight"].shape),
          f"diffusion_model.{SKIP}.diff_b": rnd(g, *w[SKIP + ".bias"].shape)}
    before = {k: v.clone() for k, v in w.items()}
    merged, report = lora.merge_loras(w, [(sd, 0.5)], CFG, fold_sites=[site, "output_blocks.0.0"])
    expected = {f"{site}.out_layers.0.weight": w[f"{site}.out_layers.0.weight"] + 0.5 * sd[next(iter(sd))],
                f"{site}.out_layers.0.bias": w[f"{site}.out_layers.0.bias"] + 0.5 * list(sd.values())[1],
                SKIP + ".weight": w[SKIP + ".weight"] + 0.5 * sd[f"diffusion_model.{SKIP}.diff"],
                SKIP + ".bias": w[SKIP + ".bias"] + 0.5 * sd[f"diffusion_model.{SKIP}.diff_b"]}
    check(merged, w, expected)
    assert all(torch.equal(before[k], w[k]) for k in w)                   # input untouched
    warned = [x for x in report.warnings if "norm2" in x]
    assert len(warned) == 2 and all("input_blocks_1_0_out_layers_0" in x for x in warned)
    assert not any("skip_connection" in x for x in report.warnings)       # not replaced by the fold


def test_strengths_order_keys_filter_and_dtype(base):
    _, w = base
    g = torch.Generator().manual_seed(10)
    W = w[ATTN_Q + ".weight"]
    n = "lora_unet_" + ATTN_Q.replace(".", "_")
    n2 = "lora_unet_" + CONV1.replace(".", "_")
    a = {f"{n}.lora_down.weight": rnd(g, 2, W.shape[1]), f"{n}.lora_up.weight": rnd(g, W.shape[0], 2),
         f"{n2}.lora_down.weight": rnd(g, 2, 32, 3, 3), f"{n2}.lora_up.weight": rnd(g, 32, 2, 1, 1)}
    b = {f"{n}.lora_down.weight": rnd(g, 3, W.shape[1]), f"{n}.lora_up.weight": rnd(g, W.shape[0], 3)}
    merged, report = lora.merge_loras(w, [(a, 0.5), (b, -1.25)], CFG)
    da = a[f"{n}.lora_up.weight"] @ a[f"{n}.lora_down.weight"]
    db = b[f"{n}.lora_up.weight"] @ b[f"{n}.lora_down.weight"]
    assert rel(merged[ATTN_Q + ".weight"], W + 0.5 * da - 1.25 * db) < TOL
    assert len(report.merged[ATTN_Q + ".weight"]) == 2
    only, _ = lora.merge_loras(w, [(a, 0.5)], CFG, keys={CONV1 + ".weight"})
    assert set(only) == {CONV1 + ".weight"}
    none, _ = lora.merge_loras(w, [(a, 0.0)], CFG)
    assert none == {}
    # fp16 base: computed in float32, returned in float16
    w16 = {k: v.half() for k, v in w.items()}
    m16, _ = lora.merge_loras(w16, [(a, 0.5)], CFG)
    ref32 = w16[ATTN_Q + ".weight"].float() + 0.5 * da.float()
    assert m16[ATTN_Q + ".weight"].dtype == torch.float16
    assert rounded_once_to_fp16(m16[ATTN_Q + ".weight"], ref32)      # not equal: float32 matmuls round differently


def test_sdxl_lora_on_sd15_is_a_clear_error(base):
    from sdslim_core.modules.unet import build_diffusers_unet
    _, w = base
    xl_cfg = tiny_config("sdxl", context_dim=96)
    xl = layout.to_canonical({k: tuple(v.shape) for k, v in
                              build_diffusers_unet(xl_cfg, device="meta").state_dict().items()})[0]
    g = torch.Generator().manual_seed(11)
    sd = {}
    for k, shp in xl.items():                                            # kohya SDXL: LDM names, attention only
        if ".attn" in k and k.endswith(".weight"):
            n = "lora_unet_" + k[:-len(".weight")].replace(".", "_")
            sd[f"{n}.lora_down.weight"], sd[f"{n}.lora_up.weight"] = rnd(g, 2, shp[1]), rnd(g, shp[0], 2)
    with pytest.raises(lora_files.LoraError, match="another"):
        lora.merge_loras(w, [(sd, 1.0)], CFG)


def test_module_index_has_no_guessed_names():
    shapes = {k: tuple(v) for k, v in layout.to_canonical(
        {k: tuple(v.shape) for k, v in __import__("sdslim_core.modules.unet", fromlist=["x"]).build_diffusers_unet(
            CFG, device="meta").state_dict().items()})[0].items()}
    index = lora_files.ModuleIndex(CFG, shapes)
    modules = {k[:-len(".weight")] for k in shapes if k.endswith(".weight")}
    assert set(index.underscore.values()) == modules
    assert index.resolve_kohya("down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0") == \
        "input_blocks.1.1.transformer_blocks.0.attn1.to_out.0"
    assert index.resolve_kohya("input_blocks_1_1_transformer_blocks_0_attn1_to_out_0") == \
        "input_blocks.1.1.transformer_blocks.0.attn1.to_out.0"
    assert index.resolve_kohya("down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out") is None
    assert not index.ambiguous
    assert math.isclose(lora_files.parse_lora_arg("C:/x/y.safetensors:0.5")[1], 0.5)
    assert lora_files.parse_lora_arg("C:/x/y.safetensors") == ("C:/x/y.safetensors", 1.0)


def test_sdxl_structure_kohya_ldm_and_diffusers_names():
    """SDXL kohya LoRAs use LDM names (label_emb, second transformer block); diffusers names must work too."""
    from sdslim_core.modules.unet import build_diffusers_unet
    cfg = tiny_config("sdxl")
    shapes = layout.to_canonical({k: tuple(v.shape) for k, v in
                                  build_diffusers_unet(cfg, device="meta").state_dict().items()})[0]
    g = torch.Generator().manual_seed(12)
    w = {k: rnd(g, *s) for k, s in shapes.items()}
    targets = {"label_emb.0.0": "lora_unet_label_emb_0_0",
               "input_blocks.4.1.transformer_blocks.0.attn2.to_k": "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k",
               "middle_block.1.transformer_blocks.1.ff.net.0.proj":
                   "lora_unet_middle_block_1_transformer_blocks_1_ff_net_0_proj",
               "time_embed.2": "lora_unet_time_embedding_linear_2",                    # diffusers-derived
               "output_blocks.0.1.transformer_blocks.1.attn1.to_out.0":
                   "lora_unet_up_blocks_0_attentions_0_transformer_blocks_1_attn1_to_out_0"}
    sd, expected = {}, {}
    for module, name in targets.items():
        W = w[module + ".weight"]
        down, up = rnd(g, 3, W.shape[1]), rnd(g, W.shape[0], 3)
        sd.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(3.0)})
        expected[module + ".weight"] = W + up @ down
    merged, report = lora.merge_loras(w, [(sd, 1.0)], cfg)
    check(merged, w, expected)
    assert not report.unknown
