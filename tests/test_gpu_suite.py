"""The GPU suite (bench/gpu_suite.py) cannot rot between GPU days: its dry run (the same code on the CPU, tiny
UNets) passes every part, writes strict JSON and the markdown, and its numbers agree with independent counts;
a part that raises, dies or hangs is recorded as such and the suite goes on; ``--parts failed`` reruns only what
did not end ok; without a GPU it says so. No assertion is made on time (the caps are hang guards).

The dry run and the fault run are started together (the fault run mostly sleeps through its time caps)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdslim_core import layout
from sdslim_core.layout import rank_policy
from sdslim_core.modules.unet import canonical_shapes
from sdslim_core.ops import fold

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "bench" / "gpu_suite.py"
sys.path.insert(0, str(ROOT / "bench"))
import gpu_parts  # noqa: E402
import gpu_report  # noqa: E402
import gpu_suite  # noqa: E402
import gpu_vram  # noqa: E402
from sdslim_core.io import gguf  # noqa: E402

GIB = 2 ** 30
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", MKL_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
FAULTS = "environment=raise,trainer_sd15=die,profile=hang"


def _start(out: Path, *args, env=ENV):
    return subprocess.Popen([sys.executable, str(SUITE), "--out", str(out), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _load(out: Path) -> dict:
    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name} in results.json")
    return json.loads((out / "results.json").read_text(), parse_constant=no_constants)


# hang guards only (a busy box may take several minutes): no assertion is made on the time itself
HANG_GUARD_S = 1800


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dry, faulty = tmp_path_factory.mktemp("dry"), tmp_path_factory.mktemp("faults")
    procs = {"dry": _start(dry, "--dry-run"),
             "faults": _start(faulty, "--dry-run", "--parts", "environment,trainer_sd15,profile,trainer_sdxl",
                              "--budget", "12", env=dict(ENV, SDSLIM_GPU_SUITE_FAULT=FAULTS))}
    out = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=HANG_GUARD_S)
        out[name] = {"rc": proc.returncode, "stdout": stdout, "out": dry if name == "dry" else faulty}
    return out


@pytest.fixture(scope="module")
def dry(runs):
    run = runs["dry"]
    assert run["rc"] == 0, run["stdout"][-4000:]
    return _load(run["out"]), (run["out"] / "results.md").read_text(), run["stdout"]


def _numbers(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj
    elif isinstance(obj, str) and obj in ("nan", "inf", "-inf"):
        yield path, float(obj)


def test_dry_run_every_part_ok_numbers_finite_markdown_written(dry):
    results, md, stdout = dry
    expected = [p.name for p in gpu_suite.PLAN if not p.optional]
    assert results["mode"] == "dry-run" and results["finished"]
    assert [p["name"] for p in results["plan"]] == expected
    assert {n: r["status"] for n, r in results["parts"].items()} == dict.fromkeys(expected, "ok")
    bad = [(p, v) for p, v in _numbers(results) if not math.isfinite(v)]
    assert not bad, bad
    assert stdout.index("total budget") < stdout.index("environment: ok")          # the plan comes first
    assert md in stdout and md.startswith("# sdslim GPU suite")                   # the markdown is printed
    for heading in ("## Environment", "## Training VRAM", "## Trainer on CUDA", "## Speed", "## Sampling VRAM",
                    "**Where the time goes**"):
        assert heading in md
    assert "## Problems" not in md and "not rendered" not in md
    assert results["parts"]["environment"]["result"]["torch"] == torch.__version__


def test_gpu_plan_fits_the_device_call():
    """The GPU plan's caps: the total budget leaves a device call of 8 minutes its start-up time, and every
    foreground part's reserve fits in it."""
    assert gpu_suite.BUDGET_S <= 390
    assert sum(p.reserve_s for p in gpu_suite.PLAN if not p.background and not p.optional) <= gpu_suite.BUDGET_S


def test_parts_that_read_the_whole_device_start_a_fresh_runner(dry):
    """NVML reads the whole device: ``fresh`` parts (the seed study, sampling VRAM) start a new runner process, so
    their readings hold nothing that earlier parts left on the GPU (the second H200 run's sampling rows carried
    0.65-0.74 GiB of it); the other foreground parts share the runner before them."""
    results, _, _ = dry
    assert {p.name for p in gpu_suite.PLAN if p.fresh} == {"seed_study", "sampling_vram"}
    order = [p.name for p in gpu_suite.PLAN if not p.background and p.name in results["parts"]]
    pid = {n: results["parts"][n]["runner_pid"] for n in order}
    for before, part in zip(order, order[1:]):
        assert (pid[part] != pid[before]) == gpu_suite.PARTS[part].fresh, (before, part, pid)


def test_dry_run_seed_study_measured_next_to_estimate(dry):
    results, _, _ = dry
    study = {c["name"]: c for c in results["parts"]["seed_study"]["result"]["curves"]}
    estimate = {c["name"]: c for c in results["parts"]["vram_estimate"]["result"]["curves"]}
    names = set(gpu_vram.DRY_SEED)
    assert set(study) == names and set(estimate) >= names - {"adamw8bit"}
    assert not study["adamw8bit"]["points"] and "bitsandbytes" in study["adamw8bit"]["notes"][0]
    rows = {(r["name"], r["batch"]): r for r in gpu_report.vram_rows(results)}
    assert (("base", 2) in rows) and (("lora16", 2) in rows)
    # a real CPU step counted by LiveTracker vs the estimate on fake tensors: weights, gradients and AdamW states
    # dominate tiny models, so the two must agree closely where no LoRA is involved
    for name in ("base", "grad_ckpt", "sdxl_base"):
        assert abs(rows[(name, 1)]["err_allocated"]) < 0.05, rows[(name, 1)]
    # independent count: fp32 weights + grads + 2 AdamW states = 16 B/param for the full fine-tune
    params = sum(math.prod(s) for s in canonical_shapes(gpu_parts.tiny_config("sd15")).values())
    assert rows[("base", 1)]["allocated"] * GIB >= 16 * params
    # the allocator model holds at least the live bytes, in whole 2 MiB segments (the small pool's size)
    for c in estimate.values():
        for p in c["points"]:
            assert p["reserved_gib"] >= p["peak_gib"] and (p["reserved_gib"] * GIB) % (2 << 20) == 0


def _slim_params(cfg, ratio=None, ranks=None):
    shapes = canonical_shapes(cfg)
    ranks = ranks or rank_policy.ranks_for_ratio(layout.sites(shapes), ratio)
    return sum(math.prod(s) for s in fold.slim_shapes(shapes, ranks).values())


def test_the_untiled_rank_probe_differs_from_the_policy_only_at_320_wide_resblocks():
    """The speed part's ``slim 5/16 groups only`` row measures what a rank that misses the tensor-core tile costs: on
    SD1.5 it must equal ``slim 5/16`` everywhere but the 320-wide ResBlocks (100 channels there, 80 by the policy)."""
    import gpu_speed
    cfg = layout.config_for_arch("sd15")
    probe = gpu_speed.whole_group_ranks(cfg, 5 / 16)
    tiled = rank_policy.ranks_for_ratio(layout.sites(canonical_shapes(cfg)), 5 / 16)
    widths = {s.name: (s.kind, s.width) for s in layout.sites(canonical_shapes(cfg))}
    differ = {n for n in tiled if probe[n] != tiled[n]}
    assert differ and {widths[n] for n in differ} == {("res", 320)}
    assert {probe[n] for n in differ} == {100} and {tiled[n] for n in differ} == {80}


def test_dry_run_speed_weights_and_flops_match_independent_counts(dry):
    results, _, _ = dry
    ranks = results["parts"]["trainer_sd15"]["result"]["ranks"]
    for family, n_shapes in (("sd15", 3), ("sdxl", 1)):
        res = results["parts"][f"speed_{family}"]["result"]
        cfg = gpu_parts.tiny_config(family)
        assert len(res["shapes"]) == n_shapes
        expected = {"original": sum(math.prod(s) for s in canonical_shapes(cfg).values()),
                    **{f"slim {r}": _slim_params(cfg, r) for r in (0.75, 0.5, 0.25)}}
        if family == "sd15":
            expected["slim allocated"] = _slim_params(cfg, ranks=ranks)
            expected["slim 5/16"] = _slim_params(cfg, 5 / 16)
        for name, n in expected.items():
            assert res["weight_gib"][name] * GIB == 2 * n, name                    # fp16
        assert 0.5 < res["weight_gib"]["original fp8"] / res["weight_gib"]["original"] < 0.75
        flops = res["flops"]
        assert flops["original"] > flops["slim 0.75"] > flops["slim 0.5"] > flops["slim 0.25"] > 0
        assert flops["original channels_last"] == flops["original"] == flops["original fp8"]
        for shape in res["shapes"].values():
            models = shape["models"]
            assert models["original"]["graph_speedup"] == models["original"]["eager_speedup"] == 1.0
            assert models["slim 0.5"]["ideal_speedup"] == flops["original"] / flops["slim 0.5"]
        assert all(0 < e < 0.2 for e in res["fp8_rel_err"].values())
    prof = results["parts"]["profile"]["result"]["models"]
    for name, rec in prof.items():
        assert rec["ms"]["site"].get("GEMM/conv", 0) > 0 and rec["ms"]["other"].get("attention", 0) > 0, name


def test_the_trainer_part_limits_a_run_that_does_not_fit_8gb_to_the_device_the_check_names():
    """8 GiB with the check's groups; where only the offloaded teacher fits, 8 GiB with it offloaded (SDXL); where
    neither does, the device the check names with the teacher on it."""
    import gpu_trainer
    assert gpu_trainer.run_device({"groups": 2, "needs_gib": 7.1, "needs_groups": 1}, "sd15") == (8.0, 2, False)
    off = {"groups": 6, "needs_gib": 6.9, "needs_groups": 3}
    assert gpu_trainer.run_device({"groups": None, "needs_gib": 10.91, "needs_groups": 8, "offloaded": off},
                                  "sdxl") == (8.0, 6, True)
    off = {"groups": None, "needs_gib": 8.3, "needs_groups": 8}
    assert gpu_trainer.run_device({"groups": None, "needs_gib": 10.91, "needs_groups": 8, "offloaded": off},
                                  "sdxl") == (12.0, 8, False)
    assert gpu_trainer.run_device({"error": "x"}, "sdxl") == (8.0, 3, False)


def test_the_offload_cost_times_both_placements_of_one_session(tmp_path, monkeypatch):
    """trainer_sd15's offload_cost (CUDA only in the suite) on the emulated device: a forward and a stage-2 step
    timed with the teacher on the device and offloaded (the teacher's weights on the CPU during the second), the
    session's teacher on the device again afterwards (the part's run does not inherit the offloading)."""
    import gpu_trainer
    from emulated_device import on
    from sdslim_core import tiny
    from sdslim_core.modules.unet import open_checkpoint
    from sdslim_core.train import Calibration, TrainConfig
    from sdslim_core.train.session import Session
    from sdslim_core.train.teacher import teacher_weights
    ckpt = open_checkpoint(tiny.DEFAULT_PATH)
    weights, cfg = teacher_weights(ckpt, ckpt.config)
    calib = Calibration.from_contexts(torch.randn(2, 5, cfg.context_dim, generator=torch.Generator().manual_seed(1)))
    where = []
    with on("emulated") as dev:
        session = Session(weights, cfg, TrainConfig(device=str(dev), stage2_groups=1, offload_teacher=False,
                                                    latent_size=8), calib, tmp_path / "p.safetensors", None, False)
        placement, place = session.placement, session.placement.on_device

        def on_device():                  # where the teacher's weights are each time a measurement places it
            teacher = place()
            where.append((placement.where, {p.device.type for p in teacher.parameters()}))
            return teacher
        monkeypatch.setattr(placement, "on_device", on_device)
        cost = gpu_trainer.offload_cost(session)
    assert set(cost) == {"on_device", "offloaded", "ratio"}
    assert all(v > 0 for part in ("on_device", "offloaded") for v in cost[part].values())
    assert not session.placement.offload and session.placement.where == "cpu"
    assert where[0] == (str(dev), {dev.type}) and where[-1] == ("offloaded", {"cpu"})


def test_the_trainer_part_reads_the_allocation_from_its_work_folder(tmp_path):
    """The speed part times trainer_sd15's allocated ranks; the trainer part takes them from ranks.json as soon as
    the allocation ends (the H200 run's part was stopped by its cap before the end and left none)."""
    import gpu_trainer
    assert gpu_trainer.allocation(tmp_path) is None
    (tmp_path / "ranks.json").write_text(json.dumps({"ranks": {"a.ff": 640}, "info": {}}))
    assert gpu_trainer.allocation(tmp_path) == {"a.ff": 640}
    (tmp_path / "ranks.json").write_text('{"ranks": ')
    assert gpu_trainer.allocation(tmp_path) is None


def test_dry_run_trainer_reaches_every_phase_with_its_plan(dry):
    results, _, _ = dry
    sites = {f: layout.sites(canonical_shapes(gpu_parts.tiny_config(f))) for f in ("sd15", "sdxl")}
    for family in ("sd15", "sdxl"):
        t = results["parts"][f"trainer_{family}"]["result"]
        run = t["run"]
        assert run["finite_adapters"] and set(run["unet_error"]) == {"init", "stage1", "stage2"}
        assert run["steps_per_s"]["stage1"] > 0 and run["steps_per_s"]["stage2"] > 0
        assert t["plan"]["eta_s"]["quick"] < t["plan"]["eta_s"]["full"]
        assert t["fit_8gb"]["groups"] == run["stage2_groups"] == 1              # tiny: everything fits
        timing = run["timing"]
        assert timing["calibration_s"] > 0 and timing["stage1_s"] > 0 and timing["stage2_s"] > 0
    sd15 = results["parts"]["trainer_sd15"]["result"]
    assert sd15["run"]["timing"]["ranks_s"] > 0                                 # the allocation ran
    assert set(sd15["ranks"]) <= {s.name for s in sites["sd15"]}
    assert results["parts"]["trainer_sdxl"]["result"]["run"]["sites"] == len(sites["sdxl"])


def test_dry_run_sampling_rows_hold_what_the_gguf_writer_stores(dry):
    results, _, _ = dry
    s = results["parts"]["sampling_vram"]["result"]
    assert s["loader"]["param_dtypes"] == ["float16"] and not s["loader"]["kept_quantised"]
    for family in ("sd15", "sdxl"):
        rows = s["families"][family]["rows"]
        cfg = gpu_parts.tiny_config(family)
        assert list(rows) == [v["name"] for v in gpu_vram.SAMPLING_VARIANTS]
        for v in gpu_vram.SAMPLING_VARIANTS:
            if v["storage"] not in gguf.QUANT_TYPES:
                continue
            shapes = canonical_shapes(cfg)
            if v["ratio"]:
                shapes = fold.slim_shapes(shapes, rank_policy.ranks_for_ratio(layout.sites(shapes), v["ratio"]))
            # independent: the writer's bytes of each tensor it quantises, the rest as the fp16 model holds it
            want = sum(gguf.tensor_bytes(sh, v["storage"]) if gguf.plan(k, sh, v["storage"]).qtype == v["storage"]
                       else 2 * math.prod(sh) for k, sh in shapes.items())
            assert rows[v["name"]]["weight_bytes"] == want, v["name"]


def test_plot_script_draws_the_seed_curves_from_results_json(dry, tmp_path):
    pytest.importorskip("matplotlib")
    import gpu_plots
    results, _, _ = dry
    written = gpu_plots.plot_all(results, tmp_path)
    assert [p.name for p in written] == ["seed_device.png", "seed_allocated.png", "device_error.png", "vram.md"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written[:3])
    table = written[3].read_text()
    points = [(c["name"], p["batch"]) for c in results["parts"]["seed_study"]["result"]["curves"] for p in c["points"]]
    assert points and all(f"| {name} | {batch} |" in table for name, batch in points)


def test_plots_of_a_first_run_results_file_with_todays_estimate(dry, tmp_path):
    """The first GPU run's results.json (older names: part ``vram_study``, NVML polled as ``nvml_peak_gib``) is read
    in today's names, and ``--estimate`` re-estimates its curves here: the same estimator on the same settings as
    the dry run's own vram_estimate part gives the same allocated peaks."""
    pytest.importorskip("matplotlib")
    import copy
    import gpu_plots
    results, _, _ = dry
    first = next(c for c in results["parts"]["seed_study"]["result"]["curves"] if len(c["points"]) > 1)
    old_points = [{k: v for k, v in p.items() if k != "nvml_end_gib"} | {"nvml_peak_gib": 1.0 + i}
                  for i, p in enumerate(first["points"])]
    older = {"parts": {"vram_study": {"status": "ok", "result": {"curves": [dict(copy.deepcopy(first),
                                                                                points=old_points)]}}}}
    now = gpu_plots.estimate_here(gpu_plots.current_names(older))
    assert [p["nvml_end_gib"] for p in now["parts"]["seed_study"]["result"]["curves"][0]["points"]] == \
        [1.0 + i for i in range(len(old_points))]
    own = {p["batch"]: p for c in results["parts"]["vram_estimate"]["result"]["curves"] if c["name"] == first["name"]
           for p in c["points"]}
    here = now["parts"]["vram_estimate"]["result"]["curves"][0]["points"]
    assert here and all(p["peak_gib"] == own[p["batch"]]["peak_gib"] for p in here)
    written = gpu_plots.plot_all(now, tmp_path)
    assert {p.name for p in written} == {"seed_device.png", "seed_allocated.png", "device_error.png", "vram.md"}


def test_failing_dying_and_hanging_parts_are_recorded_and_the_suite_goes_on(runs):
    run = runs["faults"]
    assert run["rc"] == 1, run["stdout"][-3000:]
    results = _load(run["out"])
    status = {n: (r["status"], r.get("error", "")) for n, r in results["parts"].items()}
    assert status["environment"] == ("failed", "RuntimeError: injected fault")
    assert status["trainer_sd15"][0] == "failed" and "died (exit code 9)" in status["trainer_sd15"][1]
    assert status["profile"][0] == "timed_out" and "cap" in status["profile"][1]
    assert status["trainer_sdxl"][0] == "skipped" and "budget" in status["trainer_sdxl"][1]
    assert results["finished"]
    md = (run["out"] / "results.md").read_text()
    assert "## Problems" in md and "injected fault" in md


def test_parts_failed_reruns_only_what_did_not_end_ok(tmp_path):
    """``--parts failed`` reads the earlier results.json in --out, runs the parts that did not end ok and keeps the
    others' records as they were."""
    kept = {"status": "ok", "section": "speed", "what": "x", "seconds": 1.0, "result": {"marker": 7}}
    earlier = {"parts": {"environment": {"status": "failed", "error": "injected"}, "profile": kept}}
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    proc = _start(tmp_path, "--dry-run", "--parts", "failed")
    stdout, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, stdout[-3000:]
    results = _load(tmp_path)
    assert list(results["parts"]) == ["environment", "profile"]
    assert results["parts"]["environment"]["status"] == "ok"
    assert results["parts"]["profile"] == kept
    assert "=== profile" not in stdout                                  # not run again
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_gpu_mode_without_gpu_skips_with_the_reason_and_exits_2(tmp_path):
    proc = _start(tmp_path, "--parts", "speed_sdxl")
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, stdout[-2000:]
    rec = _load(tmp_path)["parts"]["speed_sdxl"]
    assert rec["status"] == "skipped" and "no CUDA GPU" in rec["error"]


def test_the_estimators_processes_see_no_gpu_only_where_they_run_on_the_shim(tmp_path, monkeypatch):
    """vram_estimate's workers run beside the parts that read the whole device: with CUDA_VISIBLE_DEVICES='' when
    the probe estimates on the shim (this CPU build), with the GPU visible when it would only get the fake 'cpu'
    device (no compiler: a GPU-visible native-cuda estimate is the better one), the reason said."""
    ctx = gpu_parts.Context(name="vram_estimate", dry=False, work=tmp_path, compile=False, deadline=0.0)
    env, note = gpu_vram._hidden_gpu_env(ctx)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and note.startswith("no GPU visible")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("SDSLIM_CACHE_DIR", str(tmp_path / "cache"))     # no shim built before
    env, note = gpu_vram._hidden_gpu_env(ctx)
    assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert note.startswith("GPU visible") and "no C++ compiler" in note
