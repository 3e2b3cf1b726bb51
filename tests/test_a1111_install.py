"""install.py with the stand-in ``launch`` (which records pip calls instead of running pip); with
``SDSLIM_WEBUI_VENV=1`` (needs the package index, a few GB and tens of minutes) also in a venv made exactly as webui
v1.10.1 makes it (torch 2.1.2, its requirements_versions.txt) and in one around the current torch, with a ``launch``
that runs pip, and the stand-in tab's training tests run by each venv's python."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from a1111_standin.harness import ROOT, STANDIN


@pytest.fixture
def install(monkeypatch):
    monkeypatch.syspath_prepend(STANDIN)
    sys.modules.pop("launch", None)
    import launch
    launch.standin_pip_calls.clear()
    spec = importlib.util.spec_from_file_location("sdslim_install", os.path.join(ROOT, "install.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)          # not __main__: nothing runs at import
    yield module, launch.standin_pip_calls
    sys.modules.pop("launch", None)


def test_installs_missing_or_too_old_requirements_never_torch(install, tmp_path):
    module, calls = install
    req = tmp_path / "requirements.txt"
    req.write_text("# sdslim\ntorch>=2.0\nxformers\nsafetensors>=0.3  # present\n"
                   "psutil>=999\nsdslim-surely-missing-package==1.0\nTorchVision\n"
                   'nvidia-ml-py; sys_platform == "nowhere"\n')
    assert not calls
    module.main(str(req))
    assert [(re.sub(r' -c ".+"$', "", c), d) for c, d in calls] == [
        ('install "psutil>=999"', "SD Slim requirement: psutil>=999"),
        ('install "sdslim-surely-missing-package==1.0"', "SD Slim requirement: sdslim-surely-missing-package==1.0")]


def _dist(site, name, version):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"      # the normalised name, as pip writes it
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_pip_may_only_add_every_installed_version_is_a_constraint(install, tmp_path, monkeypatch):
    """Each pip call is constrained to the installed distributions' versions, as pip itself lists them (so pip
    picks, say, a diffusers that fits the webui's huggingface_hub instead of upgrading it), except the requirement
    that call upgrades; the constraints file is removed afterwards."""
    module, calls = install
    site = tmp_path / "site"
    _dist(site, "huggingface_hub", "0.36.2")        # first on the path: what the webui would have
    _dist(site, "psutil", "1.0")
    monkeypatch.syspath_prepend(str(site))
    listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                            check=True, env=dict(os.environ, PYTHONPATH=str(site))).stdout
    want = {module._canonical(d["name"]): d["version"] for d in json.loads(listed)}
    assert want["huggingface-hub"] == "0.36.2" and want["torch"]
    pinned = []
    import launch
    record = launch.run_pip

    def run_pip(command, desc=None, live=False):
        target, constraints = re.fullmatch(r'install "(.+)" -c "(.+)"', command).groups()
        lines = open(constraints, encoding="utf8").read().split()
        pinned.append((target, constraints, {module._canonical(n): v for n, v in (p.split("==") for p in lines)}))
        return record(command, desc, live)
    monkeypatch.setattr(launch, "run_pip", run_pip)
    req = tmp_path / "requirements.txt"
    req.write_text("psutil>=999\nhuggingface-hub>=0.20\nsdslim-surely-missing-package==1.0\n")
    module.main(str(req))
    assert [t for t, _, _ in pinned] == ["psutil>=999", "sdslim-surely-missing-package==1.0"]
    upgrade, add = pinned[0][2], pinned[1][2]
    assert upgrade == {k: v for k, v in want.items() if k != "psutil"}     # psutil is the one being upgraded
    assert add == want and add["psutil"] == "1.0"
    assert not os.path.exists(pinned[0][1])


# (torch, the newest diffusers and lycoris-lora releases that import and work there, the first ones that do not),
# as measured by installing each (docs/a1111.md, "On the webui's own torch"); None: no release fails
BOUNDARIES = [("2.1.2+cu121", "0.35.2", "0.36.0", "4.0.0", "4.1.0"),      # webui v1.10.1's torch
              ("2.2.2", "0.35.2", "0.36.0", "4.0.0", "4.1.0"),
              ("2.4.1", "0.36.0", "0.37.0", "4.0.0", "4.1.0"),
              ("2.5.1", "0.40.0", "0.41.0", "4.0.0", "4.1.0"),
              ("2.6.0", "0.42.1", None, "4.0.0", "4.1.0"),
              ("2.7.1", "0.42.1", None, "4.1.3", None)]


@pytest.mark.parametrize("torch_version, works, fails, lyco_works, lyco_fails", BOUNDARIES)
def test_releases_that_do_not_import_on_the_installed_torch_are_left_out_or_replaced(
        install, tmp_path, monkeypatch, torch_version, works, fails, lyco_works, lyco_fails):
    """Each pip call's requirement is capped below the first release that fails on the installed torch and keeps the
    newest that works; an installed release past the cap (what an older install.py added: diffusers 0.37.1 and
    lycoris-lora 4.1.3, which fail on torch 2.1.2) is replaced, one within it is kept."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    module, calls = install
    site = tmp_path / "site"
    _dist(site, "torch", torch_version)
    _dist(site, "diffusers", "0.37.1")
    _dist(site, "lycoris-lora", "4.1.3")
    monkeypatch.syspath_prepend(str(site))
    req = tmp_path / "requirements.txt"
    req.write_text("diffusers>=0.27\nlycoris-lora>=3\n")
    module.main(str(req))
    targets = {r.name: r.specifier for r in (Requirement(re.fullmatch(r'install "(.+)" -c ".+"', c)[1])
                                             for c, _ in calls)}
    for name, installed, newest, first_failing, oldest in (("diffusers", "0.37.1", works, fails, "0.27"),
                                                            ("lycoris-lora", "4.1.3", lyco_works, lyco_fails, "3")):
        if first_failing is None or Version(installed) < Version(first_failing):
            assert name not in targets, (name, targets)         # the installed release works here: kept
        else:
            spec = targets[name]
            assert spec.contains(newest) and spec.contains(oldest), (name, spec)
            assert not spec.contains(first_failing) and not spec.contains(installed), (name, spec)


@pytest.fixture
def install_in_comfyui(monkeypatch):
    """install.py as ComfyUI-Manager runs it: in ComfyUI's Python, where no ``launch`` module exists; pip calls
    recorded instead of run."""
    monkeypatch.setitem(sys.modules, "launch", None)            # `import launch` raises ImportError
    spec = importlib.util.spec_from_file_location("sdslim_install_comfy", os.path.join(ROOT, "install.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    monkeypatch.setattr(module.subprocess, "run", lambda cmd, check: calls.append(cmd))
    return module, calls


def test_in_comfyui_manager_a_release_past_a_torch_cap_is_replaced_through_python_m_pip(
        install_in_comfyui, tmp_path, monkeypatch):
    """ComfyUI-Manager pip-installs requirements.txt line by line without the caps, then runs install.py: on torch
    2.1.2 the diffusers 0.37.1 it installed cannot import, so install.py replaces it through ``python -m pip``,
    constrained to the installed versions like the webui path; lycoris-lora 4.0.0 (within its cap) is kept."""
    from packaging.requirements import Requirement
    module, calls = install_in_comfyui
    assert module.launch is None
    site = tmp_path / "site"
    for name, version in (("torch", "2.1.2"), ("diffusers", "0.37.1"), ("lycoris-lora", "4.0.0"), ("psutil", "5.9")):
        _dist(site, name, version)
    monkeypatch.syspath_prepend(str(site))
    req = tmp_path / "requirements.txt"
    req.write_text("diffusers>=0.27\nlycoris-lora>=3\npsutil\n")
    module.main(str(req))
    assert len(calls) == 1 and calls[0][:4] == [sys.executable, "-m", "pip", "install"] and calls[0][5] == "-c"
    target = Requirement(calls[0][4])
    assert target.name == "diffusers" and "0.35.2" in target.specifier and "0.36.0" not in target.specifier
    assert not os.path.exists(calls[0][6])                       # the constraints file is removed afterwards


def test_install_py_runs_as_comfyui_manager_runs_it():
    """``python install.py`` in the repository folder with this Python (which has no webui ``launch`` module and
    every requirement installed by tools/setup.sh): it exits 0 without calling pip (PIP_NO_INDEX would fail one)."""
    run = subprocess.run([sys.executable, "install.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PIP_NO_INDEX="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SD Slim requirement" not in run.stdout


def test_every_line_of_requirements_txt_installs_on_its_own():
    """Some installers (ComfyUI-Manager releases before mid-2025, scripts) pip-install each line as it is, inline
    comment included; pip refuses 'matplotlib  # plots'. Every line is a comment or a plain requirement."""
    from packaging.requirements import Requirement
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    assert lines and all(Requirement(line) for line in lines)


def test_bad_requirement_lines_name_file_and_line(install, tmp_path):
    module, calls = install
    req = tmp_path / "requirements.txt"
    req.write_text("psutil\n-r other.txt\n")
    with pytest.raises(ValueError, match=r"requirements.txt:2: '-r other.txt' is not a plain requirement"):
        module.main(str(req))
    assert not calls


def test_the_shipped_requirements_parse_and_leave_torch_to_the_webui(install):
    module, _ = install
    path = os.path.join(ROOT, "requirements.txt")
    if not os.path.exists(path):
        pytest.skip("requirements.txt not written yet")
    names = [n.lower() for n, _ in module.requirements(path)]
    assert names and not {"torch", "torchvision", "xformers"} & set(names)


@pytest.fixture(scope="module", params=["webui", "current"])
def webui_venv(request, tmp_path_factory):
    """(build module, build.check's result, kind): a venv made as webui v1.10.1 makes it (its torch 2.1.2), or
    around the current torch, with install.py run in it."""
    if os.environ.get("SDSLIM_WEBUI_VENV") != "1":
        pytest.skip("SDSLIM_WEBUI_VENV=1: builds webui venvs from the package index (torch 2.1.2: a few GB, minutes)")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from a1111_venv import build
    finally:
        sys.path.remove(os.path.join(ROOT, "tests"))
    return build, build.check(tmp_path_factory.mktemp(request.param) / "venv", torch=request.param), request.param


def test_in_a_webui_venv_install_py_only_adds_what_imports_on_its_torch(webui_venv):
    """Nothing of the webui's changes, ``pip check`` is clean, the webui's imports give what they gave, and what
    SD Slim imports of the added packages works on the venv's torch (on webui v1.10.1's torch 2.1.2: diffusers 0.35.2
    and lycoris-lora 4.0.0, the newest releases that import there)."""
    _, result, kind = webui_venv
    assert result["install_rc"] == 0, result["install_log"]
    assert result["changed"] == {}, result["changed"]
    assert result["pip_check_rc"] == 0, result["pip_check"]
    assert result["imports_after"] == result["imports_before"]
    assert {"diffusers", "lycoris-lora"} <= result["added"].keys(), result["added"]
    assert set(result["sdslim_imports"].values()) == {"ok"}, result["sdslim_imports"]
    if kind == "webui":
        assert result["torch"] == "2.1.2" and set(result["imports_before"].values()) == {"ok"}, result
        assert (result["added"]["diffusers"], result["added"]["lycoris-lora"]) == ("0.35.2", "4.0.0"), result["added"]


def test_in_a_webui_venv_the_sd_slim_tab_trains(webui_venv):
    """The stand-in tab's training tests (interrupt and resume, recipes and Start from, refusals) pass when run by
    the venv's own python, on its torch and the releases install.py added."""
    build, result, _ = webui_venv
    rc, out = build.run_tests(result["python"], "tests/test_a1111_training.py", "-k",
                              "interrupt_resume or recipe_and_start or refusals")
    assert rc == 0 and " passed" in out, out
