"""Optional dependencies through the real `sdslim` CLI with the package made unimportable (``sys.modules[name] =
None``, in this process or, through a ``sitecustomize`` on PYTHONPATH, in the estimate worker): each command fails
(or skips) with a message naming the package and what to pip-install. Also: requirements.txt (what
ComfyUI-Manager and the A1111 installer install) is pyproject's dependency list, and the extras exist."""
import os
import re
import subprocess
import sys
import tomllib

import pytest
import torch

from conftest import HANG_GUARD_S
from sdslim_core import cli, optional, tiny
from sdslim_core.io.tensors import save_file_atomic
from test_slim_roundtrip import canonical_weights, random_adapters, write_ldm_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = str(tiny.DEFAULT_PATH)
TRAIN_FAST = ["--budget", "2.4M", "--steps", "0", "--trajectories", "3", "--sample-steps", "2", "--prompt", "a cat",
              "--no-vram-estimate", "--no-progress"]


def forget(monkeypatch, name):
    """Drop ``name`` and its submodules from ``sys.modules`` for this test."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, key)


def block(monkeypatch, name):
    """``import name`` fails in this process as if it were not installed (submodules imported before too)."""
    forget(monkeypatch, name)
    monkeypatch.setitem(sys.modules, name, None)


def block_in_children(monkeypatch, tmp_path, *names):
    """The same in every Python child process started from here (a ``sitecustomize`` first on PYTHONPATH)."""
    site = tmp_path / "block_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{n!r}] = None\n" for n in names))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))


def run(capsys, *args):
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def hint(install, dist=None):
    """The install advice in a MissingDependency message."""
    also = f" (or `pip install {dist}`)" if dist else ""
    return f"install it with `pip install {install}`{also}"


def test_vram_estimate_with_lora_settings_without_peft(monkeypatch, tmp_path, capsys):
    block_in_children(monkeypatch, tmp_path, "peft")
    rc, _, err = run(capsys, "vram", "estimate", "--ckpt", TINY, "--resolution", "64", "--batch-sizes", "1",
                     "--lora-rank", "4")
    assert rc == 1
    assert "LoRA training (lora_kind=lora, lora_rank=4) needs peft, which is not installed; " \
           + hint("sdslim[lora]", "peft") in err
    assert "Traceback" not in err and "ModuleNotFoundError" not in err


def test_slim_with_a_loha_without_lycoris(monkeypatch, tmp_path, capsys):
    w = canonical_weights(seed=4, dtype=torch.float32)
    write_ldm_checkpoint(tmp_path / "m.safetensors", w)
    random_adapters(w).save(tmp_path / "a.safetensors", dtype=torch.float32)
    q = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    out_f, in_f = w[q + ".weight"].shape
    g = torch.Generator().manual_seed(0)
    n = "lora_unet_" + q.replace(".", "_")
    loha = {f"{n}.hada_w{i}_{ab}": torch.randn(*((out_f, 2) if ab == "a" else (2, in_f)), generator=g)
            for i in (1, 2) for ab in "ab"}
    save_file_atomic({**loha, f"{n}.alpha": torch.tensor(2.0)}, tmp_path / "loha.safetensors")
    block(monkeypatch, "lycoris")
    rc, _, err = run(capsys, "slim", "--ckpt", tmp_path / "m.safetensors", "--adapters", tmp_path / "a.safetensors",
                     "--lora", tmp_path / "loha.safetensors", "--out", tmp_path / "slim.safetensors")
    assert rc == 2
    assert "merging LoHa/LoKr/Tucker LoRA weights needs lycoris-lora, which is not installed; " \
           + hint("lycoris-lora") in err
    assert not (tmp_path / "slim.safetensors").exists()


def test_multi_process_train_without_accelerate(monkeypatch, tmp_path):
    """In a fresh `sdslim` process (diffusers looks for accelerate once, when first imported); peft goes too, as
    it requires accelerate."""
    block_in_children(monkeypatch, tmp_path, "accelerate", "peft")
    env = dict(os.environ, WORLD_SIZE="2", PYTHONPATH=os.pathsep.join((os.environ["PYTHONPATH"], ROOT)))
    proc = subprocess.run([sys.executable, "-m", "sdslim_core.cli", "train", "--ckpt", TINY,
                           "--out", str(tmp_path / "a.safetensors"), *TRAIN_FAST],
                          env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr
    assert "sdslim train: error: multi-process training (WORLD_SIZE=2) needs accelerate, which is not installed; " \
           + hint("sdslim[train]", "accelerate") in proc.stderr
    assert not (tmp_path / "a.safetensors").exists()


def test_train_without_matplotlib_keeps_the_adapters_and_says_what_to_install(monkeypatch, tmp_path, capsys):
    block(monkeypatch, "matplotlib")
    out = tmp_path / "a.safetensors"
    rc, _, err = run(capsys, "train", "--ckpt", TINY, "--out", out, *TRAIN_FAST)
    assert rc == 0 and out.exists() and not (tmp_path / "a.errors.png").exists()
    assert "plot failed: the per-site error plot needs matplotlib, which is not installed; " + hint("matplotlib") in err


@pytest.fixture
def fake_cuda(monkeypatch):
    """`sdslim vram study` gets as far as its per-setting checks (nothing is measured: every setting is skipped)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_vram_study_skips_xformers_and_adamw8bit_saying_what_to_install(monkeypatch, tmp_path, capsys, fake_cuda):
    block(monkeypatch, "xformers")
    block(monkeypatch, "bitsandbytes")
    rc, _, err = run(capsys, "vram", "study", "--matrix", "xformers,adamw8bit", "--batch-sizes", "1",
                     "--out", tmp_path / "study")
    xf = "xformers attention needs xformers, which is not installed; " + hint("sdslim[xformers]", "xformers")
    bnb = "the adamw8bit optimizer needs bitsandbytes, which is not installed; " + hint("bitsandbytes")
    assert rc == 0
    assert f"xformers: skipped ({xf})" in err and f"adamw8bit: skipped ({bnb})" in err
    table = (tmp_path / "study" / "vram_study.md").read_text()
    assert f"- **xformers**: skipped: {xf}" in table and f"- **adamw8bit**: skipped: {bnb}" in table


def test_vram_study_without_matplotlib_writes_the_rest(monkeypatch, tmp_path, capsys, fake_cuda):
    block(monkeypatch, "xformers")
    block(monkeypatch, "matplotlib")
    rc, _, err = run(capsys, "vram", "study", "--matrix", "xformers", "--out", tmp_path / "study")
    assert rc == 2
    assert "sdslim vram: error: the VRAM plot needs matplotlib, which is not installed; " + hint("matplotlib") in err
    assert sorted(os.listdir(tmp_path / "study")) == ["vram_study.csv", "vram_study.json", "vram_study.md"]


def test_train_adamw8bit_on_cuda_without_bitsandbytes(monkeypatch):
    """The run's optimizer choice (the CUDA-only part of `sdslim train`): asked for -> error; auto -> AdamW, said."""
    from sdslim_core.train.session import optimizer_kind
    block(monkeypatch, "bitsandbytes")
    said = []
    cuda = torch.device("cuda")
    with pytest.raises(optional.MissingDependency, match=re.escape(
            "--optimizer adamw8bit needs bitsandbytes, which is not installed; " + hint("bitsandbytes"))):
        optimizer_kind(cuda, "adamw8bit", said.append)
    assert optimizer_kind(cuda, "auto", said.append) == "adamw"
    assert said == ["8-bit AdamW (--optimizer auto) needs bitsandbytes, which is not installed; "
                    + hint("bitsandbytes") + "; using AdamW"]
    assert optimizer_kind(torch.device("cpu"), "adamw8bit", said.append) == "adamw"  # 8-bit AdamW is CUDA-only


def test_a_broken_install_is_not_called_missing(monkeypatch, tmp_path):
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("import sdslim_surely_absent_dependency\n")
    forget(monkeypatch, "matplotlib")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(optional.MissingDependency) as err:
        optional.require("matplotlib", "the plot")
    assert "the plot needs matplotlib, which is installed but cannot be imported (ModuleNotFoundError: No module " \
           "named 'sdslim_surely_absent_dependency'); " + hint("matplotlib") in str(err.value)


def _requirements():
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf8") as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def test_requirements_txt_is_pyprojects_dependency_list_and_the_extras_exist():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert sorted(_requirements()) == sorted(project["dependencies"])
    extras = project["optional-dependencies"]
    for module, (dist, pip_arg) in optional.PACKAGES.items():
        m = re.fullmatch(r"sdslim\[(\w+)\]", pip_arg)
        if m:
            assert any(re.match(re.escape(dist) + r"\b", r) for r in extras[m[1]]), (module, extras[m[1]])
        else:
            assert pip_arg == dist, module


def _dist_closure(requirements: list[str]) -> set[str]:
    """Canonical names of the distributions ``requirements`` install, their dependencies included."""
    from importlib import metadata

    from packaging.requirements import Requirement
    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(req.name) or ()]
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_lycoris_forms_after_slim_work_with_only_requirements_txt(monkeypatch, tmp_path):
    """ComfyUI/A1111 installed as documented get requirements.txt only: with every package that only an extra (or
    the dev setup) brings made unimportable, LoHa/LoKr/Tucker LoRAs after Slim UNet, and on the webui's slim
    layers, still apply exactly (the host tests run in a child process)."""
    from importlib import metadata
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    installed = _dist_closure(_requirements())
    only_extras = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r)[0]).lower()
                   for reqs in extras.values() for r in reqs} - installed - {"pytest"}
    modules = {m for m, dists in metadata.packages_distributions().items()
               if any(re.sub(r"[-_.]+", "-", d).lower() in only_extras for d in dists) and m.isidentifier()}
    assert {"peft", "accelerate", "gradio"} <= modules
    block_in_children(monkeypatch, tmp_path, *sorted(modules))
    tests = ["tests/test_comfy_nodes.py::test_loras_after_slim_are_converted_and_equal_the_fold_of_the_merged_weights",
             "tests/test_comfy_nodes.py::test_tucker_locon_and_tucker_loha_after_slim_equal_the_fold_of_the_merged_"
             "weights",
             "tests/test_a1111_extension.py::test_lycoris_forms_and_an_ff_intercept_apply_in_slim_space_exactly"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
