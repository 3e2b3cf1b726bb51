"""A venv as AUTOMATIC1111 webui v1.10.1 installs it (its ``requirements_versions.txt``), then SD Slim's install.py
run in it with a ``launch`` that really runs pip: what it added, what it changed, ``pip check``, and which of the
webui's imports work before and after. Needs the package index. torch is not downloaded: the running
interpreter's torch is linked in (so pip never pulls a CUDA build), and the webui's ``setuptools==69.5.1`` pin is
left out, since that torch (2.13) needs setuptools>=77 where the webui's own 2.1.2 does not. The imports that
need a matching torchvision (open_clip, facexlib, spandrel) fail in such a venv before and after alike. Used by tests/test_a1111_install.py
(``SDSLIM_WEBUI_VENV=1``); ``python tests/a1111_venv/build.py DIR`` prints the same as JSON."""
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
# the top-level modules of the packages in PINS, and the text encoder classes the webui builds from transformers
WEBUI_IMPORTS = ["git", "PIL", "accelerate", "blendmodes", "cleanfid", "diskcache", "einops", "facexlib", "fastapi",
                 "gradio", "httpcore", "inflection", "jsonmerge", "kornia", "lark", "numpy", "omegaconf", "open_clip",
                 "piexif", "google.protobuf", "psutil", "pytorch_lightning", "resize_right", "safetensors", "skimage",
                 "spandrel", "spandrel_extra_arches", "tomesd", "torch", "torchdiffeq", "torchsde", "transformers",
                 "httpx", "pillow_avif", "huggingface_hub", "transformers:CLIPTextModel", "transformers:CLIPTokenizer"]


def _run(*cmd, env=None, check=True):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
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


def build(root, pins=PINS):
    """A fresh venv at ``root`` holding exactly what pip resolves for ``pins`` (torch linked); its python."""
    root = Path(root)
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
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
        code = f"import {module}" + (f"; getattr(__import__('{module}'), '{attr}')" if attr else "")
        done = _run(python, "-c", code, check=False)
        out[item] = "ok" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
    return out


def run_install_py(python, extension=ROOT):
    """SD Slim's install.py in the venv, as the webui runs it (its ``launch`` importable); its output."""
    env = dict(os.environ, PYTHONPATH=str(HERE))
    done = _run(python, Path(extension) / "install.py", env=env, check=False)
    return done.returncode, done.stdout + done.stderr


def check(root, extension=ROOT):
    """Build the venv at ``root``, run install.py: a dict of what a test asserts on."""
    python = build(root)
    before, imports_before = installed(python), imports(python)
    rc, log = run_install_py(python, extension)
    after = installed(python)
    pip_check = _run(python, "-m", "pip", "check", check=False)
    return dict(install_rc=rc, install_log=log,
                added={k: v for k, v in after.items() if k not in before},
                changed={k: (before[k], after.get(k)) for k in before if after.get(k) != before[k]},
                pip_check_rc=pip_check.returncode, pip_check=pip_check.stdout + pip_check.stderr,
                imports_before=imports_before, imports_after=imports(python))


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1]), indent=1))
