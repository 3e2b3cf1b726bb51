"""install.py with the stand-in ``launch`` (which records pip calls instead of running pip)."""
import importlib.util
import os
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
    assert calls == [('install "psutil>=999"', "SD Slim requirement: psutil>=999"),
                     ('install "sdslim-surely-missing-package==1.0"',
                      "SD Slim requirement: sdslim-surely-missing-package==1.0")]


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
