"""`sdslim ui` without a browser: path confinement, the planner's CLI arguments, slim errors, the helpers it adds."""
import functools
import json
import os
import threading

import pytest

from conftest import HANG_GUARD_S
from sdslim_core import cli, layout
from sdslim_core.ui import actions
from sdslim_core.ui.paths import PathNotAllowed, Roots
from sdslim_core.vram.estimate import BREAKDOWN_GROUPS, grouped_breakdown
from sdslim_core.vram.fit import CurveFit, largest_batch
from sdslim_core.vram.settings import Settings

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sdslim_core", "tiny",
                      "assets")


@pytest.fixture
def tree(tmp_path):
    """root/ (a.safetensors, sub/b.safetensors, .hidden/c.safetensors, links in and out), outside/secret.safetensors"""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    outside.mkdir()
    for p in (root / "a.safetensors", root / "sub" / "b.safetensors", root / ".hidden" / "c.safetensors",
              outside / "secret.safetensors"):
        p.write_bytes(b"x")
    (root / "to_secret.safetensors").symlink_to(outside / "secret.safetensors")
    (root / "to_outside").symlink_to(outside, target_is_directory=True)
    (root / "to_a.safetensors").symlink_to(root / "a.safetensors")
    return root, outside


def test_paths_resolve_inside_only(tree):
    root, outside = tree
    roots = Roots([root])
    assert roots.resolve("a.safetensors") == str(root / "a.safetensors")
    assert roots.resolve(str(root / "sub" / "b.safetensors")) == str(root / "sub" / "b.safetensors")
    assert roots.resolve("sub/../a.safetensors") == str(root / "a.safetensors")
    assert roots.resolve("to_a.safetensors") == str(root / "a.safetensors")     # a link inside stays inside
    for escape in ("../outside/secret.safetensors", str(outside / "secret.safetensors"), "to_secret.safetensors",
                   "to_outside/secret.safetensors", str(root / "sub" / ".." / ".." / "outside"), "/etc/passwd"):
        with pytest.raises(PathNotAllowed, match="outside the folders"):
            roots.resolve(escape)
    with pytest.raises(FileNotFoundError):
        roots.resolve("missing.safetensors")
    with pytest.raises(ValueError, match="no checkpoint chosen"):
        roots.resolve("  ", "checkpoint")


def test_paths_relative_to_each_root_and_listing(tree, tmp_path):
    root, outside = tree
    other = tmp_path / "other"
    other.mkdir()
    (other / "z.safetensors").write_bytes(b"x")
    roots = Roots([root, other, root])
    assert roots.folders == (str(root), str(other))
    assert roots.resolve("z.safetensors") == str(other / "z.safetensors")
    listed = dict((v, k) for k, v in roots.files())
    assert set(listed) == {str(root / "a.safetensors"), str(root / "sub" / "b.safetensors"),
                           str(other / "z.safetensors")}   # no hidden folder, no link leading outside
    assert listed[str(other / "z.safetensors")] == "other/z.safetensors"
    with pytest.raises(FileNotFoundError, match="--root"):
        Roots([tmp_path / "nope"])


def test_paths_output_is_a_new_plain_file(tree):
    root, outside = tree
    roots = Roots([root])
    assert roots.output(root, "new.safetensors") == str(root / "new.safetensors")
    assert roots.output(root / "sub", "new.safetensors") == str(root / "sub" / "new.safetensors")
    (root / "dangling.safetensors").symlink_to(outside / "gone.safetensors")
    bad = {"../x.safetensors": "plain file name", "sub/x.safetensors": "plain file name",
           ".x.safetensors": "plain file name", "x.ckpt": "suffix", "a.safetensors": "exists",
           "dangling.safetensors": "exists", "": "no output file name"}
    for name, message in bad.items():
        with pytest.raises(ValueError, match=message):
            roots.output(root, name)
    for folder in (outside, root / "to_outside"):
        with pytest.raises(PathNotAllowed, match="outside the folders"):
            roots.output(folder, "x.safetensors")
    assert not (outside / "x.safetensors").exists()


def test_planner_argv_is_the_cli_setting(tree):
    """The form becomes CLI arguments; the CLI's own parser turns them into the Settings the form describes."""
    from sdslim_core.cli.vram import settings_from_args
    roots = Roots([ASSETS])

    def settings(form):
        return settings_from_args(actions.parse_estimate_argv(actions.estimate_argv(form, roots)))

    lora = actions.PlanForm(task="LoRA", arch="sdxl", resolution=1024, lora_rank=32, lora_kind="lora-fa",
                            optimizer="adamw8bit", grad_ckpt=True, resident_te_vae=True, slim_ratio=0.5,
                            attention="xformers", precision="full-bf16")
    assert settings(lora) == Settings(arch="sdxl", resolution=1024, precision="full-bf16", optimizer="adamw8bit",
                                      grad_ckpt=True, attention="xformers", lora_rank=32, lora_kind="lora-fa",
                                      resident_te_vae=True, slim_ratio=0.5)
    ft = actions.PlanForm(task="full fine-tune", resolution=512, lora_rank=16)
    assert settings(ft) == Settings(arch="sd15", resolution=512)        # the rank only counts for LoRA
    sampling = actions.PlanForm(task="sampling", optimizer="adamw8bit", grad_ckpt=True, slim_ratio=0.25)
    assert settings(sampling) == Settings(resolution=768, sampling=True, slim_ratio=0.25)
    ckpt = actions.PlanForm(source="checkpoint", ckpt="tiny_sd15.safetensors", resolution=64)
    argv = actions.estimate_argv(ckpt, roots)
    assert argv[:4] == ["vram", "estimate", "--ckpt", os.path.join(os.path.realpath(ASSETS), "tiny_sd15.safetensors")]
    s = settings(ckpt)
    assert s.unet_config["block_out_channels"] != Settings().to_dict().get("block_out_channels")
    assert actions.command_line(argv).startswith("sdslim vram estimate --ckpt ")
    assert actions.parse_estimate_argv(argv).batch_sizes == "1,2,4,8"
    for bad in (dict(precision="fp8"), dict(task="dream"), dict(arch="sd3"), dict(task="LoRA", lora_rank=0),
                dict(batch_sizes="1,x")):
        with pytest.raises(ValueError):
            actions.estimate_argv(actions.PlanForm(**bad), roots)
    with pytest.raises(PathNotAllowed):
        actions.estimate_argv(actions.PlanForm(source="checkpoint", ckpt=str(tree[1] / "secret.safetensors")), roots)


def test_grouped_breakdown_and_largest_batch():
    cats = {"param": 1.0, "frozen": 2.0, "te_vae": 0.5, "grad": 1.0, "opt_state": 2.0, "act": 3.0, "data": 0.25,
            "bwd_tmp": 0.5, "opt_tmp": 0.125, "something_new": 0.0625}
    g = grouped_breakdown(cats)
    assert list(g) == list(BREAKDOWN_GROUPS)
    assert g == {"weights": 3.5, "gradients": 1.0, "optimizer state": 2.0, "activations": 3.25,
                 "workspace": 0.6875}
    assert sum(g.values()) == sum(cats.values())
    assert grouped_breakdown({}) == dict.fromkeys(BREAKDOWN_GROUPS, 0.0)
    fit = CurveFit(intercept_gib=4.0, slope_gib=1.5, plateau_gib=6.0, kink_batch=None, max_residual_gib=0)
    # predict(B) = max(6, 4 + 1.5 B): B=4 -> 10, B=5 -> 11.5
    assert largest_batch(fit, 10.0) == 4 and largest_batch(fit, 11.49) == 4 and largest_batch(fit, 11.5) == 5
    assert largest_batch(fit, 5.9) == 0                    # the optimizer-step plateau does not fit
    flat = CurveFit(4.0, 0.0, 0.0, 0.0, 0)
    assert largest_batch(flat, 5.0) is None and largest_batch(flat, 3.0) == 0


def test_planner_cancel_stops_the_job():
    planner = actions.Planner()
    roots = Roots([ASSETS])
    argv = actions.estimate_argv(actions.PlanForm(source="checkpoint", ckpt="tiny_sd15.safetensors",
                                                  resolution=64, batch_sizes="1,2,3"), roots)
    job = planner.start("session-a", argv)
    assert job.total_points == 3
    assert planner.cancel("session-a")
    assert job.done.wait(HANG_GUARD_S) and job.error == "cancelled" and job.result is None
    assert not planner.cancel("session-a") and planner.cached(argv) is None


@pytest.fixture(scope="module")
def slim_files(tmp_path_factory):
    import torch
    from sdslim_core.io.tensors import save_file_atomic
    from test_slim_roundtrip import canonical_weights, random_adapters, write_ldm_checkpoint
    d = tmp_path_factory.mktemp("ui_slim")
    w = canonical_weights(seed=2, dtype=torch.float32)
    write_ldm_checkpoint(d / "model.safetensors", w)
    random_adapters(w).save(d / "adapters.safetensors", dtype=torch.float32)
    (d / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    save_file_atomic({"x": torch.zeros(1)}, d / "out" / "keep.safetensors")
    return d


def test_slim_errors_are_the_cli_messages_and_write_nothing(slim_files, capsys, tmp_path):
    d = slim_files
    roots = Roots([d])
    before = sorted(p.name for p in d.rglob("*"))
    cases = [("model.safetensors", "broken.safetensors", []),
             ("model.safetensors", "adapters.safetensors", [("broken.safetensors", 0.5)])]
    for ckpt, adapters, loras in cases:
        with pytest.raises(ValueError) as info:
            actions.run_slim(roots, ckpt, adapters, loras, 1.0, str(d / "out"), "new.safetensors")
        shown = actions.user_error("slim", info.value)
        argv = ["slim", "--ckpt", str(d / ckpt), "--adapters", str(d / adapters),
                "--out", str(d / "out" / "new.safetensors")]
        argv += [a for p, s in loras for a in ("--lora", f"{d / p}:{s}")]
        assert cli.main(argv) == 2
        assert capsys.readouterr().err.strip() == shown
    for outside in ((str(tmp_path), "new.safetensors"), (str(d / "out"), "../new.safetensors"),
                    (str(d / "out"), "keep.safetensors")):
        with pytest.raises(PathNotAllowed):
            actions.run_slim(roots, "model.safetensors", "adapters.safetensors", [], 1.0, *outside)
    with pytest.raises(PathNotAllowed):
        actions.run_slim(roots, str(tmp_path / ".." / "x.safetensors"), "adapters.safetensors", [], 1.0,
                         str(d / "out"), "new.safetensors")
    assert sorted(p.name for p in d.rglob("*")) == before and not list(tmp_path.iterdir())


def test_slim_and_breakdown_actions_match_the_cli(slim_files, capsys):
    from sdslim_core.io.tensors import load_file
    d = slim_files
    roots = Roots([d])
    seen = []
    text, info = actions.run_slim(roots, "model.safetensors", "adapters.safetensors", [], 1.0, str(d / "out"),
                                  "ui.safetensors", progress=lambda i, n, site: seen.append((i, n)))
    assert seen[-1] == (info["sites"], info["sites"]) and f"wrote {d / 'out' / 'ui.safetensors'}" in text
    assert cli.main(["slim", "--ckpt", str(d / "model.safetensors"), "--adapters", str(d / "adapters.safetensors"),
                     "--out", str(d / "cli.safetensors")]) == 0
    capsys.readouterr()
    ui_t, ui_meta = load_file(d / "out" / "ui.safetensors")
    cli_t, cli_meta = load_file(d / "cli.safetensors")
    assert ui_t.keys() == cli_t.keys() and all((ui_t[k] == cli_t[k]).all() for k in ui_t) and ui_meta == cli_meta

    result, table, fig = actions.breakdown_view(roots, "checkpoint", "", "model.safetensors", "exact", 0.5)
    assert cli.main(["breakdown", "--ckpt", str(d / "model.safetensors"), "--ratio", "0.5", "--json"]) == 0
    assert result == json.loads(capsys.readouterr().out)
    assert f"| Total | {result['total']:,} | 100.0% | {result['slim']['total']:,} |" in table
    assert len(fig.axes[0].patches) == 12    # 6 components, original and slim


def test_worker_cancel_stops_the_process():
    """A cancel stops the estimate worker instead of waiting for it: the run ends before its four points are measured
    (each takes seconds; its progress lines are checked in test_vram_estimate)."""
    from sdslim_core.vram.estimate import EstimateCancelled, run_worker
    from test_vram_estimate import ENV, tiny
    cancel, points = threading.Event(), []
    threading.Timer(0.5, cancel.set).start()
    with pytest.raises(EstimateCancelled):
        run_worker([("b", tiny(precision="fp32"), (1, 2, 3, 4))], env=ENV, cancel=cancel, timeout=HANG_GUARD_S,
                   on_progress=lambda line: points.append(line) if " peak " in line else None)
    assert len(points) < 4, points


def test_ui_command_without_gradio_says_how_to_install(monkeypatch, capsys, tmp_path):
    import builtins
    real_import = builtins.__import__

    def no_gradio(name, *a, **kw):
        if name == "gradio" or name.startswith("gradio."):
            raise ModuleNotFoundError("No module named 'gradio'", name="gradio")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_gradio)
    assert cli.main(["ui", "--root", str(tmp_path)]) == 2
    assert "pip install 'sdslim[ui]'" in capsys.readouterr().err


def test_gpu_memory_from_the_live_report(monkeypatch):
    from sdslim_core.vram import live
    rep = live.MemoryReport("cuda:0", "NVIDIA Test 12GB", "nvml", total_bytes=12 * 2 ** 30)
    monkeypatch.setattr(actions, "memory_report", lambda device=None: rep)
    assert actions.gpu_memory() == (12.0, "NVIDIA Test 12GB: 12.0 GiB (live, nvml)")
    cpu = live.MemoryReport("cpu", "CPU", "psutil", total_bytes=2 ** 34)
    monkeypatch.setattr(actions, "memory_report", lambda device=None: cpu)
    gib, note = actions.gpu_memory()
    assert gib is None and "no CUDA GPU" in note


def test_figure_curves_draws_the_gpu_line(tmp_path):
    from sdslim_core.vram.plots import figure_curves, plot_curves
    curves = [{"name": "original", "points": [{"batch": 1, "peak_gib": 4.0}, {"batch": 2, "peak_gib": 7.0}]},
              {"name": "slim 0.5", "points": [{"batch": 1, "peak_gib": 3.0}, {"batch": 2, "peak_gib": 5.5}]}]
    fig = figure_curves(curves, "t", limit=(6.0, "GPU memory 6 GiB"))
    (ax,) = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["original"].get_ydata()) == [4.0, 7.0] and list(lines["slim 0.5"].get_xdata()) == [1, 2]
    assert list(lines["GPU memory 6 GiB"].get_ydata()) == [6.0, 6.0]
    path = plot_curves([dict(c, group="lora") for c in curves], tmp_path / "p.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_encodes_prompt_and_negative_with_the_checkpoints_text_encoders(tmp_path, monkeypatch):
    """The Compare tab on a checkpoint that carries its text encoder: the same numbers as `sdslim eval --prompt
    … --negative …`."""
    from sdslim_core.apps.evaluate import evaluate
    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.modules.unet import open_checkpoint
    from sdslim_core.text import tokenizer
    from text_fixtures import write_checkpoint
    vocab = tokenizer.vocabulary_from_bpe(tokenizer._open_clip_bpe(), tmp_path / "vocab")
    monkeypatch.setenv("SDSLIM_TOKENIZER", str(vocab))
    ckpt = write_checkpoint(tmp_path / "m.safetensors", "sd15", seed=1)
    weights = dict(open_checkpoint(ckpt).weights.items())
    AdapterSet.init_select(weights, {s.name: s.width // 2 for s in layout.sites(weights)}, "sd15").save(
        tmp_path / "a.safetensors")
    roots = Roots([tmp_path])
    monkeypatch.setattr(actions, "evaluate", functools.partial(evaluate, latent_size=16))   # a quick latent size
    _, table, text, result = actions.run_compare(roots, "m.safetensors", "a.safetensors", [], 1, 2,
                                                 prompt="a photo of a cat", negative="blurry")
    assert "prompt 'a photo of a cat', negative 'blurry'" in result["conditioning"] and "negative 'blurry'" in table
    want = evaluate(ckpt, tmp_path / "a.safetensors", seeds=1, steps=2, prompt="a photo of a cat", negative="blurry",
                    latent_size=16)
    assert result["eps_rel_error"]["overall"] == pytest.approx(want["eps_rel_error"]["overall"], rel=1e-6)
    other = evaluate(ckpt, tmp_path / "a.safetensors", seeds=1, steps=2, prompt="a photo of a cat", latent_size=16)
    assert other["eps_rel_error"]["overall"] != pytest.approx(want["eps_rel_error"]["overall"], rel=1e-6)
