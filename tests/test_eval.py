"""`sdslim eval` metrics: exact for identity adapters, clearly bad for a broken adapter; strict JSON."""
import json
import math

import pytest
import torch

from sdslim_core import layout
from sdslim_core.apps import evaluate, fidelity
from sdslim_core.io import adapters
from sdslim_core.io.tensors import save_file_atomic
from sdslim_core.layout import rank_policy
from sdslim_core.tiny import DEFAULT_PATH

pytestmark = pytest.mark.skipif(not DEFAULT_PATH.exists(), reason="tiny asset not generated")



@pytest.fixture(scope="module")
def weights():
    from sdslim_core.modules.unet import open_checkpoint
    ck = open_checkpoint(DEFAULT_PATH)
    return {k: v.float() for k, v in ck.weights.items()}


def identity(weights):
    return adapters.AdapterSet.init_select(weights, rank_policy.ranks_for_ratio(layout.sites(weights), 1.0), "sd15")


def kohya_lora(weights, path):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for module in ("input_blocks.1.1.transformer_blocks.0.attn2.to_v", "middle_block.1.transformer_blocks.0.ff.net.2",
                   "output_blocks.4.0.in_layers.2"):
        W = weights[module + ".weight"]
        n = "lora_unet_" + module.replace(".", "_")
        sd[f"{n}.lora_down.weight"] = torch.randn(4, *W.shape[1:], generator=g) * 0.2
        sd[f"{n}.lora_up.weight"] = torch.randn(W.shape[0], 4, *([1] * (W.ndim - 2)), generator=g) * 0.2
        sd[f"{n}.alpha"] = torch.tensor(4.0)
    save_file_atomic(sd, path)
    return str(path)


def test_identity_adapters_give_zero_error_and_infinite_psnr(weights, tmp_path):
    lora = kohya_lora(weights, tmp_path / "lora.safetensors")
    r = evaluate.evaluate(DEFAULT_PATH, identity(weights), [(lora, 1.0)], seeds=2, steps=6,
                          png=tmp_path / "side.png")
    assert r["eps_rel_error"]["max"] == 0.0
    assert r["latent_psnr_db"]["min"] == math.inf
    assert r["image"]["psnr_db"] == math.inf and r["image"]["ssim"] == pytest.approx(1.0, abs=1e-12)
    assert r["lora_effect_cosine"]["min"] == pytest.approx(1.0, abs=1e-9)
    assert len(r["eps_rel_error"]["by_timestep"]) == 5
    assert "tiny" in r["conditioning"] and (tmp_path / "side.png").stat().st_size > 0
    from PIL import Image
    assert Image.open(tmp_path / "side.png").size[1] == 2 * 32 * 4        # two seeds, enlarged 4×


def test_broken_adapter_is_detected(weights, tmp_path):
    aset = identity(weights)
    site = "input_blocks.2.0"
    aset.sites[site]["up"] = aset.sites[site]["up"].flip(0)                 # channels scrambled
    r = evaluate.evaluate(DEFAULT_PATH, aset, seeds=1, steps=6, png=None)
    assert r["eps_rel_error"]["mean"] > 0.05
    assert r["latent_psnr_db"]["min"] < 40 and r["image"]["psnr_db"] < 40
    assert r["image"]["ssim"] < 0.999
    assert "png" not in r["image"] and "lora_effect_cosine" not in r


def test_metric_functions_against_hand_values():
    a = torch.zeros(1, 3, 16, 16)
    b = a + 0.1
    assert fidelity.psnr(b, a, peak=1.0) == pytest.approx(20.0)
    assert fidelity.psnr(a, a) == math.inf
    assert fidelity.ssim(a + 0.5, a + 0.5) == pytest.approx(1.0)
    assert fidelity.cosine(torch.tensor([1.0, 0]), torch.tensor([0, 2.0])) == 0
    assert fidelity.rel_error(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 4.0])) == pytest.approx(0.75)
    assert json.loads(json.dumps(fidelity.jsonable({"x": math.inf, "y": [1.5, -math.inf]}))) == \
        {"x": "inf", "y": [1.5, "-inf"]}


def test_cli_json_is_one_strict_object(weights, tmp_path, capsys):
    from sdslim_core import cli
    identity(weights).save(tmp_path / "id.safetensors")
    rc = cli.main(["eval", "--ckpt", str(DEFAULT_PATH), "--adapters", str(tmp_path / "id.safetensors"),
                   "--seeds", "1", "--steps", "3", "--no-png", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("\n") == 1

    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")
    r = json.loads(out, parse_constant=refuse)
    assert r["latent_psnr_db"]["mean"] == "inf" and r["eps_rel_error"]["mean"] == 0


def test_ladder_puts_the_alternatives_beside_the_slim_model(weights, tmp_path, monkeypatch):
    """The eval's ladder: identity slim is exact and full size; the alternatives are measured on the same seeds,
    each at its own storage size (Q4_0 < slim+fp8 ≤ fp8 < fp16 here) and Q8_0 closer to the teacher than Q4_0.
    One candidate (with its LoRA twin) is alive at a time, freed as soon as it is dropped (no garbage collection
    waited for): full-size SDXL holds 10 GB per fp32 UNet."""
    import weakref
    built, most_alive = [], []

    def tracked(*args, **kwargs):
        most_alive.append(sum(ref() is not None for ref in built))
        model = load(*args, **kwargs)
        built.append(weakref.ref(model))
        return model
    load = fidelity.load_diffusers_unet
    monkeypatch.setattr(fidelity, "load_diffusers_unet", tracked)
    lora = kohya_lora(weights, tmp_path / "lora.safetensors")
    r = evaluate.evaluate(DEFAULT_PATH, identity(weights), [(lora, 1.0)], seeds=2, steps=3, png=None,
                          compare=evaluate.COMPARE)
    assert len(built) == 2 * (1 + len(evaluate.COMPARE)) + 1 and max(most_alive) == 1     # + the teacher's LoRA twin
    rows = {row["row"]: row for row in r["ladder"]}
    assert list(rows) == ["slim", *evaluate.COMPARE]
    slim = rows["slim"]
    assert slim["params_ratio"] == 1 and slim["flops_ratio"] == 1 and slim["latent_psnr_db"] == math.inf
    assert slim["lora_effect_cosine"] == pytest.approx(1, abs=1e-9)
    assert slim["controlnet_effect_cosine"] == pytest.approx(1, abs=1e-9)
    b = {k: v["weight_bytes"] for k, v in rows.items()}
    assert b["q4_0"] < b["slim+fp8"] <= b["fp8"] < b["slim"] == 2 * sum(v.numel() for v in weights.values())
    assert rows["q8_0"]["eps_rel_error"] < rows["q4_0"]["eps_rel_error"] and rows["q4_0"]["eps_rel_error"] > 0
    assert all(-1 - 1e-9 <= rows[k]["controlnet_effect_cosine"] <= 1 + 1e-9 for k in rows)
    text = evaluate.format_result(r)
    assert "| q4_0 |" in text and "ControlNet cos (synthetic)" in text
    with pytest.raises(ValueError, match="--compare"):
        evaluate.evaluate(DEFAULT_PATH, identity(weights), seeds=1, steps=2, compare=["q2_k"])
