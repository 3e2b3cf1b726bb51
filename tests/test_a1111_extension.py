"""scripts/sdslim.py in the stand-in webui: fold after the LoRA merge, restore, cache, errors, ControlNet-style
residuals, infotext round trip, VRAM report. References are independent: a manual float64 LoRA merge with
``swap.attach_train_adapters`` (the train-time form), never the code under test."""
import copy
import os
import re

import pytest
import torch

from a1111_standin.harness import (FakeSdModel, Session, checkpoint, context, first_noise, lora_for,
                                   merged_reference, tiny_unet, tiny_unet_of_another_width, train_time_output,
                                   write_adapters)
from a1111_standin.harness import one_thread, webui  # noqa: F401 (fixtures)
from sdslim_core.io import adapters
from sdslim_core.modules import swap

FF = "input_blocks.1.1.transformer_blocks.0.ff"
RES = "input_blocks.1.0"
LORA_LAYERS = [f"{FF}.net.0.proj", f"{FF}.net.2", f"{RES}.in_layers.2", f"{RES}.emb_layers.1", f"{RES}.out_layers.3",
               "middle_block.1.transformer_blocks.0.attn1.to_q"]          # the last one is not folded
TOL = 1e-10


@pytest.fixture
def session(webui):
    unet = tiny_unet()
    s = Session(unet)
    s.adapter_file = write_adapters(webui.adapters, unet)
    s.module.refresh_adapters()
    import networks
    s.networks = networks
    s.lora = lora_for(unet, LORA_LAYERS)
    networks.available_networks["a"] = s.lora
    s.settings(enable=True, adapters="tiny.safetensors", strength=1.0)
    return s


def _reference(s, strength=1.0, multiplier=0.0, seed=11):
    return train_time_output(s.pristine, s.adapter_file, strength, first_noise(seed), s.context, s.lora, multiplier)


def _params(infotext):
    from modules import infotext_utils
    return infotext_utils.parse_generation_parameters(infotext)


def test_slim_output_equals_train_time_adapters_on_the_lora_merged_unet(session):
    p, res = session.generate("cat <lora:a:0.8>")
    assert not p.standin_script_errors
    out = p.standin_outputs[0]
    ref = _reference(session, multiplier=0.8)
    assert torch.allclose(out, ref, atol=TOL, rtol=0), (out - ref).abs().max()
    no_lora = _reference(session, multiplier=0.0)
    assert (out - no_lora).abs().max() > 1e-3, "the LoRA must change the output (else this test proves nothing)"
    assert session.networks.extra_network_lora.errors == {}
    info = _params(res.infotexts[0])
    assert re.fullmatch(r"adapters=tiny\.safetensors \[[0-9a-f]{10}\], ratio=1", info["SD Slim"])


def test_the_merged_lora_weight_is_what_gets_folded(session):
    session.generate("cat <lora:a:0.8>")
    proj = session.unet.get_submodule(f"{FF}.net.0.proj")
    original = session.live.original(f"{FF}.net.0.proj")
    assert proj is not original and proj.weight.shape[0] < original.weight.shape[0]
    # independent float64 fold of W0 + ΔW (value rows first, gate rows second)
    w0 = session.pristine.get_submodule(f"{FF}.net.0.proj").weight
    lw = session.lora["diffusion_model_" + f"{FF}.net.0.proj".replace(".", "_")]
    merged = w0 + lw["lora_up.weight"] @ lw["lora_down.weight"] * (float(lw["alpha"]) / 2) * 0.8
    aset = adapters.AdapterSet.load(session.adapter_file)
    m = merged.shape[0] // 2
    t = aset.sites[FF]
    want = torch.cat([t["down_value"].double() @ merged[:m], t["down_gate"].double() @ merged[m:]])
    assert torch.allclose(proj.weight, want, atol=TOL, rtol=0)
    assert not torch.allclose(proj.weight, torch.cat([t["down_value"].double() @ w0[:m],
                                                      t["down_gate"].double() @ w0[m:]]), atol=1e-6)


def test_slim_layers_are_fresh_modules_the_lora_extension_ignores(session):
    session.generate("cat <lora:a:1>")
    slim = [session.unet.get_submodule(p) for p in session.live.replaced]
    assert slim and all(not hasattr(m, "network_layer_name") for m in slim)
    assert session.networks.extra_network_lora.errors == {}
    # negative control: a slim layer carrying the original's name gets the full-size delta -> counted error
    slim[0].network_layer_name = session.live.original(LORA_LAYERS[0]).network_layer_name
    session.networks.network_apply_weights(slim[0])
    assert session.networks.extra_network_lora.errors == {"a": 1}


def test_restore_gives_back_the_same_parameter_objects_bit_identical(session):
    session.settings(offload=True)
    snap = session.snapshot()
    p, _ = session.generate("cat")
    assert session.live.installed and session.live.offloaded
    assert any(dict(session.unet.named_parameters()).get(k) is not obj for k, (obj, _) in snap.items())
    p, res = session.generate("cat", mode="Off")
    session.assert_same_as(snap)
    with torch.no_grad():
        plain = session.pristine(first_noise(11), torch.full((1,), 500), context=session.context)
    assert torch.equal(p.standin_outputs[0], plain)
    assert "SD Slim" not in _params(res.infotexts[0])


def _count_folds(monkeypatch):
    from sdslim_core.ops import fold
    calls, real = [], fold.fold_state_dict
    monkeypatch.setattr(fold, "fold_state_dict", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_lora_and_strength_changes_apply_in_slim_space_without_a_fold(session, monkeypatch):
    folds = _count_folds(monkeypatch)
    p1, _ = session.generate("cat <lora:a:1.0>")
    assert folds and session.live.lora_report.modules == 5           # the five LoRA layers inside folded sites
    folds.clear()
    for multiplier in (0.5, -0.3, 0.0):
        p, _ = session.generate(f"cat <lora:a:{multiplier}>")
        assert torch.allclose(p.standin_outputs[0], _reference(session, multiplier=multiplier), atol=TOL, rtol=0)
    p3, _ = session.generate("cat <lora:a:1.0>")
    assert torch.equal(p3.standin_outputs[0], p1.standin_outputs[0])
    p4, _ = session.generate("cat")                                  # no LoRA: the pristine fold
    assert torch.allclose(p4.standin_outputs[0], _reference(session, multiplier=0.0), atol=TOL, rtol=0)
    assert not folds, "a LoRA or strength change must not fold again"
    for path in LORA_LAYERS[:5]:            # the originals were never merged into while slim
        assert getattr(session.live.original(path), "network_current_names", ()) == (), path


def _lycoris(s):
    """A LoHa on the GEGLU proj and a conv2, a full diff (with its bias) on conv1, a LoKr on emb (float64)."""
    g = torch.Generator().manual_seed(21)

    def r(*shape):
        return 0.2 * torch.randn(*shape, generator=g, dtype=torch.float64)
    net = {}
    for path in (f"{FF}.net.0.proj", f"{RES}.out_layers.3"):
        w = s.unet.get_submodule(path).weight
        net["diffusion_model_" + path.replace(".", "_")] = {
            "hada_w1_a": r(w.shape[0], 2), "hada_w1_b": r(2, w[0].numel()), "hada_w2_a": r(w.shape[0], 2),
            "hada_w2_b": r(2, w[0].numel()), "alpha": torch.tensor(1.0, dtype=torch.float64)}
    conv1 = s.unet.get_submodule(f"{RES}.in_layers.2")
    net["diffusion_model_" + f"{RES}.in_layers.2".replace(".", "_")] = {"diff": r(*conv1.weight.shape),
                                                                        "diff_b": r(conv1.weight.shape[0])}
    emb = s.unet.get_submodule(f"{RES}.emb_layers.1").weight
    net["diffusion_model_" + f"{RES}.emb_layers.1".replace(".", "_")] = {
        "lokr_w1": r(2, 2), "lokr_w2_a": r(emb.shape[0] // 2, 3), "lokr_w2_b": r(3, emb.shape[1] // 2),
        "alpha": torch.tensor(6.0, dtype=torch.float64)}
    return net


def _two_networks_reference(s, adapter_file, ma, mb, x):
    """Train-time adapters on the original with both networks merged (independent float64 merge)."""
    base = merged_reference(merged_reference(s.pristine, s.lora, ma), s.networks.available_networks["b"], mb)
    model, _ = swap.attach_train_adapters(base, adapters.AdapterSet.load(adapter_file))
    with torch.no_grad():
        return model(x, torch.full((1,), 500), context=s.context)


def test_lycoris_forms_and_an_ff_intercept_apply_in_slim_space_exactly(session, webui, monkeypatch):
    """LoHa, LoKr and a full diff with its bias next to a LoRA on net.2 of a site with an FF intercept (which
    moves the slim net.2 bias): the slim UNet equals the train-time adapters on the LoRA-merged original."""
    aset = adapters.AdapterSet.load(session.adapter_file)
    g = torch.Generator().manual_seed(5)
    for t in aset.sites.values():
        if "down_value" in t:
            t["up_bias"] = 0.5 * torch.randn(t["up"].shape[0], generator=g)
    aset.save(webui.adapters / "with_c.safetensors")
    session.module.refresh_adapters()
    session.networks.available_networks["b"] = _lycoris(session)
    folds = _count_folds(monkeypatch)
    for i, (ma, mb) in enumerate(((0.7, 1.0), (0.7, -0.4), (0.2, 0.6))):
        p, _ = session.generate(f"cat <lora:a:{ma}> <lora:b:{mb}>", adapter="with_c.safetensors")
        assert not p.standin_script_errors and session.live.lora_report.modules == 9
        want = _two_networks_reference(session, webui.adapters / "with_c.safetensors", ma, mb, first_noise(11))
        assert torch.allclose(p.standin_outputs[0], want, atol=TOL, rtol=0), (p.standin_outputs[0] - want).abs().max()
        assert (len(folds) > 0) == (i == 0), "only the first generation folds"
        folds.clear()
    assert session.live.lora_report.forms == {"low-rank": 6, "dense": 3}   # net.2 (intercept), full diff, LoKr
    bias = session.unet.get_submodule(f"{FF}.net.2").bias.detach().clone()
    session.generate("cat", adapter="with_c.safetensors")
    assert not torch.equal(bias, session.unet.get_submodule(f"{FF}.net.2").bias)   # the intercept's shift is gone


def test_a_form_that_needs_the_full_weight_is_folded_in(session, capsys, monkeypatch):
    """A LyCORIS bias term (computed into ΔW) on a folded layer: today's path, merged into the originals first."""
    layer = f"{FF}.net.0.proj"
    w = session.networks.available_networks["a"]["diffusion_model_" + layer.replace(".", "_")]
    w["bias"] = 0.1 * torch.ones(w["lora_up.weight"].shape[0], w["lora_down.weight"].shape[1], dtype=torch.float64)
    folds = _count_folds(monkeypatch)
    p, _ = session.generate("cat <lora:a:0.8>")
    assert "LyCORIS bias term on a folded layer needs the full-size weight" in capsys.readouterr().err
    assert folds and session.live.lora_report.modules == 0
    base = merged_reference(session.pristine, session.lora, 0.8)     # the LoRA with its bias term, by hand
    with torch.no_grad():
        base.get_submodule(layer).weight += 0.8 * (float(w["alpha"]) / 2) * w["bias"]
    model, _ = swap.attach_train_adapters(base, adapters.AdapterSet.load(session.adapter_file))
    with torch.no_grad():
        want = model(first_noise(11), torch.full((1,), 500), context=session.context)
    assert torch.allclose(p.standin_outputs[0], want, atol=TOL, rtol=0)


def test_disable_after_loras_in_slim_space_gives_back_bit_identical_originals(session):
    snap = session.snapshot()
    session.generate("cat <lora:a:0.8>")
    session.generate("cat <lora:a:0.3>")
    p, _ = session.generate("cat <lora:a:0.3>", mode="Off")          # the extension merges into the originals
    with torch.no_grad():
        want = merged_reference(session.pristine, session.lora, 0.3)(first_noise(11), torch.full((1,), 500),
                                                                     context=session.context)
    assert torch.allclose(p.standin_outputs[0], want, atol=TOL, rtol=0)
    p, _ = session.generate("cat", mode="Off")
    session.assert_same_as(snap)
    assert torch.equal(p.standin_outputs[0], _plain(session))


def _plain(s, seed=11):
    """The UNet's output in a webui without SD Slim and without any LoRA."""
    with torch.no_grad():
        return s.pristine(first_noise(seed), torch.full((1,), 500), context=s.context)


def _functional_lora(s):
    """Settings › Compatibility › "Lora/Networks: use old method …": the Lora extension adds each LoRA in the
    layer's forward, and leaves a layer's weight as it is while no network is loaded."""
    from modules import shared
    shared.opts.set("lora_functional", True)


def test_functional_lora_mode_gives_back_unmerged_originals(session):
    _functional_lora(session)
    snap = session.snapshot()
    p1, res = session.generate("cat <lora:a:0.6>")
    assert not p1.standin_script_errors and "SD Slim" in _params(res.infotexts[0])
    assert torch.allclose(p1.standin_outputs[0], _reference(session, multiplier=0.6), atol=TOL, rtol=0)
    p2, _ = session.generate("cat", mode="Off")
    assert torch.equal(p2.standin_outputs[0], _plain(session))
    session.assert_same_as(snap)
    for path in LORA_LAYERS:        # as the functional path leaves them: no backup, no merge recorded
        layer = session.unet.get_submodule(path)
        assert getattr(layer, "network_weights_backup", None) is None, path
        assert getattr(layer, "network_current_names", ()) == (), path
    p3, _ = session.generate("cat <lora:a:0.6>", mode="Off")      # the LoRA alone, added functionally
    with torch.no_grad():
        want = merged_reference(session.pristine, session.lora, 0.6)(first_noise(11), torch.full((1,), 500),
                                                                     context=session.context)
    assert torch.allclose(p3.standin_outputs[0], want, atol=TOL, rtol=0)
    p4, _ = session.generate("cat <lora:a:0.6>")                  # cached slim layers, no merge
    assert session.live.report.cached and torch.equal(p4.standin_outputs[0], p1.standin_outputs[0])


def test_console_says_folded_only_when_it_folded_and_cached_otherwise(session, capsys):
    def lines():
        return [ln for ln in capsys.readouterr().err.splitlines() if "[SD Slim]" in ln]
    session.generate("cat <lora:a:0.8>")
    first = lines()
    m = re.fullmatch(r"\[SD Slim\] folded (15 sites \(46 layers, [0-9.]+ MiB saved\)) in [0-9.]+ s", first[0])
    assert len(first) == 2 and m, first
    lora_line = r"\[SD Slim\] LoRA in slim space: 5 modules \(5 low-rank\) on 5 slim tensors, "
    assert re.fullmatch(lora_line + r"applied in [0-9.]+ s, no fold", first[1]), first
    session.generate("cat <lora:a:0.8>")                      # nothing changed: the installed slim layers are used
    session.generate("cat <lora:a:0.5>")                      # another strength: no fold, the deltas again
    got = lines()
    cached = f"[SD Slim] cached: {m[1]}, no fold"
    assert got[0] == got[2] == cached and re.fullmatch(lora_line + "already applied", got[1]), got
    assert len(got) == 4 and re.fullmatch(lora_line + r"applied in [0-9.]+ s, no fold", got[3]), got


def test_disable_in_settings_restores_at_once(session):
    snap = session.snapshot()
    session.generate("cat")
    assert session.live.installed
    session.settings(enable=False)          # onchange, restore_on_disable is on by default
    assert session.live is None
    session.assert_same_as(snap)


def test_disable_without_restore_on_disable_restores_at_the_next_generation(session):
    snap = session.snapshot()
    session.settings(restore_on_disable=False)
    session.generate("cat")
    session.settings(enable=False)
    assert session.live.installed
    p, _ = session.generate("cat")
    session.assert_same_as(snap)
    with torch.no_grad():
        plain = session.pristine(first_noise(11), torch.full((1,), 500), context=session.context)
    assert torch.equal(p.standin_outputs[0], plain)


def test_error_mid_fold_leaves_the_model_intact_and_says_why(session, monkeypatch, capsys):
    from sdslim_core.ops import fold
    real, calls = fold.fold_state_dict, []

    def failing(weights, adapter_set, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("simulated failure in site 4")
        return real(weights, adapter_set, **kw)
    monkeypatch.setattr(fold, "fold_state_dict", failing)
    snap = session.snapshot()
    p, res = session.generate("cat")
    session.assert_same_as(snap)
    assert not session.live.installed and len(calls) == 4
    info = _params(res.infotexts[0])
    assert "simulated failure in site 4" in info["SD Slim error"] and "SD Slim" not in info
    assert "simulated failure in site 4" in capsys.readouterr().err
    with torch.no_grad():
        plain = session.pristine(first_noise(11), torch.full((1,), 500), context=session.context)
    assert torch.equal(p.standin_outputs[0], plain)


def test_adapters_for_another_model_fail_clearly(session, webui):
    other = tiny_unet_of_another_width()
    write_adapters(webui.adapters, other, name="other.safetensors")
    snap = session.snapshot()
    _, res = session.generate("cat", adapter="other.safetensors")
    session.assert_same_as(snap)
    err = _params(res.infotexts[0])["SD Slim error"]
    assert err.startswith(f"{webui.adapters / 'other.safetensors'}: input_blocks.1.0: adapter width 64 does not "
                          "match the model's 32"), err          # in words: no SwapError/AdapterError class names


def test_checkpoint_reload_into_the_same_model_restores_first_and_refolds(session):
    from modules import sd_models
    session.generate("cat")
    assert session.live.installed
    b = tiny_unet(seed=9)
    info_b = checkpoint("tiny-b", b.state_dict())
    sd_models.reload_model_weights(info=info_b)      # load_state_dict(strict=False) into the same objects
    assert not session.live.installed
    for k, v in b.state_dict().items():
        assert torch.equal(session.unet.state_dict()[k], v), k
    p, _ = session.generate("cat")
    ref = train_time_output(b, session.adapter_file, 1.0, first_noise(11), session.context)
    assert torch.allclose(p.standin_outputs[0], ref, atol=TOL, rtol=0)


def test_hires_pass_with_another_checkpoint_folds_each_pass(session):
    b = tiny_unet(seed=9)
    info_b = checkpoint("tiny-b", b.state_dict())
    p = session.p("cat", enable_hr=True, hr_checkpoint_name="tiny-b", hr_checkpoint_info=info_b)
    from modules import processing
    processing.process_images(p)
    assert not p.standin_script_errors and len(p.standin_outputs) == 2
    first = _reference(session)
    assert torch.allclose(p.standin_outputs[0], first, atol=TOL, rtol=0)
    second = train_time_output(b, session.adapter_file, 1.0, p.standin_outputs[0], session.context)
    assert torch.allclose(p.standin_outputs[1], second, atol=TOL, rtol=0)


def test_another_model_loaded_restores_the_old_one(session):
    from modules import script_callbacks, shared
    snap = session.snapshot()
    session.generate("cat")
    shared.sd_model = FakeSdModel(tiny_unet(seed=4), "tiny-c")
    script_callbacks.model_loaded_callback(shared.sd_model)
    assert session.module._State.live is None
    session.assert_same_as(snap)


def test_ui_reload_and_unload_restore(session):
    from modules import script_callbacks
    snap = session.snapshot()
    session.generate("cat")
    script_callbacks.app_reload_callback()
    assert session.module._State.live is None
    session.assert_same_as(snap)
    session.generate("cat")
    script_callbacks.script_unloaded_callback()
    session.assert_same_as(snap)


def test_strength_folds_the_lowest_error_sites_first(session):
    p, res = session.generate("cat", strength=0.25)
    errors = adapters.AdapterSet.load(session.adapter_file).site_errors()   # recorded highest-first in file order
    k = round(0.25 * len(errors))
    expected = sorted(errors, key=errors.get)[:k]
    assert expected != list(errors)[:k], "errors must not follow file order (else the order is not tested)"
    assert {path.rsplit(".", 2)[0] if ".ff." not in path else path.split(".ff.")[0] + ".ff"
            for path in session.live.replaced} == set(expected)
    assert torch.allclose(p.standin_outputs[0], _reference(session, strength=0.25), atol=TOL, rtol=0)
    assert _params(res.infotexts[0])["SD Slim"].endswith("ratio=0.25")


def _controlnet_forward(unet, x, t, ctx, residuals, middle):
    """A UNet pass the way ControlNet hooks it: walk the blocks, add residuals to every skip and the middle."""
    from ldm.modules.diffusionmodules.openaimodel import timestep_embedding
    emb = unet.time_embed(timestep_embedding(t, unet.model_channels).to(x.dtype))
    hs, h = [], x
    for block, r in zip(unet.input_blocks, residuals):
        h = block(h, emb, ctx)
        hs.append(h + r)
    h = unet.middle_block(h, emb, ctx) + middle
    for block in unet.output_blocks:
        h = block(torch.cat([h, hs.pop()], dim=1), emb, ctx)
    return unet.out(h)


def test_controlnet_style_residuals_work_on_the_slim_unet(session):
    session.generate("cat <lora:a:0.7>")
    x, t = first_noise(3), torch.full((1,), 300)
    shapes, h = [], x
    with torch.no_grad():
        emb = session.unet.time_embed(torch.zeros(1, session.unet.model_channels, dtype=x.dtype))
        for block in session.unet.input_blocks:
            h = block(h, emb, session.context)
            shapes.append(h.shape)
        mid = session.unet.middle_block(h, emb, session.context).shape
    g = torch.Generator().manual_seed(5)
    residuals = [torch.randn(s, generator=g, dtype=x.dtype) for s in shapes]
    middle = torch.randn(mid, generator=g, dtype=x.dtype)
    ref_model, _ = swap.attach_train_adapters(merged_reference(session.pristine, session.lora, 0.7),
                                              adapters.AdapterSet.load(session.adapter_file))
    with torch.no_grad():
        got = _controlnet_forward(session.unet, x, t, session.context, residuals, middle)
        want = _controlnet_forward(ref_model, x, t, session.context, residuals, middle)
        without = _controlnet_forward(ref_model, x, t, session.context, [r * 0 for r in residuals], middle * 0)
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    assert (want - without).abs().max() > 1e-3


def test_infotext_round_trips_through_paste(session, webui):
    from modules import infotext_utils
    _, res = session.generate("cat", strength=0.5)
    params = infotext_utils.parse_generation_parameters(res.infotexts[0])
    pasted = [key(params) if callable(key) else params.get(key) for _, key in session.script.infotext_fields]
    assert pasted == ["On", "tiny.safetensors", 0.5]
    session.settings(enable=False)
    _, again = session.generate("cat", mode=pasted[0], adapter=pasted[1], strength=pasted[2])
    assert infotext_utils.parse_generation_parameters(again.infotexts[0])["SD Slim"] == params["SD Slim"]
    # a renamed adapter file is found by its hash; an image made without SD Slim pastes "Off"
    os.rename(session.adapter_file, os.path.join(webui.adapters, "renamed.safetensors"))
    assert [key(params) for _, key in session.script.infotext_fields][1] == "renamed.safetensors"
    plain = infotext_utils.parse_generation_parameters("cat\nNegative prompt: \nSteps: 20, Seed: 1, Size: 64x64")
    assert [key(plain) for _, key in session.script.infotext_fields] == ["Off", None, None]


def _sha256(path):
    import hashlib
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_renamed_or_moved_settings_adapter_file_is_found_by_its_sha256(session, webui, capsys):
    """Settings keep the sha256 of their adapter file (a hidden option, set when it is chosen and whenever its name
    finds it): after the file is renamed, or moved into a subfolder, a generation finds it by that hash, folds it
    as before and names the new file in the infotext and in Settings; a file whose content changed is not taken
    for it, and the error says why without the refresh-button advice."""
    from modules import shared
    record = f"{_sha256(session.adapter_file)}  tiny.safetensors"
    assert shared.opts.sdslim_adapters_sha256 == record                      # chosen in Settings (the fixture)
    want = _reference(session)
    (webui.adapters / "sub").mkdir()
    for new in ("renamed.safetensors", "sub/moved.safetensors"):
        old = shared.opts.sdslim_adapters
        os.rename(webui.adapters / old, webui.adapters / new)
        capsys.readouterr()
        p, res = session.generate("cat")
        info = _params(res.infotexts[0])
        assert "SD Slim error" not in info, info["SD Slim error"]
        assert info["SD Slim"].startswith(f"adapters={new} ["), info["SD Slim"]
        assert torch.allclose(p.standin_outputs[0], want, atol=TOL, rtol=0)
        assert shared.opts.sdslim_adapters == new and shared.opts.sdslim_adapters_sha256.endswith(f"  {new}")
        assert f"adapter file {old} not found; using {new}, the file with its sha256" in capsys.readouterr().err
    # the file replaced by another one (other content) under a new name: not taken for it
    write_adapters(webui.adapters, session.pristine, name="other.safetensors", seed=9)
    os.remove(webui.adapters / "sub/moved.safetensors")
    _, res = session.generate("cat")
    assert not session.live.installed                                        # the original layers are back
    err = _params(res.infotexts[0])["SD Slim error"]
    assert err == (f"SD Slim adapter file sub/moved.safetensors is not in {webui.adapters}, and no file there has "
                   f"its content (sha256 {record[:10]}); put it back or choose another one in Settings"), err
    # a file chosen in Settings and renamed before any generation is found too
    session.settings(adapters="other.safetensors")
    os.rename(webui.adapters / "other.safetensors", webui.adapters / "other2.safetensors")
    _, res = session.generate("cat")
    assert _params(res.infotexts[0])["SD Slim"].startswith("adapters=other2.safetensors ["), res.infotexts[0]


def test_vram_report_on_cpu(session):
    p, res = session.generate("cat")
    text = _params(res.infotexts[0])["SD Slim VRAM"]
    assert text.startswith("no CUDA, RAM (RSS) ")
    slim_bytes = sum(t.numel() * t.element_size() for t in session.unet.parameters())
    full_bytes = sum(t.numel() * t.element_size() for t in session.pristine.parameters())
    m = re.search(r"UNet weights ([0-9.]+) MiB -> ([0-9.]+) MiB", text)
    assert m and float(m[1]) == pytest.approx(full_bytes / 2 ** 20, abs=0.051)
    assert float(m[2]) == pytest.approx(slim_bytes / 2 ** 20, abs=0.051) and slim_bytes < full_bytes
    assert session.module.show_report() == session.module._State.report_html
    assert "RSS" in session.module._State.report_html and "UNet weights" in session.module._State.report_html


def test_norm2_lora_is_reported_not_silently_dropped(session):
    session.networks.available_networks["n"] = lora_for(session.unet, [f"{RES}.out_layers.0"])
    _, res = session.generate("cat <lora:n:1>")
    assert "n changes norm2 of 1 folded ResBlocks" in _params(res.infotexts[0])["SD Slim warning"]


def test_settings_are_registered_in_the_sd_slim_section(session, webui):
    from modules import script_callbacks, shared
    keys = ["sdslim_enable", "sdslim_adapters", "sdslim_strength", "sdslim_restore_on_disable", "sdslim_offload"]
    for k in keys:     # registered at import (the settings API lists them even with --nowebui) ...
        assert shared.opts.data_labels[k].section == ("sdslim", "SD Slim"), k
    script_callbacks.ui_settings_callback()     # ... and again from on_ui_settings, harmlessly
    assert [k for k in shared.opts.data_labels if k.startswith("sdslim_")] == keys + ["sdslim_adapters_sha256"]
    # the adapter file's sha256 is a hidden option, as the webui keeps its checkpoint's (sd_checkpoint_hash)
    assert shared.opts.data_labels["sdslim_adapters_sha256"].section == (None, "Hidden options")
    info = shared.opts.data_labels["sdslim_adapters"]
    assert info.component_args()["choices"] == ["None", "tiny.safetensors"]
    (webui.adapters / "sub").mkdir()
    (webui.adapters / "sub" / "more.safetensors").write_bytes(open(session.adapter_file, "rb").read())
    info.refresh()
    assert info.component_args()["choices"] == ["None", "sub/more.safetensors", "tiny.safetensors"]


def test_webui_before_1_10_folds_in_process_batch(webui, monkeypatch):
    from modules import scripts
    monkeypatch.delattr(scripts.ScriptRunner, "process_before_every_sampling")
    unet = tiny_unet()
    s = Session(unet)
    assert s.module.HAS_SAMPLING_HOOK is False
    s.adapter_file = write_adapters(webui.adapters, unet)
    s.module.refresh_adapters()
    s.settings(enable=True, adapters="tiny.safetensors", strength=1.0)
    p, _ = s.generate("cat")
    ref = train_time_output(s.pristine, s.adapter_file, 1.0, first_noise(11), s.context)
    assert torch.allclose(p.standin_outputs[0], ref, atol=TOL, rtol=0)


def test_forge_is_refused_clearly(webui, tmp_path, monkeypatch):
    (tmp_path / "forge" / "modules_forge").mkdir(parents=True)
    (tmp_path / "forge" / "modules_forge" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "forge"))
    unet = tiny_unet()
    s = Session(unet)
    assert s.module.FORGE
    write_adapters(webui.adapters, unet)
    s.module.refresh_adapters()
    s.settings(enable=True, adapters="tiny.safetensors")
    snap = s.snapshot()
    _, res = s.generate("cat")
    s.assert_same_as(snap)
    assert "does not support Forge" in _params(res.infotexts[0])["SD Slim error"]


def test_off_gives_the_original_model_back_after_lora_functional_is_switched_on(session):
    """A LoRA merged in place (ordinary mode), then "use old method" switched on and a slim generation with a
    LoRA, then SD Slim off without a LoRA: the originals the fold replaced must not keep the old merge (the
    functional forward restores nothing while no network is loaded)."""
    snap = session.snapshot()
    p0, _ = session.generate("cat <lora:a:0.7>", mode="Off")       # the extension merges into the originals
    assert (p0.standin_outputs[0] - _plain(session)).abs().max() > 1e-3
    _functional_lora(session)
    p1, _ = session.generate("cat <lora:a:0.6>")
    assert torch.allclose(p1.standin_outputs[0], _reference(session, multiplier=0.6), atol=TOL, rtol=0)
    p2, _ = session.generate("cat", mode="Off")
    assert torch.equal(p2.standin_outputs[0], _plain(session))
    session.assert_same_as(snap)


# ------------------------------------------------------------------------------------------------------- soak

SOAK = os.environ.get("SDSLIM_SOAK") == "1"
SOAK_LORAS = ((), (("a", 0.8),), (("a", 0.3), ("b", 0.5)))     # none, a LoRA, a LoRA and a LyCORIS network


def _soak_plan(n: int, seed: int = 0) -> tuple[list[dict], int]:
    """(``n`` generations, how many of them are the warm-up): first every setting once, then a seeded mix of them, SD Slim off
    (with and without a LoRA), SD Slim switched off in Settings, hires fix and the Lora extension's functional mode
    toggled. A toggle comes after a generation without SD Slim and LoRA in the old mode: the Lora extension's
    functional forward keeps whatever an ordinary in-place merge left in a layer (SD Slim or not), so only from
    that clean state is "the original model" defined in the new mode."""
    import random
    on = [dict(mode="On", adapter=a, strength=s, loras=lo, hires=False)
          for a in ("tiny.safetensors", "quarter.safetensors") for s in (1.0, 0.5) for lo in SOAK_LORAS]
    on += [dict(on[1], hires=True), dict(on[9], hires=True)]
    clean = dict(mode="Off", loras=(), hires=False)
    off = [clean, dict(clean, hires=True), dict(clean, loras=SOAK_LORAS[1]), dict(clean, mode="settings")]
    rng = random.Random(seed)
    plan = [dict(g, functional=False) for g in on + off]
    functional = False
    while len(plan) < n:
        if rng.random() < 0.1:
            plan.append(dict(clean, functional=functional))
            functional = not functional
        plan.append(dict(rng.choice(on) if rng.random() < 0.7 else rng.choice(off), functional=functional))
    return plan, len(on) + len(off)


def _setting_key(g: dict) -> tuple:
    """The settings that decide a generation's output (the functional mode changes the rounding of non-slim
    layers' LoRA, so it is part of it)."""
    return tuple(sorted(g.items()))


def _rss() -> int:
    import gc
    import psutil
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("n", [pytest.param(50, id="50"),
                               pytest.param(400, id="400", marks=pytest.mark.skipif(
                                   not SOAK, reason="long soak: set SDSLIM_SOAK=1"))])
def test_soak_many_generations_stay_exact_bounded_and_give_the_original_back(session, webui, n):
    """``n`` generations cycling SD Slim on/off (override and Settings), two adapter files, two strengths, no
    LoRA / a LoRA / a LoRA with a LyCORIS network, hires fix and the functional LoRA mode: each slim setting
    equals the float64 train-time reference the first time and is bit-identical to that each time it recurs;
    after each generation with SD Slim off and no LoRA the UNet holds the same Parameter objects with the same
    values as before the first generation; the fold cache keeps at most ``max_cached`` folds (evicted slim
    layers are freed: weakrefs) and the process RSS after the warm-up grows by at most 5 %."""
    import weakref

    from modules import processing, shared
    write_adapters(webui.adapters, session.unet, name="quarter.safetensors", ratio=0.25, seed=2)
    session.module.refresh_adapters()
    session.networks.available_networks["b"] = _lycoris(session)
    files = {"tiny.safetensors": session.adapter_file, "quarter.safetensors": webui.adapters / "quarter.safetensors"}
    snap = session.snapshot()
    plan, warm_up = _soak_plan(n)
    refs, first_seen = {}, {}
    slim_layers = weakref.WeakSet()
    most_layers = max_cached = 0

    def reference(g, x, pass_):
        key = (g.get("adapter"), g.get("strength"), g["loras"], pass_)
        if key not in refs:
            base = session.pristine
            for name, m in g["loras"]:
                base = merged_reference(base, session.networks.available_networks[name], m)
            if g["mode"] == "On":
                base, _ = swap.attach_train_adapters(base, adapters.AdapterSet.load(files[g["adapter"]])
                                                     .select(g["strength"]))
            with torch.no_grad():
                refs[key] = base(x, torch.full((1,), 500), context=session.context)
        return refs[key]

    rss = []
    for i, g in enumerate(plan):
        if i == warm_up:
            rss.append(_rss())
        shared.opts.set("lora_functional", g["functional"])
        session.settings(enable=g["mode"] != "settings")
        prompt = "cat " + " ".join(f"<lora:{name}:{m}>" for name, m in g["loras"])
        p = session.p(prompt, mode=None if g["mode"] == "settings" else g["mode"], adapter=g.get("adapter"),
                      strength=g.get("strength"), enable_hr=g["hires"])
        res = processing.process_images(p)
        info = _params(res.infotexts[0])
        assert not p.standin_script_errors and "SD Slim error" not in info, (i, g, info)
        assert len(p.standin_outputs) == (2 if g["hires"] else 1)
        xs = [first_noise(11), refs.get((g.get("adapter"), g.get("strength"), g["loras"], 0))]
        key = _setting_key(g)
        if key in first_seen:
            for got, want in zip(p.standin_outputs, first_seen[key]):
                assert torch.equal(got, want), (i, g, (got - want).abs().max())
        else:
            first_seen[key] = p.standin_outputs
            for pass_, got in enumerate(p.standin_outputs):
                want = reference(g, xs[pass_], pass_)
                assert torch.allclose(got, want, atol=TOL, rtol=0), (i, g, pass_, (got - want).abs().max())
        if g["mode"] == "On":
            assert "SD Slim" in info and session.live.installed
            slim_layers.update(session.unet.get_submodule(path) for path in session.live.replaced)
            most_layers, max_cached = max(most_layers, len(session.live.replaced)), session.live.max_cached
            assert len(session.live._cache) <= max_cached
        elif not g["loras"]:
            session.assert_same_as(snap)
            assert "SD Slim" not in info
    rss.append(_rss())
    session.generate("cat", mode="Off")
    session.assert_same_as(snap)
    assert len(slim_layers) <= max_cached * most_layers if session.live else not slim_layers
    assert rss[1] <= 1.05 * rss[0], f"RSS grew from {rss[0] / 2 ** 20:.1f} MiB to {rss[1] / 2 ** 20:.1f} MiB"
    print(f"\nsoak: {n} generations ({len(first_seen)} distinct settings), RSS after warm-up "
          f"{rss[0] / 2 ** 20:.1f} MiB, at the end {rss[1] / 2 ** 20:.1f} MiB ({rss[1] / rss[0] - 1:+.1%}); "
          f"slim layers alive {len(slim_layers)} (cache: {max_cached} folds of ≤ {most_layers} layers"
          f"{'' if session.live else '; SD Slim off in Settings: none kept'})")


@pytest.mark.parametrize("overall, shown", [(0.072, "7.2%"), (0.0704, "7.04%"), (0.07001, "7.001%"), (0.25, "25.0%")])
def test_the_distance_warning_never_shows_the_threshold_as_the_distance(session, monkeypatch, overall, shown):
    """Just past the 7 % threshold the warning's number differs visibly from the threshold's (never "7% … (past
    7%)"), with the same formatting as every host (sdslim_core.ops.fingerprint.percent)."""
    from sdslim_core.modules import live_slim
    from sdslim_core.ops import fingerprint
    real = live_slim.LiveSlim._fold

    def far(self, *a, **k):
        layers, report, space = real(self, *a, **k)
        report.distance = fingerprint.Distance({"input_blocks.1.0": overall}, overall, 4, [])
        return layers, report, space
    monkeypatch.setattr(live_slim.LiveSlim, "_fold", far)
    _, res = session.generate("cat")
    warning = _params(res.infotexts[0])["SD Slim warning"]
    assert warning.startswith(f"checkpoint {shown} from the adapters' base (past 7%): "), warning
    assert fingerprint.percent(overall) == shown


def test_the_checkpoints_distance_from_the_adapters_base_is_logged_and_warned(session, webui, capsys):
    """An adapter file fingerprinted on this very model: 0.0 % in the console, no warning; fingerprinted on another
    model of the same shapes (a far derivative): the infotext warns and points to refitting."""
    from sdslim_core.ops import fingerprint
    for name, base, far in (("own.safetensors", session.pristine, False), ("other.safetensors", tiny_unet(seed=5), True)):
        aset = adapters.AdapterSet.load(session.adapter_file)
        weights = {k: v.detach() for k, v in base.state_dict().items()}
        aset.metadata["sdslim.base"] = {"sketches": fingerprint.sketches(((s, aset.kind(s)) for s in aset.sites),
                                                                         weights.get)}
        aset.save(os.path.join(webui.adapters, name))
        session.module.refresh_adapters()
        session.settings(adapters=name)
        capsys.readouterr()
        _, res = session.generate("a photo")
        err = capsys.readouterr().err
        warning = _params(res.infotexts[0]).get("SD Slim warning", "")
        if far:
            assert f"from the adapters' base (past {fingerprint.WARN_TEXT})" in warning
            assert "Start from adapters" in warning
            assert re.search(r"this checkpoint is \d+\.\d% from the adapters' base", err)
        else:
            assert not warning and "this checkpoint is 0.0% from the adapters' base" in err


@pytest.mark.parametrize("acc", __import__("emulated_device").accelerators())
def test_on_a_gpu_the_toggle_folds_and_applies_the_lora_where_the_model_is(webui, acc, monkeypatch):
    """The webui on CUDA: its UNet, noise and conditioning on ``devices.device``, the adapter file and the LoRA read
    on the CPU. On the emulated device (tests/emulated_device.py) the toggle folds there and the generation with a
    LoRA gives the train-time reference computed on the CPU; disabling gives back the same parameter objects."""
    from emulated_device import on
    from modules import devices
    unet = tiny_unet()
    adapter_file = write_adapters(webui.adapters, unet)
    lora = lora_for(unet, LORA_LAYERS)
    cpu = copy.deepcopy(unet)
    want = train_time_output(cpu, adapter_file, 1.0, first_noise(11), context(), lora, 0.8)
    with on(acc) as dev:
        monkeypatch.setattr(devices, "device", dev)
        s = Session(unet.to(dev))
        s.module.refresh_adapters()
        import networks
        networks.available_networks["a"] = lora
        s.settings(enable=True, adapters="tiny.safetensors", strength=1.0)
        snap = s.snapshot()
        p, _ = s.generate("cat <lora:a:0.8>")
        assert not p.standin_script_errors and s.live.installed
        assert all(t.device == dev for path in s.live.replaced for t in s.unet.get_submodule(path).parameters())
        got = p.standin_outputs[0].cpu()
        s.settings(enable=False)
        s.generate("cat")
        s.assert_same_as(snap)
    assert (got - want).abs().max() < (1e-10 if acc == "emulated" else 1e-5), (got - want).abs().max()
