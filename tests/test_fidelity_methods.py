"""The fidelity methods: OBS selection, whole-group ResBlock bottlenecks, the FF intercept, e2e allocation, stage-2
augmentations, quantisation round trips and the fidelity engine, each against an independent reference."""
import contextlib
import math

import pytest
import torch

from conftest import randomize_, tiny_config
from sdslim_core import layout, tiny
from sdslim_core.apps import fidelity
from sdslim_core.io import adapters
from sdslim_core.layout import rank_policy
from sdslim_core.modules import swap
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.ops import fold, quant
from sdslim_core.train import Calibration, TrainConfig, train_adapters
from sdslim_core.train.augment import Augmenter
from sdslim_core.train.calibration import InputBank, unet_call
from sdslim_core.train.init import obs_keep, obs_order

NULL = contextlib.nullcontext


# ------------------------------------------------------------------------------------------------- OBS

def _reconstruction_cost(cov, gram, kept):
    kept = list(kept)
    resid = cov - cov[:, kept] @ torch.linalg.solve(cov[kept][:, kept], cov[kept, :])
    return torch.trace(gram @ resid).item()


@pytest.mark.parametrize("m,group,r", [(12, 1, 5), (12, 3, 6), (16, 2, 8), (10, 1, 1)])
def test_obs_order_is_the_exact_greedy_removal(m, group, r):
    """Each removal is the one whose exact Schur-complement cost (recomputed from scratch) is lowest."""
    g = torch.Generator().manual_seed(m + group + r)
    x = torch.randn(300, m, generator=g, dtype=torch.float64) @ torch.randn(m, m, generator=g, dtype=torch.float64)
    cov = x.T @ x / 300
    w = torch.randn(7, m, generator=g, dtype=torch.float64)
    gram = w.T @ w
    blocks = list(range(m // group))
    while len(blocks) * group > r:
        def cost(b):
            return _reconstruction_cost(cov, gram, [i for c in blocks if c != b for i in range(c * group, c * group +
                                                                                             group)])
        blocks.remove(min(blocks, key=cost))
    want = sorted(i for b in blocks for i in range(b * group, b * group + group))
    assert obs_keep(obs_order(cov, gram, group), m, r, group).tolist() == want


def test_obs_beats_independent_scores_on_correlated_units():
    """Two copies of one strong unit: top-r scoring keeps both, OBS keeps one and a unit that adds information."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(500, 4, generator=g, dtype=torch.float64)
    h = torch.cat([base[:, :1] * 3, base[:, :1] * 3, base[:, 1:]], dim=1)      # units 0 and 1 identical
    cov, gram = h.T @ h / 500, torch.eye(5, dtype=torch.float64)
    kept = obs_keep(obs_order(cov, gram), 5, 2).tolist()
    assert len({0, 1} & set(kept)) == 1
    top = torch.topk(cov.diagonal(), 2).indices.tolist()
    assert set(top) == {0, 1}
    assert _reconstruction_cost(cov, gram, kept) < 0.7 * _reconstruction_cost(cov + 1e-9 * torch.eye(5), gram, [0, 1])


# -------------------------------------------------------------------------------------- group-aware Res

def test_whole_group_bottleneck_keeps_the_teachers_normalisation_exactly():
    """64 channels in 32 groups of 2: keeping whole groups with one GroupNorm group each gives the teacher's
    norm2 output on the kept channels (float64 exact); regrouping the same channels does not."""
    from diffusers.models.resnet import ResnetBlock2D
    torch.manual_seed(0)
    block = randomize_(ResnetBlock2D(in_channels=64, out_channels=64, temb_channels=16, groups=32).double().eval())
    x, emb = torch.randn(3, 64, 6, 6, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    idx = torch.tensor([2, 3, 10, 11, 40, 41, 62, 63])
    sel = torch.zeros(8, 64, dtype=torch.float64)
    sel[torch.arange(8), idx] = 1
    outs = {}
    for name, groups in (("whole groups", rank_policy.res_groups(64, 8)), ("per channel", 8)):
        tensors = {"down": sel, "norm.weight": block.norm2.weight[idx].detach(),
                   "norm.bias": block.norm2.bias[idx].detach(), "up": sel.T.contiguous()}
        student, _ = swap.train_site(block, "mid", "res", "diffusers", tensors, groups)
        got = {}
        h1 = student.norm2.register_forward_hook(lambda m, i, o: got.setdefault("s", o))
        h2 = block.norm2.register_forward_hook(lambda m, i, o: got.setdefault("t", o))
        with torch.no_grad():
            student(x, emb)
            block(x, emb)
        h1.remove()
        h2.remove()
        outs[name] = (got["s"] - got["t"][:, idx]).abs().max().item()
    assert rank_policy.res_groups(64, 8) == 4
    assert outs["whole groups"] < 1e-12 and outs["per channel"] > 1e-3


# ------------------------------------------------------------------------------------------ FF intercept

def test_ff_intercept_folds_exactly_into_the_output_bias_with_a_lora_merged_first():
    """train-time W_o (U h + c) + b_o on LoRA-merged weights == the folded layers (b'_o = b_o + W_o c), float64."""
    from diffusers.models.attention import FeedForward
    torch.manual_seed(1)
    ff = randomize_(FeedForward(320, activation_fn="geglu").double().eval())
    m, r = 1280, 96
    g = torch.Generator().manual_seed(2)
    t = {"down_value": torch.randn(r, m, generator=g, dtype=torch.float64),
         "down_gate": torch.randn(r, m, generator=g, dtype=torch.float64),
         "up": torch.randn(m, r, generator=g, dtype=torch.float64),
         "up_bias": torch.randn(m, generator=g, dtype=torch.float64)}
    with torch.no_grad():
        ff.net[2].weight += torch.randn(320, 4, dtype=torch.float64) @ torch.randn(4, m, dtype=torch.float64) * 0.1
    x = torch.randn(5, 320, dtype=torch.float64)
    student, _ = swap.train_site(ff, "f", "ff", "diffusers", t)
    wp, bp, wo, bo = fold.fold_ff(ff.net[0].proj.weight, ff.net[0].proj.bias, ff.net[2].weight, ff.net[2].bias,
                                  t["down_value"], t["down_gate"], t["up"], t["up_bias"])
    v, gate = torch.nn.functional.linear(x, wp, bp).chunk(2, dim=-1)
    folded = torch.nn.functional.linear(v * torch.nn.functional.gelu(gate), wo, bo)
    with torch.no_grad():
        assert fidelity.rel_error(folded, student(x)) < 1e-12


def test_adapter_file_with_intercept_is_version_2_and_round_trips(tmp_path):
    shapes_unet = build_diffusers_unet(tiny_config(), device="meta")
    canon = {k: torch.randn(v.shape) for k, v in layout.to_canonical(shapes_unet.state_dict())[0].items()}
    aset = adapters.AdapterSet.init_select(canon, rank_policy.ranks_for_ratio(layout.sites(canon), 0.5), "sd15")
    plain = aset.save(tmp_path / "plain.safetensors")
    site = next(s for s in aset.sites if aset.kind(s) == "ff")
    aset.sites[site]["up_bias"] = torch.randn(aset.sites[site]["up"].shape[0])
    path = aset.save(tmp_path / "bias.safetensors")
    from sdslim_core.io.tensors import read_header
    assert read_header(plain)[1]["sdslim.version"] == "1" and read_header(path)[1]["sdslim.version"] == "2"
    back = adapters.AdapterSet.load(path)
    assert torch.equal(back.sites[site]["up_bias"], aset.sites[site]["up_bias"])
    aset.sites[site]["up_bias"] = torch.zeros(3)
    with pytest.raises(adapters.AdapterError, match="up_bias: shape"):
        aset.validate()


# ------------------------------------------------------------------------------- on the shipped teacher

@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Training-free runs on the shipped tiny teacher at ratio 0.5: uniform ranks and allocated ranks."""
    pipe = tiny.load_tiny_pipeline()
    prompts = ["a red circle on a blue background", "a green square on a yellow background",
               "a blue triangle on a white background", "a white cross on a black background"]
    out = {"pipe": pipe}
    for name, uniform, by in (("uniform", True, "params"), ("allocated", False, "params"), ("flops", False, "flops")):
        work = tmp_path_factory.mktemp(name)
        tc = TrainConfig(ratio=0.5, uniform=uniform, budget_by=by, guidance=4.0, latent_size=pipe.latent_size, n_trajectories=6,
                         sample_steps=8, ff_tokens=4096, res_maps=32, rank_grid=(0.25, 0.5, 0.75), stage1_steps=0,
                         stage2_steps=0, alloc_inputs=16, work_dir=str(work / "w"))
        out[name] = train_adapters(pipe.unet, pipe.checkpoint.config, Calibration.from_prompts(prompts,
                                                                                               pipe.encode_prompt),
                                   tc, work / "a.safetensors")
    return out


def test_new_init_has_lower_held_out_error_than_v01_act_select(tiny_runs):
    """Per site, on held-out inputs: OBS (whole groups, intercept) against v0.1's act_select selection (both with
    this version's bottleneck norm); mean error lower for both kinds, and the chosen method never worse at a site."""
    table = tiny_runs["uniform"].report.init_table
    by_kind = {"ff": [], "res": []}
    for row in table:
        e = row["errors"]
        assert e[row["chosen"]] <= e["act_select"] + 1e-9
        by_kind[row["kind"]].append((e["obs"], e["act_select"]))
    for kind, pairs in by_kind.items():
        obs, old = (sum(p[i] for p in pairs) / len(pairs) for i in (0, 1))
        assert obs < old, (kind, obs, old)


def test_flops_allocation_keeps_uniforms_flops_and_beats_its_error(tiny_runs):
    pipe = tiny_runs["pipe"]
    weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
    x, t, ctx = torch.randn(1, 4, 8, 8), torch.tensor([500.0]), pipe.encode_prompt(["a red circle on a blue background"])

    def flops(aset):
        slim = swap.slim_module(pipe.unet, aset, weights)
        return fidelity.forward_flops(slim, x, t, encoder_hidden_states=ctx)
    u, f = tiny_runs["uniform"], tiny_runs["flops"]
    assert f.report.budget["unit"] == "flops" and f.report.budget["slim_flops"] <= f.report.budget["budget_flops"]
    assert flops(f.adapters) <= flops(u.adapters) * 1.001
    assert f.report.unet_error["init"] < u.report.unet_error["init"]


def test_allocated_ranks_beat_uniform_at_equal_parameters(tiny_runs):
    u, a = tiny_runs["uniform"].report, tiny_runs["allocated"].report
    assert a.params["slim"] <= u.params["slim"]
    assert a.unet_error["init"] < 0.5 * u.unet_error["init"], (a.unet_error, u.unet_error)
    assert a.budget["allocation"] == TrainConfig().allocation == "anchored" and a.budget["slim_params"] == a.params["slim"]


# ---------------------------------------------------------------------------------------- augmentations

def _bank(cfg, n=6):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 5, cfg.context_dim, generator=g)
    return InputBank(x=torch.cat([x, x]), t=torch.full((2 * n,), 400.0), ctx=torch.tensor([1] * n + [0] * n),
                     contexts=ctx, eps=torch.zeros(2 * n, 4, 8, 8), group=torch.cat([torch.arange(n)] * 2),
                     is_eval=torch.zeros(2 * n, dtype=torch.bool))


def test_cfg_pairs_match_the_two_halves_of_one_call():
    cfg = tiny_config()
    bank = _bank(cfg)
    pairs = bank.cfg_pairs(bank.fit_ids())
    assert pairs.shape == (6, 2)
    for u, c in pairs.tolist():
        assert bank.ctx[u] == 1 and bank.ctx[c] == 0 and torch.equal(bank.x[u], bank.x[c])


def test_augmenter_residuals_fit_the_unet_and_weight_deltas_are_undone_exactly():
    cfg = tiny_config()
    torch.manual_seed(0)
    unet = randomize_(build_diffusers_unet(cfg)).eval().requires_grad_(False)
    bank = _bank(cfg)
    sites = [s.name for s in layout.sites(layout.to_canonical(unet.state_dict())[0])]
    aug = Augmenter(unet, bank, sites, cfg, seed=0, control_prob=1.0, lora_prob=1.0, lora_scale=0.25,
                    device="cpu", dtype=torch.float32, amp=NULL)
    inputs = bank.batch(torch.arange(4))
    with torch.no_grad():
        plain = unet_call(unet, inputs)
        res = aug.residuals(3, 4, "cpu", torch.float32)
        moved = unet_call(unet, {**inputs, **res})
        assert 0.01 < fidelity.rel_error(moved, plain) < 2
        before = {n: p.clone() for n, p in unet.named_parameters()}
        with aug.weight_deltas(3):
            changed = [n for n, p in unet.named_parameters() if not torch.equal(p, before[n])]
            for n in changed:
                rel = ((dict(unet.named_parameters())[n] - before[n]).norm() / before[n].norm()).item()
                assert rel <= 0.25 + 1e-6
            perturbed = unet_call(unet, inputs)
        assert changed and all(torch.equal(p, before[n]) for n, p in unet.named_parameters())
        assert not torch.equal(perturbed, plain) and torch.equal(unet_call(unet, inputs), plain)
    assert aug.draw(5) == aug.draw(5)


# ---------------------------------------------------------------------------------------- quantisation

def _q8_0_reference(x):
    out = []
    for block in x.double().flatten().split(32):
        d = block.abs().max() / 127
        q = torch.round(block / d) if d > 0 else torch.zeros_like(block)
        out.append(q * d.to(torch.float16).double())
    return torch.cat(out).view_as(x)


def _q4_0_reference(x):
    out = []
    for block in x.double().flatten().split(32):
        mx = block[block.abs().argmax()]
        d = mx / -8
        q = torch.clamp(torch.floor(block / d + 8.5), 0, 15) if d != 0 else torch.full_like(block, 8)
        out.append((q - 8) * d.to(torch.float16).double())
    return torch.cat(out).view_as(x)


def test_gguf_round_trips_match_llama_cpp_formulas_and_byte_counts():
    """ops.quant's GGUF rows are the gguf package's quantiser, checked here against llama.cpp's formulas."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, 3, 3, generator=g)
    q8, q4 = quant.round_trip({"w": w}, "q8_0")["w"], quant.round_trip({"w": w}, "q4_0")["w"]
    assert torch.allclose(q8.double(), _q8_0_reference(w), rtol=0, atol=1e-6)
    assert torch.allclose(q4.double(), _q4_0_reference(w), rtol=0, atol=1e-6)
    assert quant.tensor_bytes(w, "q8_0") == w.numel() // 32 * 34
    assert quant.tensor_bytes(w, "q4_0") == w.numel() // 32 * 18
    small, bias = torch.randn(8, 16), torch.randn(320)
    for method in quant.GGUF_METHODS:
        assert torch.equal(quant.round_trip({"s": small}, method)["s"], small) and \
            quant.tensor_bytes(small, method) == 4 * 128
        assert torch.equal(quant.round_trip({"b": bias}, method)["b"], bias)
    assert torch.equal(quant.fp8(w), w.to(torch.float8_e4m3fn).float())
    assert torch.equal(quant.fp8(bias), bias) and quant.tensor_bytes(w, "fp8") == w.numel()
    errors = [fidelity.rel_error(quant.round_trip({"w": w}, m)["w"], w) for m in ("q8_0", "fp8", "q5_1", "q5_0",
                                                                                  "q4_1", "q4_0")]
    assert errors == sorted(errors) and errors[-1] < 0.15
    with pytest.raises(ValueError, match="unknown quantisation"):
        quant.round_trip({"w": w}, "q3_k")


# ------------------------------------------------------------------------------------------ the engine

def test_fidelity_engine_scores_identity_perfectly_and_sees_a_lora():
    pipe = tiny.load_tiny_pipeline()
    weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
    from sdslim_core.ops import lora
    merged, _ = lora.merge_loras(weights, [(tiny.LORA_PATH, 1.0)], pipe.checkpoint.config)
    cands = fidelity.Candidates(pipe.checkpoint.config, weights, merged)
    teacher_lora = cands.unet({**weights, **merged})
    caps = ["a red circle on a blue background", "a blue square on a yellow background"]
    probe = fidelity.Probe(fn_of=lambda m: (lambda x, t, c, **r: m(x, t, encoder_hidden_states=c, **r).sample),
                           context=pipe.encode_prompt(caps), uncond=pipe.encode_prompt(["", ""]),
                           noise=pipe.noise(2, 3), schedule=pipe.schedule, steps=6, decode=pipe.decode, eps_points=3)
    ref = fidelity.reference(probe, pipe.unet, teacher_lora)
    same = fidelity.compare(probe, ref, cands.unet(weights), teacher_lora)
    assert same["latent_psnr_db"] == math.inf and same["eps_rel_error"] == 0      # the same UNet: bit for bit
    assert same["lora_effect_cosine"] == pytest.approx(1, abs=1e-12)    # a·a / (|a| |a|) rounds either way of 1
    backwards = fidelity.compare(probe, ref, teacher_lora, pipe.unet)      # the LoRA "removed": effect reversed
    assert backwards["lora_effect_cosine"] == pytest.approx(-1, abs=1e-6)
    q4, q4_lora, w4 = cands.quantised("q4_0")
    r = fidelity.compare(probe, ref, q4, q4_lora)
    assert 0 < r["eps_rel_error"] < 0.5 and 10 < r["image_psnr_db"] < 60 and r["lora_effect_cosine"] > 0.8
    assert quant.storage_bytes(w4, "q4_0") < 0.35 * quant.storage_bytes(weights)     # fp32 norms and biases stay
    assert fidelity.forward_flops(pipe.unet, probe.noise[:1], torch.tensor([10.0]), probe.context[:1]) > 0


@pytest.mark.parametrize("method", ["fp8", "q4_0"])
def test_slim_stacked_with_a_format_applies_the_lora_as_that_format_does(method):
    """fp8: the merged, folded weights stored in fp8; GGUF: the slim-space LoRA delta (full precision) on the
    dequantised slim weights — the semantics the format alone gets, so the stacks compare fairly."""
    from sdslim_core.ops import lora
    pipe = tiny.load_tiny_pipeline()
    weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
    merged, _ = lora.merge_loras(weights, [(tiny.LORA_PATH, 1.0)], pipe.checkpoint.config)
    aset = adapters.AdapterSet.load(tiny.ASSETS / "tiny_sd15_slim_half.safetensors")
    model, model_lora, stored = fidelity.Candidates(pipe.checkpoint.config, weights, merged).slim(aset, method)
    base = {**weights, **fold.fold_state_dict(weights, aset)}
    with_lora = {**weights, **merged}
    with_lora.update(fold.fold_state_dict(with_lora, aset))
    if method == "fp8":
        want = quant.round_trip(with_lora, "fp8")
    else:
        want = {k: quant.round_trip({k: v}, "q4_0")[k] + (with_lora[k] - v) for k, v in base.items()}
    got = layout.to_canonical(model_lora.state_dict())[0]
    changed = [k for k in base if not torch.equal(with_lora[k], base[k])]
    assert changed
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)
    assert all(torch.equal(stored[k], quant.round_trip({k: v}, method)[k]) for k, v in base.items())
    plain = layout.to_canonical(model.state_dict())[0]
    lora_sites = [site for site in aset.sites if any(k.startswith(f"{site}.") for k in merged)]
    untouched = [k for k in base if k not in merged and not any(k.startswith(f"{site}.") for site in lora_sites)]
    assert len(untouched) > len(base) / 2
    assert all(got[k].data_ptr() == plain[k].data_ptr() for k in untouched)     # shared with the plain model
