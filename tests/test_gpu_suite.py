"""The GPU suite (bench/gpu_suite.py) cannot rot between GPU days: its dry run (the same code on the CPU, tiny
UNets) passes every part, writes strict JSON and the markdown, and its numbers agree with independent counts;
a part that raises, dies or hangs is recorded as such and the suite goes on; without a GPU it says so.

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

GIB = 2 ** 30
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", MKL_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
FAULTS = "environment=raise,vram_study=die,trainer_sd15=hang"


def _start(out: Path, *args, env=ENV):
    return subprocess.Popen([sys.executable, str(SUITE), "--out", str(out), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _load(out: Path) -> dict:
    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name} in results.json")
    return json.loads((out / "results.json").read_text(), parse_constant=no_constants)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dry, faulty = tmp_path_factory.mktemp("dry"), tmp_path_factory.mktemp("faults")
    procs = {"dry": _start(dry, "--dry-run"),
             "faults": _start(faulty, "--dry-run", "--parts", "environment,vram_study,trainer_sd15,fold",
                              "--budget", "12", env=dict(ENV, SDSLIM_GPU_SUITE_FAULT=FAULTS))}
    out = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=900)
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
    for heading in ("## Environment", "## VRAM", "## Trainer on CUDA", "## Speed"):
        assert heading in md
    assert "## Problems" not in md
    assert results["parts"]["environment"]["result"]["torch"] == torch.__version__


def test_dry_run_vram_measured_next_to_estimate(dry):
    results, _, _ = dry
    study = {c["name"]: c for c in results["parts"]["vram_study"]["result"]["curves"]}
    estimate = {c["name"]: c for c in results["parts"]["vram_estimate"]["result"]["curves"]}
    names = {"base", "adamw8bit", "grad_ckpt", "full_bf16", "lora16", "sdxl_base"}
    assert set(study) == set(estimate) == names
    assert not study["adamw8bit"]["points"] and "bitsandbytes" in study["adamw8bit"]["notes"][0]
    rows = {(r["name"], r["batch"]): r for r in gpu_report.vram_rows(results)}
    assert set(rows) == {(n, 1) for n in names - {"adamw8bit"}}
    # a real CPU step counted by LiveTracker vs the estimate on fake tensors: weights, gradients and AdamW states
    # dominate tiny models, so the two must agree closely where no LoRA is involved
    for name in ("base", "grad_ckpt", "full_bf16", "sdxl_base"):
        assert abs(rows[(name, 1)]["err_allocated"]) < 0.05, rows[(name, 1)]
    # independent count: fp32 weights + grads + 2 AdamW states = 16 B/param for the full fine-tune
    params = sum(math.prod(s) for s in canonical_shapes(gpu_parts.tiny_config("sd15")).values())
    assert rows[("base", 1)]["allocated"] * GIB >= 16 * params


def _slim_params(cfg, ratio):
    shapes = canonical_shapes(cfg)
    ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), ratio)
    return sum(math.prod(s) for s in fold.slim_shapes(shapes, ranks).values())


def test_dry_run_speed_weights_match_independent_counts(dry):
    results, _, _ = dry
    for family, n_shapes in (("sd15", 2), ("sdxl", 1)):
        res = results["parts"][f"speed_{family}"]["result"]
        cfg = gpu_parts.tiny_config(family)
        assert len(res["shapes"]) == n_shapes
        for shape in res["shapes"].values():
            models = shape["models"]
            assert list(models) == ["original", "slim 0.75", "slim 0.5", "slim 0.25", "original fp8", "slim 0.5 fp8"]
            assert models["original"]["speedup"] == 1.0 and all(m["n"] == 3 for m in models.values())
            for name, ratio in (("original", 1.0), ("slim 0.75", 0.75), ("slim 0.5", 0.5), ("slim 0.25", 0.25)):
                want = (_slim_params(cfg, ratio) if ratio < 1 else
                        sum(math.prod(s) for s in canonical_shapes(cfg).values())) * 2   # fp16
                assert models[name]["weight_gib"] * GIB == want, name
            assert 0.5 < models["original fp8"]["weight_gib"] / models["original"]["weight_gib"] < 0.75
            assert shape["finite"] and all(0 < e < 0.2 for e in shape["fp8_rel_err"].values())


def test_dry_run_trainer_and_fold(dry):
    results, _, _ = dry
    sites = {f: layout.sites(canonical_shapes(gpu_parts.tiny_config(f))) for f in ("sd15", "sdxl")}
    sd15, sdxl = (results["parts"][f"trainer_{f}"]["result"] for f in ("sd15", "sdxl"))
    assert sd15["sites"] == len(sites["sd15"]) and sd15["effective"]["stage2_groups"] == 1
    assert sdxl["ranks_by_kind"] == {"res": sum(s.kind == "res" for s in sites["sdxl"])}
    assert sdxl["effective"]["stage2_groups"] == 3 and sdxl["predicted"]["peak_gib"] > 0
    for t in (sd15, sdxl):
        assert all(t["finite"].values()) and t["steps_done"] == t["sites"] * 2 + 6
    f = results["parts"]["fold"]["result"]
    assert f["sites"] == len(sites["sd15"]) and f["lora_tensors_merged"] > 0
    assert f["slim_params"] == _slim_params(gpu_parts.tiny_config("sd15"), 0.5)


def test_failing_dying_and_hanging_parts_are_recorded_and_the_suite_goes_on(runs):
    run = runs["faults"]
    assert run["rc"] == 1, run["stdout"][-3000:]
    results = _load(run["out"])
    status = {n: (r["status"], r.get("error", "")) for n, r in results["parts"].items()}
    assert status["environment"] == ("failed", "RuntimeError: injected fault")
    assert status["vram_study"][0] == "failed" and "died (exit code 9)" in status["vram_study"][1]
    assert status["trainer_sd15"][0] == "timed_out" and "cap" in status["trainer_sd15"][1]
    assert status["fold"][0] == "skipped" and "budget" in status["fold"][1]
    assert results["finished"] and results["wall_s"] < 60
    md = (run["out"] / "results.md").read_text()
    assert "## Problems" in md and "injected fault" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_gpu_mode_without_gpu_skips_with_the_reason_and_exits_2(tmp_path):
    proc = _start(tmp_path, "--parts", "speed_sdxl")
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, stdout[-2000:]
    rec = _load(tmp_path)["parts"]["speed_sdxl"]
    assert rec["status"] == "skipped" and "no CUDA GPU" in rec["error"]
