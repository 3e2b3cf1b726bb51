"""A venv as AUTOMATIC1111 webui v1.10.1 installs it, then SD Slim's install.py run in it with a ``launch`` that
really runs pip: what it added, what it changed, ``pip check``, which of the webui's imports work before and after,
and whether what SD Slim needs of its packages works there. Needs the package index.

Two kinds of venv (``torch=``):
- ``"webui"``: exactly as webui v1.10.1 makes it: its TORCH_COMMAND (torch 2.1.2 + torchvision 0.16.2, the
  CUDA 12.1 builds, from the index: a few GB, cached by pip), then ``pip install -r requirements_versions.txt``;
- ``"current"``: the running interpreter's (current) torch linked in, so pip never pulls a CUDA build, and the
  webui's ``setuptools==69.5.1`` pin left out (torch >= 2.6 needs setuptools >= 77). The imports that need a
  matching torchvision (open_clip, facexlib, spandrel) fail there before and after alike.

The clip/open_clip/repository steps of the webui's start-up need GitHub and are not made. Used by
tests/test_a1111_install.py (``SDSLIM_WEBUI_VENV=1``); ``python tests/a1111_venv/build.py DIR [webui|current]``
prints the same as JSON."""
import importlib.metadata
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PINS = ROOT / "tests" / "data" / "a1111_v1.10.1_requirements_versions.txt"
WEBUI_TORCH = ("torch==2.1.2", "torchvision==0.16.2")   # webui v1.10.1's TORCH_COMMAND (launch_utils.py)
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


def _site_packages(python):
    return Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())


def _link_torch(python, root):
    """The running interpreter's torch distribution, symlinked into a folder on the venv's path (a .pth file)."""
    dist = importlib.metadata.distribution("torch")
    base = Path(dist.locate_file(""))
    top = {Path(str(f)).parts[0] for f in dist.files if not str(f).startswith("..")}
    linked = root / "torch-linked"
    linked.mkdir()
    for name in sorted(top):
        (linked / name).symlink_to(base / name)
    (_site_packages(python) / "torch-linked.pth").write_text(str(linked) + "\n")
    return dist.version


def _build_current(python, root, pins):
    """The webui's requirements around the linked current torch: resolved, then installed without dependencies
    (so pip cannot replace the linked torch by a download)."""
    torch_version = _link_torch(python, root)
    constraint = root / "torch-constraint.txt"
    constraint.write_text(f"torch=={torch_version}\nsetuptools<81\n")   # 81 has no pkg_resources (pytorch_lightning)
    requirements = root / "requirements_versions.txt"
    requirements.write_text("".join(line for line in Path(pins).read_text().splitlines(True)
                                    if not line.lower().startswith("setuptools")))
    report = root / "resolved.json"
    _run(python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", report,
         "-r", requirements, "-c", constraint)
    wanted = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(report.read_text())["install"]
              if i["metadata"]["name"].lower() != "torch"]
    _run(python, "-m", "pip", "install", "--no-deps", "--quiet", *wanted)


def build(root, pins=PINS, torch="webui"):
    """A fresh venv at ``root`` (``torch``: "webui" or "current", see the module's doc); its python."""
    root = Path(root)
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    if torch == "current":
        _build_current(python, root, pins)
    elif torch == "webui":
        _run(python, "-m", "pip", "install", "--quiet", "--prefer-binary", *WEBUI_TORCH)
        _run(python, "-m", "pip", "install", "--quiet", "--prefer-binary", "-r", pins)
    else:
        raise ValueError(f"torch={torch!r}: expected 'webui' or 'current'")
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
