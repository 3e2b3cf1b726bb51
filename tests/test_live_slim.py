"""sdslim_core.modules.live_slim.LiveSlim on a real (tiny) LDM UNet, without any webui."""
import pytest
import torch

from a1111_standin.harness import one_thread, tiny_unet, write_adapters  # noqa: F401 (fixture)
from sdslim_core.io import adapters
from sdslim_core.modules.live_slim import LiveSlim, SwapError
from sdslim_core.ops import fold

FF = "input_blocks.1.1.transformer_blocks.0.ff"


@pytest.fixture
def unet_and_adapters(tmp_path, one_thread):
    unet = tiny_unet()
    return unet, adapters.AdapterSet.load(write_adapters(tmp_path, unet))


def _snapshot(unet):
    return {k: (v, v.detach().clone()) for k, v in unet.named_parameters()}


def _assert_same(unet, snap):
    now = dict(unet.named_parameters())
    assert now.keys() == snap.keys()
    assert all(now[k] is obj and torch.equal(now[k], val) for k, (obj, val) in snap.items())


def test_apply_replaces_exactly_the_fold_layers_and_restore_puts_the_same_objects_back(unet_and_adapters):
    unet, aset = unet_and_adapters
    snap, merged = _snapshot(unet), []
    folded = fold.fold_state_dict({k: v.detach() for k, v in unet.state_dict().items()}, aset)
    live = LiveSlim(unet)
    report = live.apply("k", aset, merge=merged.append)
    assert set(live.replaced) == set(live.layer_paths(aset))
    assert [id(m) for m in merged] == [id(live.original(p)) for p in live.layer_paths(aset)]
    assert report.sites == len(aset.sites) and report.layers == len(live.replaced)
    slim_bytes = sum(t.numel() * t.element_size() for p in live.replaced for t in unet.get_submodule(p).parameters())
    assert report.bytes_after == slim_bytes and report.bytes_saved > 0
    live.restore()
    _assert_same(unet, snap)
    live.apply("k", aset)
    for path in live.replaced:
        for name, t in unet.get_submodule(path).named_parameters():
            assert torch.equal(t, folded[f"{path}.{name}"]), f"{path}.{name}"


def test_unmerge_follows_each_read_and_the_fold_uses_the_merged_weights(unet_and_adapters):
    """A host that keeps layers unmerged: merge doubles the weights in place, unmerge halves them (exactly)."""
    unet, aset = unet_and_adapters
    snap, calls = _snapshot(unet), []
    merged = {k: v.detach() * 2 for k, v in unet.state_dict().items()}
    folded = fold.fold_state_dict(merged, aset)

    def merge(layer):
        calls.append(("merge", id(layer)))
        with torch.no_grad():
            for p in layer.parameters(recurse=False):
                p *= 2

    def unmerge(layer):
        calls.append(("unmerge", id(layer)))
        with torch.no_grad():
            for p in layer.parameters(recurse=False):
                p /= 2
    live = LiveSlim(unet)
    live.apply("k", aset, merge=merge, unmerge=unmerge)
    ids = [id(live.original(p)) for p in live.layer_paths(aset)]
    assert calls == [(what, i) for i in ids for what in ("merge", "unmerge")]
    for path in live.replaced:
        for name, t in unet.get_submodule(path).named_parameters():
            assert torch.allclose(t, folded[f"{path}.{name}"], atol=1e-12, rtol=0), f"{path}.{name}"
    live.restore()
    _assert_same(unet, snap)


def test_a_failure_while_installing_puts_back_what_was_already_swapped(unet_and_adapters, monkeypatch):
    unet, aset = unet_and_adapters
    snap = _snapshot(unet)
    live = LiveSlim(unet)
    real_install = LiveSlim._install

    def flaky(self, layers, offload):
        broken = dict(list(layers.items())[:5])
        broken["input_blocks.1.0.nope"] = torch.nn.Linear(1, 1)     # the 6th path does not exist
        real_install(self, broken, offload)
    monkeypatch.setattr(LiveSlim, "_install", flaky)
    with pytest.raises(SwapError, match="nope"):
        live.apply("k", aset)
    assert not live.installed and live.replaced == []
    _assert_same(unet, snap)


def test_cache_is_keyed_and_bounded(unet_and_adapters):
    unet, aset = unet_and_adapters
    live = LiveSlim(unet, max_cached=2)
    a = live.apply("a", aset)
    installed = {p: unet.get_submodule(p) for p in live.replaced}
    again = live.apply("a", aset)                                  # installed: nothing to do, nothing folded
    assert not a.cached and again.cached and again.seconds == 0.0 and again.bytes_saved == a.bytes_saved
    assert all(unet.get_submodule(p) is m for p, m in installed.items())
    live.apply("b", aset.select(0.5))
    assert live.apply("a", aset).cached                           # a came back from the cache
    live.apply("c", aset.select(0.25))                             # evicts b (least recently used)
    assert not live.apply("b", aset.select(0.5)).cached


def test_loading_a_state_dict_restores_first_and_forgets_the_folds(unet_and_adapters):
    unet, aset = unet_and_adapters
    other = tiny_unet(seed=9).state_dict()
    live = LiveSlim(unet)
    live.apply("k", aset)
    unet.load_state_dict(other, strict=False)                     # a checkpoint switch into the same objects
    assert not live.installed
    assert all(torch.equal(unet.state_dict()[k], v) for k, v in other.items())
    assert not live.apply("k", aset).cached


def test_conv_padding_mode_follows_the_original_at_install(unet_and_adapters):
    unet, aset = unet_and_adapters
    live = LiveSlim(unet)
    live.apply("k", aset)
    live.restore()
    for m in unet.modules():          # tiling switched on between generations (webui's apply_circular)
        if isinstance(m, torch.nn.Conv2d):
            m.padding_mode = "circular"
    live.apply("k", aset)
    convs = [unet.get_submodule(p) for p in live.replaced if isinstance(unet.get_submodule(p), torch.nn.Conv2d)]
    assert convs and all(c.padding_mode == "circular" for c in convs)


def test_refuses_trees_it_cannot_slim_in_place():
    with pytest.raises(Exception, match="neither an LDM UNetModel"):
        LiveSlim(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_the_load_hook_also_works_with_torch_before_2_5(unet_and_adapters, monkeypatch):
    monkeypatch.delattr(torch.nn.Module, "register_load_state_dict_pre_hook")
    unet, aset = unet_and_adapters
    live = LiveSlim(unet)
    live.apply("k", aset)
    unet.load_state_dict(tiny_unet(seed=9).state_dict(), strict=False)
    assert not live.installed


def test_without_the_load_hook_a_checkpoint_switch_would_fail(unet_and_adapters):
    """Control for the test above: the pre-hook is what makes loading into a slim tree safe."""
    unet, aset = unet_and_adapters
    live = LiveSlim(unet)
    live.apply("k", aset)
    live._hook.remove()
    with pytest.raises(RuntimeError, match="size mismatch"):
        unet.load_state_dict(tiny_unet(seed=9).state_dict(), strict=False)


def test_close_restores_and_detaches(unet_and_adapters):
    unet, aset = unet_and_adapters
    snap = _snapshot(unet)
    live = LiveSlim(unet)
    live.apply("k", aset)
    live.close()
    _assert_same(unet, snap)
    assert not unet._load_state_dict_pre_hooks


def _lora_module(unet, path, seed, dora=False):
    from sdslim_core.io.lora_files import LoraModule
    g = torch.Generator().manual_seed(seed)
    w = unet.get_submodule(path).weight
    t = {"up": torch.randn(w.shape[0], 3, *([1, 1] if w.ndim == 4 else []), generator=g, dtype=torch.float64),
         "down": torch.randn(3, *w.shape[1:], generator=g, dtype=torch.float64), "alpha": torch.tensor(1.5)}
    if dora:
        t["dora_scale"] = torch.ones(w.shape[0], 1, dtype=torch.float64)
    return LoraModule("test", path, path, "lora", t, [path])


def test_apply_loras_adds_the_converted_deltas_and_keeps_the_cache_pristine(unet_and_adapters):
    """fold(W) + s·ΔW' on the slim layers equals fold(W + s·ΔW) (float64, an independent merge); an empty list
    and a restore give back the very folded values; the originals are never touched."""
    unet, aset = unet_and_adapters
    snap = _snapshot(unet)
    weights = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    paths = [f"{FF}.net.0.proj", f"{FF}.net.2", "input_blocks.1.0.in_layers.2", "input_blocks.1.0.out_layers.3"]
    mods = [_lora_module(unet, p, i) for i, p in enumerate(paths)]
    live = LiveSlim(unet)
    live.apply("k", aset)
    pristine = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    for strength in (0.8, -0.25):
        report = live.apply_loras(("lora", strength), [(m, strength, strength) for m in mods])
        assert report.modules == 4 and report.tensors == 4 and report.forms == {"low-rank": 4} and not report.cached
        merged = dict(weights)
        for m in mods:
            up, down = m.tensors["up"].flatten(1), m.tensors["down"].flatten(1)
            merged[m.target + ".weight"] = weights[m.target + ".weight"] + strength * 0.5 * (up @ down).reshape(
                weights[m.target + ".weight"].shape)
        want = fold.fold_state_dict(merged, aset)
        now = unet.state_dict()
        for key, ref in want.items():
            assert torch.allclose(now[key], ref, atol=1e-12, rtol=0), key
    assert live.apply_loras(("lora", -0.25), []).cached                 # same key: nothing computed
    live.apply_loras((), [])
    assert all(torch.equal(v, pristine[k]) for k, v in unet.state_dict().items())
    live.apply_loras(("lora", 1.0), [(m, 1.0, 1.0) for m in mods])
    live.restore()
    _assert_same(unet, snap)
    assert live.apply("k", aset).cached                                 # from the cache: pristine
    assert all(torch.equal(v, pristine[k]) for k, v in unet.state_dict().items())


def test_apply_loras_refuses_dora_on_a_folded_layer_before_changing_anything(unet_and_adapters):
    from sdslim_core.io.lora_files import LoraError
    unet, aset = unet_and_adapters
    first, fine, dora = (_lora_module(unet, f"{FF}.net.2", 1), _lora_module(unet, f"{FF}.net.0.proj", 2),
                         _lora_module(unet, f"{FF}.net.2", 3, dora=True))
    live = LiveSlim(unet)
    live.apply("k", aset)
    live.apply_loras("a", [(first, 1.0, 1.0)])
    before = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    with pytest.raises(LoraError, match="DoRA.*fold it instead"):
        live.apply_loras("b", [(fine, 1.0, 1.0), (dora, 1.0, 1.0)])
    assert live.lora_key == "a" and all(torch.equal(v, before[k]) for k, v in unet.state_dict().items())


@pytest.mark.parametrize("acc", __import__("emulated_device").accelerators())
def test_on_a_gpu_the_fold_and_the_loras_run_where_the_unet_is_and_restore_brings_the_originals_back(
        unet_and_adapters, acc):
    """A1111 on CUDA: the webui's UNet sits on the GPU, the adapter file and LoRA tensors are read on the CPU. On
    the emulated device (tests/emulated_device.py) apply, apply_loras (with offload of the originals) and restore
    give what they give on the CPU (the adapters and LoRA factors follow the weights in ops.fold / ops.lora; LiveSlim
    no longer copies them to the device itself)."""
    from emulated_device import on
    unet, aset = unet_and_adapters
    paths = [f"{FF}.net.0.proj", f"{FF}.net.2", "input_blocks.1.0.in_layers.2", "input_blocks.1.0.out_layers.3"]
    mods = [_lora_module(unet, p, i) for i, p in enumerate(paths)]
    live = LiveSlim(unet)
    live.apply("k", aset)
    live.apply_loras(("lora", 0.8), [(m, 0.8, 0.8) for m in mods])
    want = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    live.restore()
    with on(acc) as dev:
        unet.to(dev)
        originals = {p: unet.get_submodule(p) for p in live.layer_paths(aset)}
        gpu = LiveSlim(unet)
        gpu.apply("k", aset, offload=True)
        assert all(p.device == dev for path in gpu.replaced for p in unet.get_submodule(path).parameters())
        assert all(p.device.type == "cpu" for m in originals.values() for p in m.parameters())      # offloaded
        gpu.apply_loras(("lora", 0.8), [(m, 0.8, 0.8) for m in mods])
        got = {k: v.detach().cpu() for k, v in unet.state_dict().items()}
        gpu.restore()
        assert all(unet.get_submodule(p) is m and all(t.device == dev for t in m.parameters())
                   for p, m in originals.items())
    assert got.keys() == want.keys()
    for k, v in want.items():       # float64 on the emulated device; a GPU sums in its own order
        torch.testing.assert_close(got[k], v, rtol=1e-6 if acc == "emulated" else 1e-5, atol=1e-9, msg=k)
