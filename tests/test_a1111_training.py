"""Training adapters from the webui's SD Slim tab, in the stand-in webui: prompts through the webui's own
``get_learned_conditioning`` → an adapter file in models/sdslim that the accordion lists and that slims a
generation; Interrupt and a resume with the same settings give the adapters of an uninterrupted run; the webui's
model (weights, Parameter objects, the Lora extension's merge state) is untouched; refusals; the SDXL
conditioning (pooled slice, negative prompt, size/crop embeddings) against diffusers' own size embedding."""
import dataclasses
import os
import sys

import pytest
import torch

from a1111_standin.harness import (FakeSdModel, Session, first_noise, load_script, lora_for, tiny_unet,
                                   tiny_unet_of_another_width, train_time_output, write_adapters)
from a1111_standin.harness import one_thread, webui  # noqa: F401 (fixtures)
from conftest import tiny_config
from sdslim_core import layout
from sdslim_core.hosts.a1111 import training as a1111_training
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.train import config as train_config, run as train_run
from sdslim_core.train.calibration import sdxl_time_ids

FF = "input_blocks.1.1.transformer_blocks.0.ff"
RES = "input_blocks.1.0"
PROMPTS = "a red cube on a table\na blue ball <lora:a:1.0>"
FORM = dict(negative="", ratio=0.5, budget="", steps=2, size=64, seed=0)


@dataclasses.dataclass
class Quick(train_config.TrainConfig):
    """Tiny calibration and frequent checkpoints, so a run takes seconds; the same code path."""
    n_trajectories: int = 2
    sample_steps: int = 2
    tokens_per_sample: int = 16
    ff_tokens: int = 256
    res_maps: int = 8
    init_methods: tuple = ("select", "act_select")
    uniform: bool = True
    checkpoint_every: int = 3


@pytest.fixture
def session(webui, monkeypatch):
    monkeypatch.setattr(train_run, "TrainConfig", Quick)
    unet = tiny_unet()
    s = Session(unet)
    import networks
    s.networks = networks
    networks.available_networks["a"] = lora_for(unet, [f"{FF}.net.0.proj", f"{RES}.in_layers.2"])
    from modules import script_callbacks
    (_, title, elem_id), = script_callbacks.ui_tabs_callback()
    assert (title, elem_id) == ("SD Slim", "sdslim_train")
    return s


def _buttons():
    """{elem_id: (fn, inputs, outputs)} of the tab's buttons (the stand-in gradio records each click)."""
    import gradio
    return {b.kwargs["elem_id"]: b.events[-1][1:] for b in gradio.standin_created
            if isinstance(b, gradio.Button) and b.events and b.kwargs.get("elem_id", "").startswith("sdslim_train_")}


def _train(s, filename="trained", prompts=PROMPTS, task="task(t1)", **kw):
    fn, inputs, outputs = _buttons()["sdslim_train_start"]
    assert outputs[1:-2] == s.module._State.dropdowns           # the accordions' adapter dropdowns
    assert outputs[-2].kwargs["elem_id"] == "sdslim_train_start_from"
    values = {**FORM, "recipe": "full", "start_from": a1111_training.NO_START, "adapter_dtype": "fp16", **kw}
    args = [task, prompts, values["negative"], values["ratio"], values["budget"], values["steps"], values["size"],
            values["seed"], filename, values["recipe"], values["start_from"], values["adapter_dtype"]]
    assert len(args) == len(inputs)
    res = fn(*args)
    assert len(res) == len(outputs)
    return res


def _press_interrupt_when(monkeypatch, when):
    """The user presses the tab's Interrupt button (once) at the first progress ``(done, total, info)`` for which
    ``when`` holds; records what the webui's job state showed at each progress call. Returns (seen, pressed):
    ``pressed`` gets the index in ``seen`` and the info of the call it was pressed at."""
    seen, pressed = [], []
    interrupt, _, _ = _buttons()["sdslim_train_interrupt"]
    real = a1111_training.JobProgress.__call__

    def spy(self, done, total, info):
        from modules import shared
        if not pressed and when(done, total, info):
            interrupt()
            pressed.append((len(seen), dict(info)))
        try:
            real(self, done, total, info)
        finally:
            st = shared.state
            seen.append((st.job, st.job_count, st.job_no, st.sampling_step, st.sampling_steps, st.textinfo))
    monkeypatch.setattr(a1111_training.JobProgress, "__call__", spy)
    return seen, pressed


def _press_interrupt_at(s, monkeypatch, step):
    return _press_interrupt_when(monkeypatch, lambda done, total, info: done == step)[0]


def _lora_state(unet):
    return {n: (getattr(m, "network_current_names", ()), getattr(m, "network_weights_backup", None))
            for n, m in unet.named_modules()}


def _status_lines(monkeypatch):
    """Every status line the tab shows (``JobProgress.say``), in order."""
    said, real = [], a1111_training.JobProgress.say
    monkeypatch.setattr(a1111_training.JobProgress, "say", lambda self, text: said.append(text) or real(self, text))
    return said


def test_train_interrupt_resume_then_the_file_slims_a_generation(session, webui, monkeypatch):
    s = session
    from modules import progress, shared
    s.generate("cat <lora:a:0.8>", mode="Off")            # the Lora extension merges into the UNet in place
    snap, lora_before = s.snapshot(), _lora_state(s.unet)
    assert any(names for names, _ in lora_before.values())
    seen = _press_interrupt_at(s, monkeypatch, 20)
    said = _status_lines(monkeypatch)
    from modules import sd_models
    moved, real_train = sd_models.standin_calls, s.module.train_adapters
    moved.clear()
    monkeypatch.setattr(s.module, "train_adapters", lambda *a, **k: moved.append("train") or real_train(*a, **k))
    text, *updates, html = _train(s)
    # the trainer holds its own teacher: the webui's model leaves the GPU first, by the webui's own function (its
    # --medvram/--lowvram parts too), and comes back when the run ends, interrupted here
    assert moved == [("send_model_to_cpu", s.sd_model), "train", ("send_model_to_device", s.sd_model)], moved
    assert "calibration: the teacher's own sampling runs" in said and not any("reusing" in t for t in said), said
    work = webui.models / "sdslim_work" / "trained.safetensors.work"
    assert text.startswith("Interrupted at step 20 of ") and str(work) in text, text
    assert work.is_dir() and not (webui.adapters / "trained.safetensors").exists()
    assert all(u == {"__type__": "update"} for u in updates) and "Time taken" in html
    job, count, no, step, steps, info = seen[-1]
    assert (job, count, no, step) == (a1111_training.JOB, 1, 0, 20) and steps == 15 * 2 + 2
    assert info.startswith("SD Slim: stage 1 ") and "step 20 of 32, loss " in info
    before = [x for x in seen if ", step " not in x[5]]           # calibration, capture, init: interruptible too
    assert before and all(x[3] == 0 and " of " in x[5] for x in before), before[:3]
    assert [x[3] for x in seen[len(before):]] == list(range(1, 21))
    assert shared.state.job_count == 0 and not shared.state.interrupted      # the GPU call ended the job
    assert progress.finished_tasks[-1] == "task(t1)"

    seen.clear()
    said.clear()
    text, *updates, html = _train(s, task="task(t2)")                         # the same settings: resumed
    assert text.startswith(f"adapters written to {webui.adapters / 'trained.safetensors'}"), text
    work_calib = work / "calib"
    assert f"calibration: reusing the one this run saved in {work_calib} (nothing sampled again)" in said, said
    assert not any("sampling runs" in t for t in said), said
    assert [x[3] for x in seen] == list(range(19, 33)), "resumed after the last checkpoint (step 18), not from 1"
    assert not work.exists() and not (webui.models / "sdslim_work" / "trained.safetensors.work").exists()
    assert "trained.safetensors" in s.module._State.choices
    *updates, start_from = updates                                        # the accordion's, the tab's Start from
    assert all(u["choices"] == ["Settings", *s.module._State.choices] for u in updates) and len(updates) == 1
    assert start_from["choices"] == [a1111_training.NO_START, *s.module._State.choices]
    s.assert_same_as(snap)                                                   # the webui's model is untouched
    assert _lora_state(s.unet) == lora_before
    assert s.networks.loaded_networks == []          # prompts were encoded without LoRAs (tags removed)

    _train(s, filename="fresh")                                              # uninterrupted, from scratch
    resumed = AdapterSet.load(webui.adapters / "trained.safetensors")
    fresh = AdapterSet.load(webui.adapters / "fresh.safetensors")
    assert resumed.state_dict().keys() == fresh.state_dict().keys() and len(resumed.sites) == 15
    for k, v in fresh.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert resumed.metadata["sdslim.train"]["data"]["source"] == "webui prompts"

    p, res = s.generate("cat", mode="On", adapter="trained.safetensors")
    assert not p.standin_script_errors and "SD Slim: " in res.infotexts[0]
    assert s.live.installed
    want = train_time_output(s.pristine, webui.adapters / "trained.safetensors", 1.0, first_noise(11), s.context)
    assert torch.allclose(p.standin_outputs[0], want, atol=1e-10, rtol=0)


def test_the_webuis_model_leaves_the_gpu_by_its_own_function_or_as_before_1_6(session, webui, monkeypatch):
    """Webui 1.6+ has ``sd_models.send_model_to_cpu``/``send_model_to_device`` (used above); on 1.5 the tab does
    what they do: the --medvram/--lowvram part off the GPU, or the whole model to the CPU and back."""
    from modules import devices, lowvram, sd_models

    class Model:
        def __init__(self, low):
            self.lowvram, self.moves = low, []

        def to(self, device):
            self.moves.append(device)
    for name in ("send_model_to_cpu", "send_model_to_device"):
        monkeypatch.delattr(sd_models, name)
    lowvram.standin_calls.clear()
    whole, parts = Model(False), Model(True)
    for m in (whole, parts):
        session.module._model_leaves_gpu(m)
        session.module._model_returns_to_gpu(m)
    assert whole.moves == [devices.cpu, devices.device] and parts.moves == []
    assert lowvram.standin_calls == ["send_everything_to_cpu"]


@dataclasses.dataclass
class Allocating(Quick):
    """Quick, with ranks allocated from measured error curves: the run has a rank allocation phase."""
    uniform: bool = False


def test_interrupt_before_the_steps_stops_there_and_says_which_phase(session, webui, monkeypatch):
    """Interrupt in calibration (sampling, then capture), rank allocation and initialisation: the run stops at the
    progress call that sees it (none after), the Report names the phase, how far it got and what a resume keeps; the
    run resumed after each ends in the adapters of an uninterrupted run."""
    monkeypatch.setattr(train_run, "TrainConfig", Allocating)
    s = session
    work = webui.models / "sdslim_work" / "phased.safetensors.work"
    for stage, words, units, kept in (
            ("calibration", "calibration", "trajectories", "the calibration starts over"),
            ("capture", "calibration", "inputs", "the calibration starts over"),
            ("rank curves", "rank allocation", "sites", "the sites already measured are kept"),
            ("init", "initialisation", "sites", "the sites already initialised are kept")):
        seen, pressed = _press_interrupt_when(monkeypatch, lambda d, t, info: info.get("stage") == stage
                                              and info.get("done", 0) >= 1)
        text, *_ = _train(s, filename="phased")
        (at, info), = pressed
        assert len(seen) == at + 1, f"{stage}: {len(seen) - at - 1} progress calls after Interrupt"
        of = f" of {info['of']}" if info["of"] else ""
        assert text.startswith(f"Interrupted during {words} ({info['done']}{of} {units} done); {kept}. "
                               f"The run is kept in {work}: press Train with the same settings"), text
        assert "step 0 of 0" not in text and work.is_dir()
    text, *_ = _train(s, filename="phased")
    assert text.startswith("adapters written to "), text
    _train(s, filename="fresh")
    resumed = AdapterSet.load(webui.adapters / "phased.safetensors")
    fresh = AdapterSet.load(webui.adapters / "fresh.safetensors")
    assert resumed.state_dict().keys() == fresh.state_dict().keys()
    for k, v in fresh.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def test_recipe_and_start_from_adapters_inputs(session, webui, monkeypatch, capsys):
    """The tab's recipe, "start from adapters" and adapter file dtype inputs: data-free needs no prompt and writes
    the weight-norm selection of the UNet without LoRAs (computed here from the pristine weights), stored fp16 by
    default or fp32 when chosen; a refit from the fp16 file keeps its sites and ranks and trains a stage 2 of the
    form's steps only, and with the quick recipe trains nothing (what quick says); the status line says it in the
    tab's words; a Start from file that is gone is refused in the Report box."""
    s = session
    canon, _, _ = layout.to_canonical({k: v.double() for k, v in s.pristine.state_dict().items()})
    from sdslim_core.layout import rank_policy
    want = AdapterSet.init_select(canon, rank_policy.ranks_for_ratio(layout.sites(canon), 0.5), "sd15")
    for name, dtype, stored in (("df32", "fp32", torch.float32), ("df", "fp16", torch.float16)):
        res = _train(s, filename=name, prompts="", recipe="data-free", adapter_dtype=dtype)
        text = res[0]
        assert "lowest fidelity" in text, text
        got = AdapterSet.load(webui.adapters / f"{name}.safetensors")
        assert all(t.dtype == stored for site in got.sites.values() for t in site.values())
        assert got.ranks() == want.ranks() and all(torch.equal(got.sites[t][k].double(), want.sites[t][k].to(stored)
                                                               .double()) for t in want.sites for k in want.sites[t])
    assert "df.safetensors" in s.module._State.choices
    assert "df.safetensors" in res[-2]["choices"] and res[-2]["choices"][0] == a1111_training.NO_START
    said = _status_lines(monkeypatch)
    text, *_ = _train(s, filename="refit", start_from="df.safetensors", steps=3)
    assert text.startswith("adapters written to"), text
    refit = AdapterSet.load(webui.adapters / "refit.safetensors")
    assert refit.ranks() == got.ranks()
    assert refit.metadata["sdslim.train"]["steps"] == {"stage1_per_site": 0, "stage2": 3}
    start = str(webui.adapters / "df.safetensors")
    assert f"starting from {start}: {len(got.sites)} sites at its ranks (no allocation)" in said, said
    assert not any("--" in t for t in said), said
    said.clear()
    text, *_ = _train(s, filename="quick_refit", recipe="quick", start_from="df.safetensors", steps=3)
    assert text.startswith("adapters written to"), text
    quick = AdapterSet.load(webui.adapters / "quick_refit.safetensors")
    assert quick.ranks() == got.ranks()
    assert quick.metadata["sdslim.train"]["steps"] == {"stage1_per_site": 0, "stage2": 0}      # nothing trained
    assert not any(t.startswith("stage ") for t in said), said
    capsys.readouterr()
    text, *_, html = _train(s, filename="x", start_from="gone.safetensors")
    assert text == (f"SD Slim training: the Start from adapters file gone.safetensors is not in {webui.adapters} any "
                    "more (renamed or deleted?); choose another one"), text
    assert "error" not in html and "Time taken" in html, html
    assert "Traceback" not in capsys.readouterr().err and not (webui.adapters / "x.safetensors").exists()
    text, *_ = _train(s, filename="x", start_from="df.safetensors", budget="600M")
    assert text.startswith("SD Slim training: Start from adapters keeps that file's sites and ranks"), text


def test_the_teacher_is_the_unet_without_loras_in_copies(session):
    s = session
    s.generate("cat <lora:a:0.8>", mode="Off")
    merged = s.unet.get_submodule(f"{FF}.net.0.proj")
    assert merged.network_current_names and not torch.equal(merged.weight, s.pristine.get_submodule(
        f"{FF}.net.0.proj").weight)
    weights, cfg = a1111_training.teacher(s.unet)
    pristine, _, _ = layout.to_canonical({k: v for k, v in s.pristine.state_dict().items()})
    assert weights.keys() == pristine.keys() and cfg.family == "sd15" and cfg.num_heads == 2
    live = {p.untyped_storage().data_ptr() for p in s.unet.parameters()} | {
        getattr(m, "network_weights_backup").untyped_storage().data_ptr() for m in s.unet.modules()
        if getattr(m, "network_weights_backup", None) is not None}
    for k, v in weights.items():
        assert torch.equal(v, pristine[k]), k
        assert v.untyped_storage().data_ptr() not in live, f"{k} shares memory with the webui's model"


def test_slim_layers_are_restored_first_and_come_back_from_the_cache(session, webui, monkeypatch, capsys):
    s = session
    write_adapters(webui.adapters, s.unet)
    s.module.refresh_adapters()
    s.generate("cat", mode="On", adapter="tiny.safetensors")
    assert s.live.installed
    seen = []

    def stop(unet):
        seen.append(s.live.installed)
        raise RuntimeError("stop here")
    monkeypatch.setattr(a1111_training, "teacher", stop)
    *_, html = _train(s)
    assert seen == [False] and "stop here" in html
    assert "original UNet restored (training)" in capsys.readouterr().err
    from sdslim_core.ops import fold
    calls, real = [], fold.fold_state_dict
    monkeypatch.setattr(fold, "fold_state_dict", lambda *a, **k: calls.append(1) or real(*a, **k))
    p, _ = s.generate("cat", mode="On", adapter="tiny.safetensors")
    assert s.live.installed and not calls and not p.standin_script_errors     # re-installed without a fold


def test_refusals_leave_everything_as_it_was(session, webui):
    s = session
    from modules import shared
    shared.state.job_count, shared.state.job = 1, "scripts_txt2img"          # an API generation is running
    text, *_ = _train(s)
    assert "another job is running (scripts_txt2img)" in text
    assert shared.state.job_count == 1 and not (webui.models / "sdslim_work").exists()
    shared.state.job_count, shared.state.job = 0, ""
    os.makedirs(webui.adapters, exist_ok=True)
    (webui.adapters / "mine.safetensors").write_bytes(b"user's file")
    text, *_ = _train(s, filename="mine")
    assert "mine.safetensors exists" in text and (webui.adapters / "mine.safetensors").read_bytes() == b"user's file"
    for bad, message in ((dict(prompts=" \n "), "at least one prompt"), (dict(ratio=1.5), "ratio"),
                         (dict(ratio="half"), "ratio must be a number"), (dict(size=100), "multiple of 64"),
                         (dict(steps=2.5), "steps"), (dict(budget="lots"), "budget"),
                         (dict(filename="../x"), "relative name"), (dict(adapter_dtype="fp8"), "adapter file dtype")):
        text, *_, html = _train(s, **bad)           # in words in the Report box, like the refusals above
        assert message in text and "Error" not in text, (bad, text)
        assert "error" not in html and "Time taken" in html, (bad, html)
    assert not (webui.models / "sdslim_work").exists()
    assert a1111_training.model_refusal(None, False, False).startswith("SD Slim training needs a loaded")
    assert "Forge" in a1111_training.model_refusal(s.sd_model, True, False)
    assert "fp8" in a1111_training.model_refusal(s.sd_model, False, True)


def test_refusals_found_during_the_run_are_one_sentence_too(session, webui, monkeypatch, capsys, tmp_path):
    """A Start from file made for another model, diffusers that does not import with the webui's torch (as
    diffusers 0.37 on torch 2.1.2): one sentence in the Report box, without Python class names; nothing in the
    webui's error box, no traceback in the console; nothing written."""
    s = session
    other = tiny_unet_of_another_width()
    write_adapters(webui.adapters, other, name="other.safetensors")
    s.module.refresh_adapters()
    capsys.readouterr()
    text, *_, html = _train(s, filename="x", start_from="other.safetensors")
    assert text.startswith(f"SD Slim training: {webui.adapters / 'other.safetensors'}: input_blocks.1.0: adapter "
                           "width 64 does not match the model's 32"), text
    fake = tmp_path / "site" / "diffusers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise AttributeError(\"module 'torch' has no attribute 'xpu'\")\n")
    for name in [m for m in sys.modules if m.split(".")[0] == "diffusers"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    text2, *_, html2 = _train(s, filename="y")
    assert text2 == (f"SD Slim training needs diffusers, which does not import with this torch {torch.__version__} "
                     "(module 'torch' has no attribute 'xpu'); restart the webui so that the extension's installer "
                     "adds a release that works with it"), text2
    for t, h in ((text, html), (text2, html2)):
        assert "Error" not in t and "error" not in h and "Time taken" in h, (t, h)
    assert "Traceback" not in capsys.readouterr().err
    assert not (webui.adapters / "x.safetensors").exists() and not (webui.adapters / "y.safetensors").exists()


def test_conditioning_is_the_webuis_padded_to_the_longest_prompt(session):
    s = session
    long_prompt = " ".join(f"w{i}" for i in range(80))                       # two 77-token chunks
    form = a1111_training.parse_form(f"a cat <lora:a:1>\n{long_prompt}", "ugly", 0.5, "", 0, 0, 0, "x")
    cfg = layout.config_from_state_dict(dict(s.unet.state_dict()))
    calib, notes = s.module._webui_calibration(s.sd_model, form, cfg, form.pixels(cfg))
    enc = s.sd_model.encoder
    assert calib.contexts.shape == (2, 154, 32) and not notes
    empty = s.sd_model.cond_stage_model_empty_prompt[0]
    assert torch.equal(calib.contexts[0], torch.cat([enc(["a cat "])[0], empty]))   # tag removed, padded
    assert torch.equal(calib.contexts[1], enc([long_prompt])[0])
    assert torch.equal(calib.uncond[0], torch.cat([enc(["ugly"])[0], empty]))
    assert calib.pooled is None and calib.prompts == ("a cat ", long_prompt)
    form = a1111_training.parse_form("a cat", "", 0.5, "", 0, 0, 0, "x")
    calib, _ = s.module._webui_calibration(s.sd_model, form, cfg, 512)
    assert torch.equal(calib.uncond[0], enc([""])[0]) and calib.uncond.abs().max() > 0   # SD1.5: not zeros


def test_sdxl_conditioning_pooled_slice_negative_and_size_embedding(webui):
    """SDXL through the webui's sd_models_xl conditioning: pooled = vector[:, :P]; an empty negative prompt is zero
    (the webui zeroes it), another one is encoded; the vector's tail is the UNet's own add_time_proj of the
    trainer's time ids (diffusers, an independent implementation); a crop setting is reported."""
    from modules import shared
    from sdslim_core.modules.unet import build_diffusers_unet
    cfg = tiny_config("sdxl", context_dim=32)
    p_dim = cfg.adm_in_channels - 6 * 256
    sd_model = FakeSdModel(tiny_unet(), sdxl=True, context_dim=32, pooled=p_dim)
    shared.sd_model = sd_model
    module = load_script()
    form = a1111_training.parse_form("a red cube\na blue ball", "", 0.5, "", 0, 256, 0, "x")
    calib, notes = module._webui_calibration(sd_model, form, cfg, 256)
    enc = sd_model.encoder
    assert not notes and calib.contexts.shape == (2, 77, 32)
    assert torch.allclose(calib.pooled, enc.pooled(["a red cube", "a blue ball"]), atol=1e-6)
    assert torch.equal(calib.uncond, torch.zeros(1, 77, 32)) and torch.equal(calib.uncond_pooled, torch.zeros(1, p_dim))
    unet = build_diffusers_unet(cfg)
    ids = sdxl_time_ids(1, 256 // 8)
    with torch.no_grad():
        want = unet.add_time_proj(ids.flatten()).reshape(1, -1)
    from modules import prompt_parser
    vector = sd_model.get_learned_conditioning(prompt_parser.SdConditioning(["a red cube"], width=256, height=256))
    assert torch.allclose(vector["vector"][:, p_dim:], want, atol=1e-5)
    assert torch.allclose(a1111_training.size_embedding(ids).float(), want, atol=1e-5)
    resolved = calib.resolved(cfg)
    assert resolved["pooled"].shape == (3, p_dim) and resolved["cfg"]
    form = a1111_training.parse_form("a red cube", "blurry", 0.5, "", 0, 256, 0, "x")
    shared.opts.set("sdxl_crop_top", 32)
    calib, notes = module._webui_calibration(sd_model, form, cfg, 256)
    assert torch.allclose(calib.uncond_pooled, enc.pooled(["blurry"]), atol=1e-6)
    assert len(notes) == 1 and "crop" in notes[0]
    with pytest.raises(ValueError, match="refiner is not supported"):
        a1111_training.calibration([], None, torch.zeros(1, 77, 1280), [], "", tiny_config("sdxl", 1280), 256)
    with pytest.raises(ValueError, match="vector of width 1600"):
        a1111_training.calibration([torch.zeros(77, 32)], torch.zeros(77, 32), torch.zeros(1, 77, 32), ["a"], "",
                                   cfg, 256)


def test_job_progress_is_a_webui_job_and_stops_on_interrupt():
    from types import SimpleNamespace
    state = SimpleNamespace(interrupted=False, job="task(1)", job_count=-1, job_no=0, sampling_step=0,
                            sampling_steps=0, textinfo=None)
    job = a1111_training.JobProgress(state)
    job(3, 10, {"stage": 1, "site": "input_blocks.1.0", "loss": 0.25})
    assert (state.job, state.job_count, state.job_no, state.sampling_step, state.sampling_steps) == \
        ("sdslim-train", 1, 0, 3, 10)
    assert state.textinfo.startswith("SD Slim: stage 1 ") and state.textinfo.endswith("step 3 of 10, loss 0.25")
    job(9, 10, {"stage": 2, "p": 0.5, "loss": 1.0})
    assert "stage 2 p=0.5, step 9 of 10" in state.textinfo
    state.interrupted = True
    with pytest.raises(a1111_training.Interrupted):
        job(10, 10, {"stage": 2})
    assert a1111_training.busy(state) is not None
    state.job_count = 0
    assert a1111_training.busy(state) is None


def test_the_tab_wires_the_webuis_progress_script():
    """The Train click's _js function exists in the extension's javascript/ and names the tab's elements."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    js = open(os.path.join(root, "javascript", "sdslim.js"), encoding="utf8").read()
    script = open(os.path.join(root, "scripts", "sdslim.py"), encoding="utf8").read()
    assert "function sdslim_start_training()" in js and '_js="sdslim_start_training"' in script
    for elem in ("sdslim_train_output", "sdslim_train_progress"):
        assert f"'{elem}'" in js and f'elem_id="{elem}"' in script
