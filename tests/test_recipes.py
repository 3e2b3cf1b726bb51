"""The recipe ladder of ``sdslim train`` (data-free, quick, full), the refit of a derivative (``--from``), and the
plan's warm-up (progress lines, RAM said up front, shrink and refusal), on the shipped tiny teacher."""
import json

import pytest
import torch

from sdslim_core import cli, tiny
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.io.tensors import load_file, save_file_atomic
from sdslim_core.modules.unet import load_diffusers_unet, open_checkpoint
from sdslim_core.ops import fingerprint
from sdslim_core.train import plan as plan_mod
from sdslim_core.train.memory import GIB, RamNeed

TINY = tiny.DEFAULT_PATH
CALIB = ["--prompt", "a red circle on a blue background", "--prompt", "a green square", "--guidance", "4",
         "--trajectories", "2", "--sample-steps", "4", "--no-vram-estimate", "--no-progress"]


def _run(capsys, *args, rc=0):
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert code == rc, err[-3000:]
    return out, err


def _unet(path):
    ckpt = open_checkpoint(path)
    return load_diffusers_unet(ckpt.weights, ckpt.config, dtype=torch.float64).eval()


def _inputs(cfg, n=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, cfg.in_channels, 8, 8, generator=g, dtype=torch.float64),
            torch.tensor([50.0, 300.0, 600.0, 900.0][:n]),
            torch.randn(n, 77, cfg.context_dim, generator=g, dtype=torch.float64))


def _rel_err(model, ref, inputs):
    with torch.no_grad():
        a, b = model(*inputs).sample, ref(*inputs).sample
    return float((a - b).norm() / b.norm())


def _derivative(path, seed=1, scale=0.02):
    """A fine-tune stand-in: the tiny teacher with every UNet matrix moved by ``scale`` of its own norm."""
    tensors, meta = load_file(TINY)
    g = torch.Generator().manual_seed(seed)
    for k, v in tensors.items():
        if k.startswith("model.diffusion_model.") and v.dim() >= 2:
            tensors[k] = v + scale * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype)
    save_file_atomic(tensors, path, meta)
    return path


def test_data_free_file_is_valid_sliceable_and_better_than_chance(tmp_path, capsys):
    out = tmp_path / "df.safetensors"
    report, _ = _run(capsys, "train", "--ckpt", TINY, "--out", out, "--recipe", "data-free", "--ratio", "0.6")
    assert "lowest fidelity" in report and not (tmp_path / "df.safetensors.work").exists()
    aset = AdapterSet.load(out)
    aset.validate()
    assert aset.metadata["sdslim.train"]["recipe"] == "data-free"
    # the base fingerprint is the teacher's: distance 0 from it, not from a derivative
    src = open_checkpoint(TINY)
    meter = fingerprint.DistanceMeter(aset.metadata["sdslim.base"])
    for site in aset.sites:
        for key in fingerprint.site_keys(site, aset.kind(site)):
            meter.add(site, key, src.weights[key])
    assert meter.result().overall < 1e-6
    slim = tmp_path / "slim.safetensors"
    _run(capsys, "slim", "--ckpt", TINY, "--adapters", out, "--out", slim)
    # fidelity: the sliced file's UNet against the teacher's (both read back from disk), next to the same ranks
    # filled with a random choice of units (what "no information" gives)
    teacher, model, inputs = _unet(TINY), _unet(slim), _inputs(src.config)
    err_df = _rel_err(model, teacher, inputs)
    from sdslim_core.ops import fold
    g = torch.Generator().manual_seed(0)
    rand = {}
    for site, t in aset.sites.items():
        width, r = aset.widths()[site], aset.rank(site)
        sel = torch.zeros(r, width)
        sel[torch.arange(r), torch.randperm(width, generator=g)[:r]] = 1
        rand[site] = {k: (sel if k.startswith("down") else sel.t().contiguous() if k == "up" else v)
                      for k, v in t.items()}
    rand_set = AdapterSet(aset.family, rand, aset.norm_groups)
    folded = fold.fold_state_dict({k: v.float() for k, v in src.weights.items()}, rand_set)
    rand_unet = load_diffusers_unet({**src.weights, **folded}, src.config, dtype=torch.float64,
                                    norm_groups=rand_set.norm_groups).eval()
    err_rand = _rel_err(rand_unet, teacher, inputs)
    assert err_df < 1.0 and err_df < err_rand, (err_df, err_rand)


def test_quick_recipe_runs_no_training_stage(tmp_path, capsys):
    from sdslim_core.train import stage1, stage2
    calls = []
    real1, real2 = stage1.run_stage1, stage2.run_stage2

    def spy1(session, *a, **k):
        calls.append(("stage1", session.tc.stage1_steps))
        return real1(session, *a, **k)
    stage1.run_stage1, stage2.run_stage2 = spy1, lambda *a, **k: calls.append("stage2")
    try:
        out, _ = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "q.safetensors", "--recipe", "quick",
                      *CALIB, "--no-plan", "--json")
    finally:
        stage1.run_stage1, stage2.run_stage2 = real1, real2
    report = json.loads(out)
    assert calls == []                              # neither stage runs
    assert report["steps"] == {"stage1_per_site": 0, "stage2": 0} and "stage2" not in report["unet_error"]
    assert report["budget"]                           # the default rank allocation ran
    assert AdapterSet.load(tmp_path / "q.safetensors").metadata["sdslim.base"]["sketches"]["tensors"]


def test_from_keeps_sites_and_ranks_never_allocates_and_fingerprints_the_derivative(tmp_path, capsys, monkeypatch):
    base = tmp_path / "base.safetensors"
    _run(capsys, "train", "--ckpt", TINY, "--out", base, "--recipe", "quick", "--ratio", "0.7", *CALIB, "--no-plan")
    deriv = _derivative(tmp_path / "derivative.safetensors")
    from sdslim_core.train import ranks as ranks_mod, sensitivity
    monkeypatch.setattr(ranks_mod, "allocate", lambda *a, **k: pytest.fail("--from ran the rank allocation"))
    monkeypatch.setattr(sensitivity, "e2e_error", lambda *a, **k: pytest.fail("--from measured rank curves"))
    out = tmp_path / "refit.safetensors"
    report, _ = _run(capsys, "train", "--ckpt", deriv, "--out", out, "--from", base, *CALIB, "--stage2-steps", "4",
                     "--no-plan", "--json")
    report = json.loads(report)
    a, b = AdapterSet.load(out), AdapterSet.load(base)
    assert a.ranks() == b.ranks() and a.norm_groups == b.norm_groups
    assert report["steps"] == {"stage1_per_site": 0, "stage2": 4}
    for row in report["init_table"]:          # the base adapter was measured next to the re-initialisations
        assert "base" in row["errors"] and row["errors"][row["chosen"]] <= row["errors"]["base"]
    # the new file belongs to the derivative: its fingerprint is the derivative's, not the base model's
    for model, far in ((deriv, False), (TINY, True)):
        src = open_checkpoint(model)
        meter = fingerprint.DistanceMeter(a.metadata["sdslim.base"])
        for site in a.sites:
            for key in fingerprint.site_keys(site, a.kind(site)):
                meter.add(site, key, src.weights[key])
        assert (meter.result().overall > 1e-3) == far
    _, err = _run(capsys, "train", "--ckpt", deriv, "--out", tmp_path / "other.safetensors", "--from", base,
                  "--ratio", "0.5", *CALIB, rc=2)
    assert "--from keeps the ranks" in err and "--ratio" in err


def test_plan_only_prices_the_ladder_with_warm_up_progress_lines(tmp_path, capsys):
    _, err = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", *CALIB[:-1], "--plan-only")
    header = next(line for line in err.splitlines() if "data-free" in line and "quick" in line)
    assert header.split() == ["data-free", "quick", "full"]
    assert "warm-up: a teacher forward at batch 8" in err and "free" in err       # the RAM said up front
    lines = [line for line in err.splitlines() if line.startswith("warm-up: ") and " parts [" in line]
    assert len(lines) >= 3 and "100%" in lines[-1] and "\r" not in err           # plain lines, no tty
    default_calib = [a for a in CALIB if a not in ("--trajectories", "2")]
    out, _ = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", *default_calib,
                  "--plan-only", "--json")
    ladder = json.loads(out)
    quick, full = ladder["recipes"]["quick"], ladder["recipes"]["full"]
    assert [p["name"] for p in quick["phases"]] == ["calibration", "capture", "rank curves", "init"]
    assert full["phases"][-1]["name"] == "stage 2" and quick["eta_s"] < full["eta_s"]
    assert quick["phases"][0]["units"] == 8 and full["phases"][0]["units"] == 16      # the light calibration
    assert ladder["data-free"].keys() == {"seconds", "ram_bytes"} and ladder["data-free"]["ram_bytes"] > 0
    assert quick["ram_bytes"] > 0          # (their times side by side: bench/RESULTS.md, Recipes)
    assert sorted(p.name for p in tmp_path.iterdir()) == []                       # nothing written


def test_plan_only_fit_gib_names_the_groups_or_the_device_the_run_needs(tmp_path, capsys):
    """--fit-gib through the CLI with the real estimator on the tiny model: a card it fits is named with its
    stage-2 groups (here with the teacher offloaded, as asked); one far too small gets the phase that is over and
    the device size the run needs (the largest of its phases' peaks at the groups with the lowest stage-2 peak).
    (With --offload-teacher auto the check adds the offloaded placement where nothing fits: test_train_modules.)"""
    _, err = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", *CALIB, "--plan-only",
                  "--fit-gib", "8", "--context-gib", "0.5", "--offload-teacher", "on")
    assert "fits 8 GiB with --offload-teacher on and --stage2-groups 1;" in err and "teacher offloaded, " in err
    out, err = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", *CALIB, "--plan-only",
                    "--fit-gib", "0.01", "--context-gib", "0.5", "--offload-teacher", "off", "--json")
    fit = json.loads(out)["device_fit"]
    assert fit["groups"] is None and fit["needs_gib"] > 0.5 and "does not fit 0.01 GiB" in fit["text"]
    assert f"it needs a device of {fit['needs_gib']:.1f} GiB, with --stage2-groups {fit['needs_groups']}" in fit["text"]
    by_groups = fit["stage2_gib_by_groups"]
    assert fit["needs_gib"] == max(fit["calibration_gib"], fit["stage1_gib"], by_groups[str(fit["needs_groups"])])
    assert by_groups[str(fit["needs_groups"])] == min(by_groups.values()) and "offloaded" not in fit


def test_plan_shrinks_or_refuses_when_the_ram_is_short(tmp_path, capsys, monkeypatch):
    need = RamNeed(teacher=GIB, step_per_input=2 * GIB, forward=GIB // 2, adapters=0)
    monkeypatch.setattr(plan_mod, "ram_need", lambda session, adapter_params: need)
    monkeypatch.setattr(plan_mod, "available_ram", lambda: 3 * GIB)       # 2 inputs need 4 GiB, 1 needs 2
    out, err = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", *CALIB, "--plan-only",
                    "--json")
    assert "measured at 1 input" in err
    assert json.loads(out)["recipes"]["full"]["warmup"]["stage2_inputs_measured"] == 1
    monkeypatch.setattr(plan_mod, "available_ram", lambda: GIB)           # a forward fits, a step does not
    out, err = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", *CALIB, "--plan-only",
                    "--json")
    assert "stage 2 is left unpriced" in err
    ladder = json.loads(out)
    assert ladder["recipes"]["full"]["eta_s"] is None and ladder["recipes"]["quick"]["eta_s"] > 0
    monkeypatch.setattr(plan_mod, "available_ram", lambda: GIB // 4)      # not even a forward
    _, err = _run(capsys, "train", "--ckpt", TINY, "--out", tmp_path / "a.safetensors", *CALIB, "--plan-only",
                  rc=2)
    assert "error: the plan's warm-up needs ~512.0 MiB of free RAM" in err and "256.0 MiB is free" in err


def test_ram_estimate_scales_the_saved_activations_of_a_real_backward():
    """The count at the small probe latent, scaled, against the bytes autograd really keeps at twice that latent
    (independent: its own forward with a saved-tensors hook, the graph alive while counted)."""
    from sdslim_core.train.calibration import unet_call
    from sdslim_core.train.memory import PROBE_LATENT, saved_per_input
    ckpt = open_checkpoint(TINY)
    unet = load_diffusers_unet(ckpt.weights, ckpt.config, dtype=torch.float32).requires_grad_(False)
    size = 2 * PROBE_LATENT
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randn(1, 4, size, size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unet_call(unet, {"sample": x, "timestep": torch.tensor([500.0]),
                               "encoder_hidden_states": torch.randn(1, 77, ckpt.config.context_dim)})
    assert out.requires_grad
    weights = sum(p.untyped_storage().nbytes() for p in unet.parameters()
                  if p.untyped_storage().data_ptr() in saved)
    real = sum(saved.values()) - weights
    estimate, largest = saved_per_input(unet, ckpt.config, size)
    assert 0.9 < estimate / real < 1.2, (estimate, real)


def test_every_front_end_offers_the_recipes_the_trainer_knows(monkeypatch):
    """The CLI's --recipe and the ComfyUI node's combo (both kept torch-free) list recipes.CHOICES."""
    import importlib.util
    import os
    import sys

    from sdslim_core.train import recipes
    train_parser = cli.build_parser()._subparsers._group_actions[0].choices["train"]
    recipe, = (a for a in train_parser._actions if a.dest == "recipe")
    assert tuple(recipe.choices) == recipes.RECIPES and recipe.default == recipes.DEFAULT_RECIPE
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nodes", "specs.py")
    spec = importlib.util.spec_from_file_location("sdslim_node_specs", path)
    specs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, specs)          # dataclasses look their module up
    spec.loader.exec_module(specs)
    assert specs.RECIPES == recipes.CHOICES


def test_the_warm_up_times_a_gpu_step_after_its_first_call(monkeypatch):
    """The first GPU run priced SD1.5's stage-2 step at 12.6 s and a batch-8 forward at 4.5 s on an H200: both were
    the first call, which loads kernels and picks algorithms. On a GPU the second call is the one timed; on the CPU a
    slow first call is the measure (a fake clock: no wall time is compared)."""
    clock = [0.0]
    monkeypatch.setattr(plan_mod.time, "perf_counter", lambda: clock[0])
    durations = iter([30.0, 0.2] * 2)

    def step():
        clock[0] += next(durations)
    assert plan_mod._timed(step, torch.device("cuda")) == pytest.approx(0.2)
    assert plan_mod._timed(step, torch.device("cpu")) == pytest.approx(30.0)
