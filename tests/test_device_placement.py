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
from emulated_device import accelerators, on
from sdslim_core import cli, layout, tiny
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.modules import swap
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.ops import fold
from sdslim_core.train import Calibration, TrainConfig, train_adapters

TINY = tiny.DEFAULT_PATH
# how close a device's result is to the CPU's: the emulated device runs the CPU's kernels (attention excepted, which
# takes the math path there); a GPU has its own kernels (and TF32 convolutions)
CLOSE = {"emulated": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=2e-2, atol=2e-3)}


@pytest.fixture(params=accelerators())
def acc(request):
    return request.param


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


def test_the_fold_brings_cpu_adapters_to_the_weights_they_fold(acc):
    """Guards ops/fold.py (out_bias_shift, the three maps): stage 2's measure, sdslim slim --device, Slim UNet."""
    unet = _teacher()
    aset = _adapters(unet)
    weights = layout.to_canonical(unet.state_dict())[0]
    expected = fold.fold_state_dict(weights, aset)
    with on(acc) as dev:
        on_dev = {k: v.to(dev) for k, v in weights.items()}
        got = fold.fold_state_dict(on_dev, aset)
        assert {t.device for t in got.values()} == {dev}
        got = {k: v.cpu() for k, v in got.items()}
    assert {t.device.type for s in aset.sites.values() for t in s.values()} == {"cpu"}   # the set is not moved
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_train_time_adapters_live_on_the_device_of_the_layers_they_wrap(acc):
    """Guards modules/swap.py (ResDown.forward): the plan's warm-up, stage 2's build, the sensitivity curves."""
    unet = _teacher()
    aset = _adapters(unet)
    x = torch.randn(2, 4, 8, 8)
    t, ctx = torch.tensor([10.0, 500.0]), torch.randn(2, 5, 32)
    ref_tree, ref_adapters = swap.attach_train_adapters(unet, aset)
    ref = ref_tree(x, t, encoder_hidden_states=ctx).sample
    ref.pow(2).mean().backward()
    with on(acc) as dev:
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
    torch.testing.assert_close(got, ref, **CLOSE[acc])
    for s, g in grads.items():
        torch.testing.assert_close(g, ref_adapters[s].up.grad, rtol=10 * CLOSE[acc]["rtol"], atol=CLOSE[acc]["atol"])


@pytest.fixture(scope="module", params=accelerators())
def trained_on_device(request, tmp_path_factory):
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
    with on(request.param) as dev:
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


def test_an_offloaded_teacher_trains_the_same_adapters_with_its_weights_never_on_the_device(trained_on_device, request,
                                                                                           monkeypatch, tmp_path):
    """``offload_teacher`` (an 8 GB card's SDXL run): the same run with the teacher's weights kept on the CPU and each
    layer copied to the device for its call reaches every phase, holds no teacher weight on the device at any
    progress report, and ends with the adapters of the run with the teacher on the device (bit for bit on the
    emulated device, which runs the CPU's kernels either way)."""
    from sdslim_core.train import teacher as teacher_mod
    placements = []
    real_init = teacher_mod.TeacherPlacement.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        placements.append(self)
    monkeypatch.setattr(teacher_mod.TeacherPlacement, "__init__", init)
    reference, _, _ = trained_on_device
    acc = request.node.callspec.params["trained_on_device"]
    seen, where = [], set()

    def report(done, total, info):
        seen.append(info.get("stage"))
        where.add(placements[-1].where)
        assert {t.device.type for t in placements[-1].unet.parameters()} == {"cpu"}, info
    calib = Calibration.from_contexts(torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)))
    tc = TrainConfig(ratio=0.5, n_trajectories=4, sample_steps=2, guidance=3.0, latent_size=8, ff_inputs=8,
                     res_maps=8, stage1_steps=2, stage2_steps=4, stage2_groups=2, checkpoint_every=1, seed=0,
                     offload_teacher=True)
    with on(acc) as dev:
        result = train_adapters(_teacher(), micro_config(), calib, tc, tmp_path / "a.safetensors", progress=report,
                                device=str(dev))
    assert {"calibration", "capture", "init", 1, 2} <= set(seen) and where == {"cpu", "offloaded"}
    for site, tensors in reference.adapters.sites.items():
        for k, v in tensors.items():
            if acc == "emulated":
                assert torch.equal(result.adapters.sites[site][k], v), (site, k)
            else:
                torch.testing.assert_close(result.adapters.sites[site][k], v, **CLOSE[acc])


# ------------------------------------------------------------------------------------ the commands with --device

HALF = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"          # the shipped demo adapter file (float32)


def _cli(*args) -> str:
    """Run ``sdslim ARGS`` in this process; its stdout (``--json``)."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    assert code == 0, err.getvalue()[-3000:]
    return out.getvalue()


def test_slim_lora_convert_and_distance_on_a_device_write_what_the_cpu_writes(acc, tmp_path):
    """Guards sdslim slim (merge + fold on the device), lora convert and adapters distance with --device."""
    from sdslim_core.io.tensors import load_file
    outputs = {}
    for name in ("cpu", "device"):
        d = tmp_path / name
        d.mkdir()
        with on(acc) as dev:
            device = dev if name == "device" else "cpu"
            _cli("slim", "--ckpt", TINY, "--adapters", HALF, "--lora", f"{tiny.LORA_PATH}:0.8", "--out",
                 d / "slim.safetensors", "--device", device)
            _cli("lora", "convert", "--slim", d / "slim.safetensors", "--lora", tiny.LORA_PATH, "--adapters", HALF,
                 "--out", d / "lora.safetensors", "--device", device)
            distance = json.loads(_cli("adapters", "distance", "--ckpt", TINY, "--adapters", HALF, "--device",
                                       device, "--json"))
        outputs[name] = {f: load_file(d / f)[0] for f in ("slim.safetensors", "lora.safetensors")}, distance
    (files_cpu, d_cpu), (files_dev, d_dev) = outputs["cpu"], outputs["device"]
    for f, tensors in files_cpu.items():
        assert tensors.keys() == files_dev[f].keys()
        for k, v in tensors.items():
            torch.testing.assert_close(files_dev[f][k].float(), v.float(), rtol=1e-3, atol=1e-4, msg=f"{f}: {k}")
    assert d_dev["overall"] == pytest.approx(d_cpu["overall"], abs=1e-6)


def test_eval_on_a_device_measures_what_the_cpu_measures(acc, tmp_path):
    """Guards sdslim eval --device (teacher, slim model, LoRA and the storage alternatives on the device)."""
    rows = {}
    for name in ("cpu", "device"):
        with on(acc) as dev:
            rows[name] = json.loads(_cli("eval", "--ckpt", TINY, "--adapters", HALF, "--lora", tiny.LORA_PATH,
                                         "--seeds", "1", "--steps", "2", "--compare", "fp8,q8_0", "--no-png",
                                         "--device", dev if name == "device" else "cpu", "--json"))
    cpu, got = rows["cpu"], rows["device"]
    assert got.keys() == cpu.keys()
    assert got["latent_psnr_db"]["mean"] == pytest.approx(cpu["latent_psnr_db"]["mean"],
                                                          abs=0.05 if acc == "emulated" else 1.0)


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory):
    """The micro teacher as an LDM single-file checkpoint (UNet only: calibration is unconditional)."""
    from sdslim_core.io.tensors import save_file_atomic
    path = tmp_path_factory.mktemp("micro") / "micro.safetensors"
    canon = layout.to_canonical(_teacher().state_dict())[0]
    return save_file_atomic({layout.CHECKPOINT_PREFIX + k: v for k, v in canon.items()}, path)


def test_the_recipes_plan_and_refit_run_on_a_device(acc, micro_ckpt, tmp_path):
    """Guards the plan's warm-up (train/plan.py _stage2_step: the GPU run's --plan-only crash), data-free, quick and
    the --from refit with --device; the warm-up and the refit also with the teacher offloaded."""
    small = ["--trajectories", "2", "--sample-steps", "2", "--latent-size", "8", "--no-vram-estimate", "--no-progress"]
    with on(acc) as dev:
        plan = json.loads(_cli("train", "--ckpt", micro_ckpt, "--out", tmp_path / "p.safetensors", *small,
                               "--plan-only", "--device", dev, "--json"))
        assert plan["recipes"]["full"]["eta_s"] > 0 and not (tmp_path / "p.safetensors").exists()
        offloaded = json.loads(_cli("train", "--ckpt", micro_ckpt, "--out", tmp_path / "p.safetensors", *small,
                                    "--plan-only", "--offload-teacher", "on", "--device", dev, "--json"))
        assert offloaded["recipes"]["full"]["eta_s"] > 0
        _cli("train", "--ckpt", micro_ckpt, "--out", tmp_path / "free.safetensors", "--recipe", "data-free",
             "--device", dev, "--no-progress")
        quick = json.loads(_cli("train", "--ckpt", micro_ckpt, "--out", tmp_path / "quick.safetensors", "--recipe",
                                "quick", *small, "--no-plan", "--device", dev, "--json"))
        refit = json.loads(_cli("train", "--ckpt", micro_ckpt, "--out", tmp_path / "refit.safetensors", "--from",
                                tmp_path / "quick.safetensors", *small, "--stage2-steps", "2", "--no-plan",
                                "--offload-teacher", "on", "--device", dev, "--json"))
    assert quick["budget"] and refit["steps"] == {"stage1_per_site": 0, "stage2": 2}
    for f in ("free", "quick", "refit"):
        aset = AdapterSet.load(tmp_path / f"{f}.safetensors")
        assert all(torch.isfinite(t).all() for s in aset.sites.values() for t in s.values())


@pytest.mark.parametrize("device, says", [
    ("cuda", "sees no CUDA GPU; use --device cpu"),
    ("mps", "MPS is not available"),
    ("cuda:nope", "not a torch device"),
])
def test_a_device_this_torch_cannot_use_is_refused_in_one_sentence_before_any_work(tmp_path, capsys, device, says):
    if device == "cuda" and torch.cuda.is_available() or device == "mps" and torch.backends.mps.is_available():
        pytest.skip(f"{device} is available here")
    for args in (["train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", "--recipe", "data-free"],
                 ["slim", "--ckpt", TINY, "--adapters", HALF, "--out", tmp_path / "s.safetensors"],
                 ["eval", "--ckpt", TINY, "--adapters", HALF, "--no-png"]):
        assert cli.main([str(a) for a in args] + ["--device", device]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "Traceback" not in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_mps_is_refused_for_the_float64_commands_and_taken_for_the_fold(monkeypatch):
    from sdslim_core import devices
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(devices.DeviceError, match="float64, which Apple's MPS does not support"):
        devices.resolve("mps", float64=True)
    assert devices.resolve("mps") == torch.device("mps")
