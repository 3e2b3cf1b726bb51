"""Every path runs on a GPU: adapter tensors are read on the CPU (the file format) and must follow the weights they
fold and the layers they wrap. Each test runs a path on the emulated device of ``emulated_device.py`` (a second
device with CUDA's placement rules and the CPU's values) and says which crash of the first GPU run it guards
(shared/data/gpu-h200-2026-12-04: training stopped at ``ops/fold.py`` ``out_bias_shift`` called from
``train/stage2.py`` ``measure``; ``--plan-only`` at ``modules/swap.py`` ``ResDown.forward``; ComfyUI's Slim UNet folded
weights on its load device with CPU adapters). On the code before the fix each of them fails with "Expected all
tensors to be on the same device"."""
import json

import pytest
import torch

from conftest import randomize_, tiny_config
from emulated_device import emulated_device
from sdslim_core import cli, layout, tiny
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.modules import swap
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.ops import fold
from sdslim_core.train import Calibration, TrainConfig, train_adapters

TINY = tiny.DEFAULT_PATH


def micro_config():
    """The SD1.5 block structure at its smallest: 2 levels, one ResBlock each, attention on the first."""
    return layout.UNetConfig(family="sd15", in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2),
                             num_res_blocks=1, transformer_depth=(1, 0), mid_transformer_depth=1, context_dim=32,
                             use_linear_proj=False, adm_in_channels=None, num_heads=2, time_embed_dim=64)


def _teacher():
    torch.manual_seed(0)
    return randomize_(build_diffusers_unet(micro_config()).eval(), seed=0, scale=0.1)


def _adapters(unet, ratio=0.5, seed=1) -> AdapterSet:
    canon = layout.to_canonical(unet.state_dict())[0]
    ranks = {s.name: max(1, s.width // 2) for s in layout.sites({k: tuple(v.shape) for k, v in canon.items()})}
    aset = AdapterSet.init_select(canon, ranks, "sd15")
    g = torch.Generator().manual_seed(seed)
    for tensors in aset.sites.values():            # not a selection: every entry matters
        for k, v in tensors.items():
            tensors[k] = v + 0.05 * torch.randn(v.shape, generator=g)
    return aset


def test_the_fold_brings_cpu_adapters_to_the_weights_they_fold():
    """Guards ops/fold.py (out_bias_shift, the three maps): stage 2's measure, sdslim slim --device, Slim UNet."""
    unet = _teacher()
    aset = _adapters(unet)
    weights = layout.to_canonical(unet.state_dict())[0]
    expected = fold.fold_state_dict(weights, aset)
    with emulated_device() as dev:
        on_dev = {k: v.to(dev) for k, v in weights.items()}
        got = fold.fold_state_dict(on_dev, aset)
        assert {t.device for t in got.values()} == {dev}
        got = {k: v.cpu() for k, v in got.items()}
    assert {t.device.type for s in aset.sites.values() for t in s.values()} == {"cpu"}   # the set is not moved
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_train_time_adapters_live_on_the_device_of_the_layers_they_wrap():
    """Guards modules/swap.py (ResDown.forward): the plan's warm-up, stage 2's build, the sensitivity curves."""
    unet = _teacher()
    aset = _adapters(unet)
    x = torch.randn(2, 4, 8, 8)
    t, ctx = torch.tensor([10.0, 500.0]), torch.randn(2, 5, 32)
    ref_tree, ref_adapters = swap.attach_train_adapters(unet, aset)
    ref = ref_tree(x, t, encoder_hidden_states=ctx).sample
    ref.pow(2).mean().backward()
    with emulated_device() as dev:
        tree, adapters = swap.attach_train_adapters(unet.to(dev), aset)
        assert {p.device for a in adapters.values() for p in a.parameters()} == {dev}
        out = tree(x.to(dev), t.to(dev), encoder_hidden_states=ctx.to(dev)).sample
        out.pow(2).mean().backward()
        got = out.cpu()
        grads = {s: a.up.grad.cpu() for s, a in adapters.items()}
        site = next(s for s in aset.sites if aset.kind(s) == "res")
        student, adapter = swap.train_site(unet.get_submodule(swap.site_path(unet, site)), site, "res", "diffusers",
                                           aset.sites[site], aset.groups(site))
        assert adapter.down.device == dev
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)      # attention takes the math path there
    for s, g in grads.items():
        torch.testing.assert_close(g, ref_adapters[s].up.grad, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def trained_on_device(tmp_path_factory):
    """A full run on the device: calibration, capture, rank allocation, init, stage 1, stage 2 in two groups (the
    later group folds the first one's sites on the device) and its measure; killed in stage 2, then resumed."""
    out = tmp_path_factory.mktemp("device-run") / "adapters.safetensors"
    calib = Calibration.from_contexts(torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)))
    tc = TrainConfig(ratio=0.5, n_trajectories=4, sample_steps=2, guidance=3.0, latent_size=8, ff_inputs=8,
                     res_maps=8, stage1_steps=2, stage2_steps=4, stage2_groups=2, checkpoint_every=1, seed=0)
    seen = []

    def kill_in_stage2(done, total, info):
        seen.append(info.get("stage"))
        if info.get("stage") == 2 and seen.count(2) == 3:
            raise KeyboardInterrupt
    with emulated_device() as dev:
        with pytest.raises(KeyboardInterrupt):
            train_adapters(_teacher(), micro_config(), calib, tc, out, progress=kill_in_stage2, device=str(dev))
        result = train_adapters(_teacher(), micro_config(), calib, tc, out, resume=True, device=str(dev),
                                progress=lambda d, n, info: seen.append(info.get("stage")))
    return result, out, seen


def test_a_training_run_reaches_every_phase_on_the_device(trained_on_device):
    result, out, seen = trained_on_device
    assert {"calibration", "capture", "init", 1, 2} <= set(seen)
    rep = result.report
    assert rep.budget and set(rep.unet_error) >= {"init", "stage1", "stage2"}
    assert all(torch.isfinite(t).all() and t.device.type == "cpu" for s in result.adapters.sites.values()
               for t in s.values())
    assert AdapterSet.load(out).ranks() == result.adapters.ranks()
