"""ComfyUI's weight-patch forms read as core LoRA modules, without ComfyUI (sdslim_core.hosts.comfyui): the ΔW the
core computes from them equals ComfyUI's own formula for each form, written out here in float64."""
import pytest
import torch

from sdslim_core.hosts import comfyui
from sdslim_core.ops.lora import delta_weight, module_scale

KEY = "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"


class _Adapter:
    """A ComfyUI weight adapter as the pack sees it: its class name and its ``weights`` tuple."""

    def __init__(self, weights):
        self.weights = weights


LoRAAdapter = type("LoRAAdapter", (_Adapter,), {})
LoHaAdapter = type("LoHaAdapter", (_Adapter,), {})
LoKrAdapter = type("LoKrAdapter", (_Adapter,), {})
OFTAdapter = type("OFTAdapter", (_Adapter,), {})


def _r(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _delta(value, shape, key=KEY):
    mod = comfyui.core_module(key, value, "test.safetensors")
    assert mod is not None and mod.target == key.rsplit(".", 1)[0]
    return delta_weight(mod, shape, torch.float64), mod


def test_lora_linear_is_alpha_over_rank_up_down():
    up, down = _r(8, 2, seed=1), _r(2, 6, seed=2)
    got, mod = _delta(LoRAAdapter((up, down, 1.5, None, None, None)), (8, 6))
    torch.testing.assert_close(got, (1.5 / 2) * up @ down, rtol=1e-12, atol=0)
    assert mod.kind == "lora" and mod.keys == [comfyui.PREFIX + KEY]
    assert comfyui.made_for_numel(LoRAAdapter((up, down, 1.5, None, None, None))) == 48


def test_locon_conv_and_no_alpha():
    up, down = _r(8, 3, 1, 1, seed=3), _r(3, 5, 3, 3, seed=4)
    got, mod = _delta(LoRAAdapter((up, down, None, None, None, None)), (8, 5, 3, 3))
    ref = (up.flatten(1) @ down.flatten(1)).reshape(8, 5, 3, 3)         # no alpha: scale 1, as ComfyUI
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    assert "alpha" not in mod.tensors and module_scale(mod) == 1.0
    assert comfyui.made_for_numel(LoRAAdapter((up, down, None, None, None, None))) == 8 * 5 * 9


def test_loha_is_the_hadamard_product_of_two_low_rank_factors():
    w1a, w1b, w2a, w2b = _r(8, 4, seed=5), _r(4, 6, seed=6), _r(8, 4, seed=7), _r(4, 6, seed=8)
    value = LoHaAdapter((w1a, w1b, 2.0, w2a, w2b, None, None, None))
    got, mod = _delta(value, (8, 6))
    torch.testing.assert_close(got, (2.0 / 4) * (w1a @ w1b) * (w2a @ w2b), rtol=1e-12, atol=0)
    assert mod.kind == "loha" and comfyui.made_for_numel(value) == 48


def test_tucker_loha_and_tucker_locon_conv():
    """Tucker cores as ComfyUI rebuilds them: LoHa w1a [rank, out], w1b [rank, in], t [rank, rank, k, k] →
    Σ_ij t[i, j]·w1a[i, out]·w1b[j, in]; a LoRA ``mid`` [r, r, k, k] between up and down."""
    t1, w1a, w1b, t2, w2a, w2b = (_r(*s, seed=20 + i) for i, s in enumerate(
        ((3, 3, 3, 3), (3, 8), (3, 5), (3, 3, 3, 3), (3, 8), (3, 5))))
    value = LoHaAdapter((w1a, w1b, 6.0, w2a, w2b, t1, t2, None))
    got, mod = _delta(value, (8, 5, 3, 3))
    rebuild = lambda t, a, b: torch.einsum("ijkl,ip,jr->prkl", t, a, b)  # noqa: E731
    torch.testing.assert_close(got, 2.0 * rebuild(t1, w1a, w1b) * rebuild(t2, w2a, w2b), rtol=1e-12, atol=1e-12)
    assert comfyui.made_for_numel(value) == 8 * 5 * 9
    up, mid, down = _r(8, 2, 1, 1, seed=30), _r(2, 2, 3, 3, seed=31), _r(2, 5, 1, 1, seed=32)
    value = LoRAAdapter((up, down, 1.0, mid, None, None))
    got, _ = _delta(value, (8, 5, 3, 3))
    ref = 0.5 * torch.einsum("oa,abkl,bi->oikl", up.flatten(1), mid, down.flatten(1))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert comfyui.made_for_numel(value) == 8 * 5 * 9


def test_lokr_is_a_kronecker_product_scaled_by_the_factorised_rank():
    w1, w2a, w2b = _r(2, 3, seed=9), _r(4, 2, seed=10), _r(2, 2, seed=11)
    value = LoKrAdapter((w1, None, 3.0, None, None, w2a, w2b, None, None))
    got, mod = _delta(value, (8, 6))
    torch.testing.assert_close(got, (3.0 / 2) * torch.kron(w1, w2a @ w2b), rtol=1e-12, atol=0)
    assert mod.kind == "lokr" and comfyui.made_for_numel(value) == 48


def test_full_diffs_on_weight_and_bias():
    d, b = _r(8, 6, seed=12), _r(8, seed=13)
    got, _ = _delta(("diff", (d,)), (8, 6))
    torch.testing.assert_close(got, d, rtol=0, atol=0)
    mod = comfyui.core_module(KEY[:-len("weight")] + "bias", ("diff", (b,)), "test")
    assert mod.kind == "diff" and torch.equal(mod.tensors["diff_b"], b)
    assert comfyui.made_for_numel(("diff", (d,))) == 48


def test_dora_scale_travels_with_the_module():
    up, down, dora = _r(8, 2, seed=14), _r(2, 6, seed=15), _r(8, 1, seed=16)
    mod = comfyui.core_module(KEY, LoRAAdapter((up, down, 2.0, None, dora, None)), "dora")
    assert torch.equal(mod.tensors["dora_scale"], dora)


@pytest.mark.parametrize("value", [LoRAAdapter((_r(8, 2, seed=1), _r(2, 6, seed=2), 1.0, None, None, (8, 6))),
                                   OFTAdapter((_r(4, 4, seed=3),)), ("set", (_r(8, 6, seed=4),)), 0.5],
                         ids=["reshaped lora", "oft", "set", "not a patch"])
def test_forms_the_core_does_not_read_are_none(value):
    assert comfyui.core_module(KEY, value, "x") is None


def test_made_for_numel_knows_reshape_and_merges_and_says_none_otherwise():
    assert comfyui.made_for_numel(LoRAAdapter((_r(8, 2, seed=1), _r(2, 6, seed=2), 1.0, None, None, (4, 12)))) == 48
    nested = [(_r(8, 6, seed=3), 1.0)]                        # a model merge's nested patch list
    assert comfyui.made_for_numel(nested) == 48
    assert comfyui.made_for_numel(OFTAdapter((_r(4, 4, seed=3),))) is None
    assert "OFTAdapter" in comfyui.NEEDS_BASE
