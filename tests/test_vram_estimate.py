"""The fake-tensor estimator against independent arithmetic (tiny UNets, one real SD1.5 layout).

All jobs share one worker process (``jobs`` fixture) to pay the torch/diffusers import once.
"""
import argparse
import json
import math
import os

import pytest

from sdslim_core.io.files import GIB
from sdslim_core.vram.estimate import estimate_many, estimate_sampling
from sdslim_core.vram.settings import Settings

from conftest import HANG_GUARD_S
from vram_toy_models import NARROW, TINY

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=HERE)  # the worker imports vram_toy_models
SD15_PARAMS = 859_520_964  # published SD1.5 UNet parameter count


def tiny(**kw):
    return Settings(unet_config=TINY, **{"resolution": 128, **kw})


ENTRIES = [  # (name, settings, baseline, batch sizes)
    ("fp32", tiny(precision="fp32"), "fp32", (1, 2, 3)),
    ("fp32_2x", tiny(precision="fp32", resolution=256), "fp32", (1, 3)),
    ("gc", tiny(precision="fp32", grad_ckpt=True), "fp32", (3,)),
    ("adamw8bit", tiny(precision="fp32", optimizer="adamw8bit"), "fp32", (1, 2)),
    ("lora", tiny(precision="fp32", lora_rank=4), "fp32", (1,)),
    ("sample", tiny(sampling=True, precision="full-bf16"), "sample", (1,)),
    ("sample_narrow", tiny(sampling=True, precision="full-bf16", model_factory="vram_toy_models:narrow_unet"),
     "sample", (1,)),
    ("sd15", Settings(arch="sd15", resolution=256), "sd15", (1,)),
]


PROGRESS = []  # the worker's progress lines, as run_worker(on_progress=...) receives them


@pytest.fixture(scope="module")
def results():
    return {r.name: r for r in estimate_many(ENTRIES, env=ENV, timeout=HANG_GUARD_S, on_progress=PROGRESS.append)}


@pytest.fixture(scope="module")
def jobs(results):
    return {name: dict(r.to_dict(), points=r.points) for name, r in results.items()}


def rounded(nbytes):
    return math.ceil(nbytes / 512) * 512


def param_sizes(config):
    """numel of every parameter of the diffusers UNet, built on the meta device (no tracker involved)."""
    import torch
    from diffusers import UNet2DConditionModel
    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    return [p.numel() for p in unet.parameters()]


def point(job, batch):
    return next(p for p in job["points"] if p["batch"] == batch)


def test_analytic_terms_to_the_byte(jobs):
    sizes = param_sizes(TINY)
    w32 = sum(rounded(4 * n) for n in sizes)
    p = point(jobs["fp32"], 1)
    static, at_opt = p["phase_start_bytes"]["data"], p["phase_start_bytes"]["opt"]
    assert static == {"param": w32, "opt_state": 2 * w32}  # weights + AdamW exp_avg, exp_avg_sq
    assert at_opt["grad"] == w32
    # foreach AdamW's step: weights + grads + states + one fp32 temporary per param (_foreach_sqrt)
    assert p["peak_bytes"] == 5 * w32 and p["phase"] == "opt"
    # bitsandbytes-style 8-bit states: uint8 x2 + fp32 absmax per 256-block x2; fp32 x2 below 4096 elements
    s8 = sum(2 * rounded(n) + 2 * rounded(4 * math.ceil(n / 256)) if n >= 4096 else 2 * rounded(4 * n)
             for n in sizes)
    assert any(n >= 4096 for n in sizes) and any(n < 4096 for n in sizes)
    assert point(jobs["adamw8bit"], 1)["phase_start_bytes"]["data"] == {"param": w32, "opt_state": s8}
    # sampling in full bf16: the frozen weights are 2 bytes per parameter
    assert point(jobs["sample"], 1)["phase_start_bytes"]["data"] == {"frozen": sum(rounded(2 * n) for n in sizes)}


def test_sd15_layout_counts(jobs):
    job = jobs["sd15"]
    assert job["n_params"] == SD15_PARAMS == job["n_trainable"]
    w32 = sum(rounded(4 * n) for n in param_sizes(job["settings"]["unet_config"] or _sd15_config()))
    p = point(job, 1)
    assert p["phase_start_bytes"]["data"] == {"param": w32, "opt_state": 2 * w32}
    assert p["peak_bytes"] == 5 * w32  # at 256 px the optimizer step is the peak (the B=1 kink)
    assert 3.2 < w32 / GIB < 3.21  # the seed's "3.23 GB" is 3.44e9 bytes: same weights


def _sd15_config():
    from sdslim_core.vram.settings import UNET_CONFIGS
    return UNET_CONFIGS["sd15"]


def test_activations_linear_in_batch_and_pixels(jobs):
    pts = {p["batch"]: p["line_gib"] * GIB for p in jobs["fp32"]["points"]}
    d1, d2 = pts[2] - pts[1], pts[3] - pts[2]
    assert d1 > 0 and abs(d2 - d1) < 0.005 * d1  # equal steps up to the 512-B rounding of each tensor
    # per-sample activations scale with the latent pixel count (x4 from 128 to 256 px); per-sample
    # tensors that are not per pixel (time embedding, 77-token context) keep the ratio a little below 4
    slope_2x = (point(jobs["fp32_2x"], 3)["line_gib"] - point(jobs["fp32_2x"], 1)["line_gib"]) * GIB / 2
    assert 3.8 < slope_2x / d1 <= 4.0


def test_setting_order(jobs, results):
    full3 = point(jobs["fp32"], 3)
    assert point(jobs["gc"], 3)["line_gib"] < 0.7 * full3["line_gib"]
    assert point(jobs["adamw8bit"], 1)["peak_gib"] < point(jobs["fp32"], 1)["peak_gib"]
    assert point(jobs["lora"], 1)["peak_gib"] < point(jobs["fp32"], 1)["peak_gib"]
    assert jobs["lora"]["n_trainable"] < 0.2 * jobs["fp32"]["n_params"]
    assert point(jobs["sample_narrow"], 1)["peak_gib"] < point(jobs["sample"], 1)["peak_gib"]
    assert jobs["sample_narrow"]["n_params"] == sum(param_sizes(NARROW))
    assert results["adamw8bit"].classification.startswith("lowers the constant")


def test_result_contract(results):
    d = results["fp32"].to_dict()
    assert {"points", "intercept_gib", "slope_gib", "plateau_gib", "kink_batch"} <= set(d)
    assert set(d["points"][0]) >= {"batch", "peak_gib", "phase", "breakdown_gib"}
    assert json.loads(json.dumps(d))["settings"]["precision"] == "fp32"
    text = results["fp32"].format_text()
    assert "B=2" in text and "optimizer step" in text
    # the device peak: the allocator model's reserve (whole segments, at least the live bytes) + the context
    for p in d["points"]:
        assert p["reserved_gib"] >= p["peak_gib"] and p["device_gib"] == p["reserved_gib"] + d["context_gib"]
    assert "GiB allocated, device" in text


def test_progress_lines_one_per_point(results):
    points = [ln.strip().split(" peak ")[0] for ln in PROGRESS if " peak " in ln]
    assert points == [f"{name}: B={b}" for name, _, _, batches in ENTRIES for b in batches]


def test_fallback_without_compiler(tmp_path):
    env = dict(ENV, CXX=str(tmp_path / "no-such-g++"), SDSLIM_CACHE_DIR=str(tmp_path / "cache"))
    (res,) = estimate_many([("cpu", tiny(precision="fp32"), "cpu")], batch_sizes=(1,), env=env, timeout=HANG_GUARD_S)
    assert res.device_mode == "cpu-fallback"
    note = " ".join(res.warnings)
    assert "no C++ compiler" in note and "fake 'cpu' device" in note and "25% low" in note
    sizes = param_sizes(TINY)
    w32 = sum(rounded(4 * n) for n in sizes)
    # on the 'cpu' device AdamW's per-parameter `step` scalars live on the tracked device too
    assert res.points[0]["phase_start_bytes"]["data"] == {"param": w32, "opt_state": 2 * w32 + 512 * len(sizes)}


def test_a_cuda_build_without_a_gpu_estimates_training_on_the_shim(tmp_path):
    """A CUDA build of torch on a machine without a GPU (the usual `pip install torch` on Linux): its own CUDA
    hooks fail the fake backward pass ("hasPrimaryContext expects a valid device index"), so the shim is loaded,
    and its hooks must outrank the ones libtorch_cuda registers on import (at equal priority the registry ends the
    process) and its guard replace the one libtorch_cuda stores. Emulated on this CPU build by a library that makes
    libtorch_cuda's registrations for a machine with no device."""
    import shutil
    import subprocess
    import sys

    from sdslim_core.vram import fakecuda
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    standin = tmp_path / "libtorch_cuda_standin.so"
    fakecuda.compile_against_torch(os.path.join(HERE, "fake_cuda", "no_device_cuda_build.cpp"), standin,
                                   fakecuda._torch_dir())
    root = os.path.dirname(HERE)                          # sdslim_core, also where it is not pip-installed
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fake_cuda", "activate_in_cuda_build.py"), str(standin)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["shim", "cuda:0"]
    assert "CUDAHooks" not in proc.stderr                 # the registry's notice about the outranked hooks is not shown


def test_the_fake_device_is_torchs_own_only_where_a_cuda_build_sees_a_device(monkeypatch):
    from sdslim_core.vram import fakecuda
    for cuda_build, visible, mode in ((True, True, "native-cuda"), (True, False, "shim"), (False, True, "shim"),
                                      (False, False, "shim")):
        monkeypatch.setattr(fakecuda, "_is_cuda_build", lambda torch_dir, b=cuda_build: b)
        monkeypatch.setattr(fakecuda, "_cuda_device_visible", lambda v=visible: v)
        assert fakecuda.fake_device_mode("torch") == mode


def test_cli_estimate_json_contract(capsys):
    from sdslim_core.cli import vram as cli
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["vram", "estimate", "--arch", "sd15", "--resolution", "256", "--batch-sizes", "2,1",
                              "--precision", "full-bf16", "--sampling", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["batch"] for p in out["points"]] == [1, 2]
    assert out["points"][0]["phase"] == "sample"
    assert out["n_params"] == SD15_PARAMS
    assert out["intercept_gib"] == pytest.approx(sum(rounded(2 * n) for n in param_sizes(_sd15_config())) / GIB,
                                                 rel=0.01)
    assert out["slope_gib"] > 0 and set(out["points"][0]["breakdown_gib"]) >= {"frozen", "act"}


def test_slim_sampling_below_original():
    orig, slim = estimate_sampling(Settings(arch="sd15", resolution=256, precision="full-bf16", slim_ratio=0.5),
                                   batch_sizes=(1,), timeout=HANG_GUARD_S)
    assert slim.points[0]["peak_gib"] < orig.points[0]["peak_gib"]
    assert slim.n_params < 0.7 * orig.n_params  # the half preset keeps 528M of 859.5M


# -- --ckpt of a slim or GGUF file: the UNet the file holds ----------------------------------------------------

ASSETS = os.path.join(os.path.dirname(HERE), "sdslim_core", "tiny", "assets")
TINY_CKPT = os.path.join(ASSETS, "tiny_sd15.safetensors")
TINY_ADAPTERS = os.path.join(ASSETS, "tiny_sd15_slim_half.safetensors")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """Files `sdslim slim` writes of the shipped tiny model: slim .safetensors, slim Q8_0 .gguf, plain Q8_0 .gguf."""
    from sdslim_core.apps.slim import slim_checkpoint
    d = tmp_path_factory.mktemp("vram_ckpt")
    files = {"slim": d / "slim.safetensors", "slim_gguf": d / "slim.gguf", "plain_gguf": d / "plain.gguf"}
    slim_checkpoint(TINY_CKPT, TINY_ADAPTERS, files["slim"])
    slim_checkpoint(TINY_CKPT, TINY_ADAPTERS, files["slim_gguf"], quant="Q8_0")
    slim_checkpoint(TINY_CKPT, None, files["plain_gguf"], quant="Q8_0")
    return {k: str(v) for k, v in files.items()}


def file_tensors(path):
    """[(numel, GGUF type, stored bytes)] of a file's UNet tensors, read by the gguf package / the header itself."""
    if path.endswith(".gguf"):
        import gguf
        return [(int(t.n_elements), t.tensor_type.name, int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors
                if not t.name.startswith("sdslim.")]
    from sdslim_core.io.tensors import read_header
    return [(math.prod(shape), None, None) for k, (_, shape) in read_header(path)[0].items()
            if k.startswith("model.diffusion_model.")]


def test_slim_files_estimate_their_own_unet(model_files):
    from dataclasses import replace

    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.vram.settings import settings_from_ckpt
    kw = dict(resolution=64, precision="full-bf16", sampling=True)
    slim, gguf, plain = (settings_from_ckpt(model_files[k], **kw) for k in ("slim", "slim_gguf", "plain_gguf"))
    assert slim.slim_ranks == gguf.slim_ranks == AdapterSet.load(TINY_ADAPTERS, lazy=True).ranks()
    assert slim.quantised is None and plain.slim_ranks is None
    entries = [("slim", slim, "slim"), ("gguf", gguf, "slim"), ("plain", plain, "slim"),
               ("gguf_as_float", replace(gguf, quantised=None), "slim"),
               ("loader", replace(slim, slim_ranks=None, model_factory="vram_toy_models:file_unet"), "slim"),
               ("loader_gguf", replace(gguf, slim_ranks=None, quantised=None,
                                       model_factory="vram_toy_models:file_unet"), "slim")]
    res = {r.name: r for r in estimate_many(entries, batch_sizes=(1, 2), env=ENV, timeout=HANG_GUARD_S)}
    # the slim file's estimate is that of its UNet as sdslim's loader builds it from the file's shapes (the
    # allocator's reserve aside: it also depends on the order the build allocated in)
    def live(points):
        return [{k: v for k, v in p.items() if k != "reserved_gib"} for p in points]
    for name, ref in (("slim", "loader"), ("gguf_as_float", "loader_gguf"), ("gguf_as_float", "slim")):
        assert live(res[name].points) == live(res[ref].points), name
    unet_params = lambda path: sum(n for n, _, _ in file_tensors(path))  # noqa: E731
    assert res["slim"].n_params == res["gguf"].n_params == unet_params(model_files["slim"])
    assert res["plain"].n_params == unet_params(model_files["plain_gguf"]) > 1.3 * res["slim"].n_params
    assert (res["slim"].unet, res["plain"].unet) == ("slim (ckpt)", "original")
    assert "(slim ckpt)" in res["slim"].format_text() and f"{res['slim'].n_params:,} UNet" in res["slim"].format_text()
    # quantised GGUF: its quantised tensors take their file bytes, the float ones 2 bytes (full-bf16)
    for name in ("gguf", "plain"):
        path = model_files["slim_gguf" if name == "gguf" else "plain_gguf"]
        stored = sum(rounded(b if t not in ("F32", "F16", "BF16") else 2 * n) for n, t, b in file_tensors(path))
        assert res[name].points[0]["phase_start_bytes"]["data"] == {"frozen": stored}, name
        assert "GGUF Q8_0 kept quantised" in res[name].settings.label()
    assert res["gguf"].points[1]["peak_bytes"] < res["slim"].points[1]["peak_bytes"]


def test_planner_and_cli_estimate_a_slim_file_as_one_slim_curve(model_files):
    from sdslim_core.cli.vram import estimate_results
    from sdslim_core.ui import actions
    from sdslim_core.ui.paths import Roots
    from sdslim_core.vram.settings import settings_from_ckpt
    form = actions.PlanForm(source="checkpoint", ckpt=model_files["slim_gguf"], task="sampling", batch_sizes="1",
                            resolution=64, precision="full-bf16")
    argv = actions.estimate_argv(form, Roots([os.path.dirname(model_files["slim_gguf"])]))
    args = actions.parse_estimate_argv(argv)
    results = estimate_results(args, timeout=HANG_GUARD_S)
    plan = actions.PlanResult(argv, results, {}, 0.0)
    (res,) = results
    assert (res.name, res.unet, res.settings.sampling) == ("slim", "slim (ckpt)", True)
    assert res.settings.quantised and res.n_params == sum(n for n, _, _ in file_tensors(model_files["slim_gguf"]))
    assert f"| slim (ckpt) ({res.n_params / 1e6:.1f}M) | 1 |" in actions.plan_table(plan, None)
    assert f"slim (ckpt) UNet ({res.n_params:,} parameters" in actions.plan_summary(plan, None)
    with pytest.raises(ValueError, match="slim checkpoint already"):
        settings_from_ckpt(model_files["slim"], slim_ratio=0.5)


def test_unreadable_model_files_name_themselves(tmp_path, model_files):
    from sdslim_core.io.tensors import FileFormatError
    from sdslim_core.vram.settings import settings_from_ckpt
    with open(model_files["slim"], "rb") as f:
        head = f.read(4096)
    with open(model_files["slim_gguf"], "rb") as f:
        gguf_head = f.read(4096)
    cases = {"cut.safetensors": head, "cut.gguf": gguf_head, "zip.safetensors": b"PK\x03\x04 not safetensors",
             "text.gguf": b"not a gguf file at all"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(FileFormatError, match=str(tmp_path / name).replace(".", r"\.")):
            settings_from_ckpt(str(tmp_path / name), resolution=64)


def test_diffusers_folder_and_single_file_give_one_unet(tmp_path):
    from sdslim_core import layout
    from sdslim_core.io.tensors import LazyStateDict, save_file_atomic
    from sdslim_core.vram.settings import settings_from_ckpt
    lazy = LazyStateDict(TINY_CKPT)
    canonical = layout.to_canonical({k: lazy[k] for k in lazy.keys()})[0]
    cfg = layout.config_from_state_dict(canonical)
    save_file_atomic({layout.canonical_to_diffusers_key(cfg, k): v for k, v in canonical.items()},
                     tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    folder, single = settings_from_ckpt(str(tmp_path), resolution=64), settings_from_ckpt(TINY_CKPT, resolution=64)
    assert folder.unet_config == single.unet_config and folder.slim_ranks is None is single.slim_ranks


@pytest.mark.skipif(os.name != "posix", reason="the ._pth file is named after the interpreter; built here on POSIX")
def test_the_worker_starts_under_a_python_that_ignores_pythonpath_as_comfyuis_portable_one_does(tmp_path, monkeypatch):
    """ComfyUI's Windows portable Python has a ``._pth`` file beside python.exe: PYTHONPATH is ignored, and sdslim
    (a custom node folder) is no installed package. Made the same here: a copy of this interpreter beside a
    ``python._pth`` listing the standard library and this venv's site-packages (no ``import site``: the editable
    install is not seen), run from another folder. The estimator's worker still starts and estimates."""
    import shutil
    import site
    import subprocess
    import sys
    import sysconfig
    if sys.version_info < (3, 11):
        pytest.skip("._pth files outside Windows need Python 3.11")
    python = tmp_path / "python"
    shutil.copy2(os.path.realpath(sys.executable), python)
    stdlib = sysconfig.get_paths()["stdlib"]
    (tmp_path / "python._pth").write_text("\n".join([stdlib, os.path.join(stdlib, "lib-dynload"),
                                                     *site.getsitepackages()]) + "\n")
    repo = os.path.dirname(HERE)
    probe = subprocess.run([str(python), "-c", "import sys, torch; print(*sys.path, sep=chr(10))"], cwd=tmp_path,
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=repo))
    assert probe.returncode == 0, probe.stderr                 # torch is there
    assert repo not in probe.stdout.splitlines(), probe.stdout  # PYTHONPATH is not followed
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.chdir(tmp_path)
    (got,) = estimate_many([("fp32", tiny(precision="fp32"), "fp32", (1,))], env=dict(os.environ, PYTHONPATH=repo),
                           timeout=HANG_GUARD_S)
    assert got.points[0]["batch"] == 1 and got.points[0]["peak_gib"] > 0
