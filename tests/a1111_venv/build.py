"""A venv as AUTOMATIC1111 webui v1.10.1 installs it, then SD Slim's install.py run in it with a ``launch`` that
really runs pip: what it added, what it changed, ``pip check``, which of the webui's imports work before and after,
and whether what SD Slim needs of its packages works there. Needs the package index.

Two kinds of venv (``torch=``), both made as the webui makes its venv: its TORCH_COMMAND, then
``pip install -r requirements_versions.txt`` (torch and torchvision from the index: a few GB, cached by pip):
- ``"webui"``: exactly webui v1.10.1's: torch 2.1.2 + torchvision 0.16.2 (the CUDA 12.1 builds);
- ``"current"``: the newest torch and torchvision the index offers (a TORCH_COMMAND users set for new GPUs), with
  the webui's ``setuptools==69.5.1`` pin replaced by ``setuptools<81`` (a current torch needs setuptools >= 77,
  pytorch_lightning 1.9.4 the pkg_resources that 81 dropped).

The clip/open_clip/repository steps of the webui's start-up need GitHub and are not made. Used by
tests/test_a1111_install.py (``SDSLIM_WEBUI_VENV=1``); ``python tests/a1111_venv/build.py DIR [webui|current]``
prints the same as JSON."""
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PINS = ROOT / "tests" / "data" / "a1111_v1.10.1_requirements_versions.txt"
# what each kind of venv installs first: webui v1.10.1's TORCH_COMMAND (launch_utils.py), or the newest releases
TORCH_COMMANDS = {"webui": ("torch==2.1.2", "torchvision==0.16.2"), "current": ("torch", "torchvision")}
# the top-level modules of the packages in PINS, and the text encoder classes the webui builds from transformers
WEBUI_IMPORTS = ["git", "PIL", "accelerate", "blendmodes", "cleanfid", "diskcache", "einops", "facexlib", "fastapi",
                 "gradio", "httpcore", "inflection", "jsonmerge", "kornia", "lark", "numpy", "omegaconf", "open_clip",
                 "piexif", "google.protobuf", "psutil", "pytorch_lightning", "resize_right", "safetensors", "skimage",
                 "spandrel", "spandrel_extra_arches", "tomesd", "torch", "torchdiffeq", "torchsde", "transformers",
                 "httpx", "pillow_avif", "huggingface_hub", "transformers:CLIPTextModel", "transformers:CLIPTokenizer"]
# what SD Slim imports of the packages install.py adds: the trainer's UNet, the LyCORIS weight rebuilds
SDSLIM_IMPORTS = ["diffusers:UNet2DConditionModel", "lycoris.functional.loha", "lycoris.functional.lokr",
                  "lycoris.functional.locon"]


def _run(*cmd, env=None, check=True, cwd=None):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def build(root, pins=PINS, torch="webui"):
    """A fresh venv at ``root`` (``torch``: "webui" or "current", see the module's doc); its python."""
    if torch not in TORCH_COMMANDS:
        raise ValueError(f"torch={torch!r}: expected one of {', '.join(TORCH_COMMANDS)}")
    root = Path(root)
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--prefer-binary", *TORCH_COMMANDS[torch])
    extra = []
    if torch == "current":
        requirements, constraint = root / "requirements_versions.txt", root / "setuptools-constraint.txt"
        requirements.write_text("".join(line for line in Path(pins).read_text().splitlines(True)
                                        if not line.lower().startswith("setuptools")))
        constraint.write_text("setuptools<81\n")
        pins, extra = requirements, ["-c", constraint]
    _run(python, "-m", "pip", "install", "--quiet", "--prefer-binary", "-r", pins, *extra)
    return python


def installed(python):
    """{distribution name (lower case): version} in the venv."""
    listing = json.loads(_run(python, "-m", "pip", "list", "--format=json").stdout)
    return {d["name"].lower().replace("_", "-"): d["version"] for d in listing}


def imports(python, modules=WEBUI_IMPORTS):
    """{module or module:attribute: "ok" or the error} as the venv's python imports them, one process each."""
    out = {}
    for item in modules:
        module, _, attr = item.partition(":")
        code = f"import {module}" + (f"; getattr(__import__('{module}', fromlist=['_']), '{attr}')" if attr else "")
        done = _run(python, "-W", "ignore", "-c", code, check=False)
        out[item] = "ok" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
    return out


def run_install_py(python, extension=ROOT):
    """SD Slim's install.py in the venv, as the webui runs it (its ``launch`` importable); its output."""
    env = dict(os.environ, PYTHONPATH=str(HERE))
    done = _run(python, Path(extension) / "install.py", env=env, check=False)
    return done.returncode, done.stdout + done.stderr


def run_tests(python, *pytest_args):
    """The repository's tests run by the venv's python (pytest and the stand-in's LDM UNet blocks added first,
    after every check of the venv as the webui has it): (exit status, pytest's output)."""
    _run(python, "-m", "pip", "install", "--quiet", "pytest")
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "stable-diffusion-sdkit==2.1.5")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    done = _run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, cwd=ROOT, env=env, check=False)
    return done.returncode, done.stdout + done.stderr


def check(root, extension=ROOT, torch="webui"):
    """Build the venv at ``root``, run install.py: a dict of what a test asserts on (``python``: the venv's)."""
    python = build(root, torch=torch)
    before, imports_before = installed(python), imports(python)
    rc, log = run_install_py(python, extension)
    after = installed(python)
    pip_check = _run(python, "-m", "pip", "check", check=False)
    return dict(python=str(python), torch=after.get("torch"), install_rc=rc, install_log=log,
                added={k: v for k, v in after.items() if k not in before},
                changed={k: (before[k], after.get(k)) for k in before if after.get(k) != before[k]},
                pip_check_rc=pip_check.returncode, pip_check=pip_check.stdout + pip_check.stderr,
                imports_before=imports_before, imports_after=imports(python), sdslim_imports=imports(python,
                                                                                                      SDSLIM_IMPORTS))


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], torch=sys.argv[2] if len(sys.argv) > 2 else "webui"), indent=1))
