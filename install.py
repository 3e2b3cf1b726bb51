"""Installer for both hosts: pip-installs what SD Slim needs from requirements.txt, within the host's environment.

AUTOMATIC1111 runs this file at start-up and after an install from the Extensions tab, with its own ``launch``
module importable (pip runs through its helpers). ComfyUI-Manager runs it too, in ComfyUI's Python, after it has
pip-installed requirements.txt line by line without the caps below: there is no ``launch`` then, and pip runs as
``python -m pip``; a release it installed past a cap is replaced here. It only adds packages: each pip call is
constrained to the versions already installed (:func:`installed_pins`), so pip picks releases that fit the host's
pins (with webui v1.10.1 a diffusers that works with its huggingface_hub and safetensors) or fails, and never
changes one of the host's packages. torch, torchvision, torchaudio and xformers are never installed: the host
owns them. Releases that need a newer torch than the installed one are left out (:data:`TORCH_CAPS`), so what is
added imports on the host's own torch (with webui v1.10.1's torch 2.1.2: diffusers 0.35, lycoris-lora 4.0).
"""
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile

try:
    import launch                       # the webui's
except ImportError:                     # ComfyUI-Manager: ComfyUI's Python, no webui
    launch = None

REQUIREMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements.txt")
WEBUI_OWNED = {"torch", "torchvision", "torchaudio", "xformers"}
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")
# (distribution, torch release below which, the cap): releases that fail to import on an older torch. Each boundary
# was measured by installing torch on both sides of it and running what SD Slim uses (tests/a1111_venv/releases.py;
# docs/a1111.md, "On the webui's own torch").
TORCH_CAPS = (("diffusers", "2.3", "<0.36"),        # 0.36 reads torch.xpu at import
              ("diffusers", "2.5", "<0.37"),        # 0.37 registers a custom op torch 2.4 cannot read ('X | None')
              ("diffusers", "2.6", "<0.41"),        # 0.41 reads torch.accelerator
              ("lycoris-lora", "2.7", "<4.1"))      # 4.1 registers custom ops (torch.library.custom_op, list[int])


def requirements(path=REQUIREMENTS):
    """(name, requirement line) for each requirement in ``path``, minus what the webui owns."""
    out = []
    with open(path, encoding="utf8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = _NAME.match(line)
            if m is None or line.startswith("-"):
                raise ValueError(f"{path}:{number}: {line!r} is not a plain requirement (expected e.g. 'psutil>=5')")
            name = m.group(1)
            if name.lower().replace("_", "-") not in WEBUI_OWNED:
                out.append((name, line))
    return out


def torch_caps(name):
    """The caps of :data:`TORCH_CAPS` on ``name`` that the installed torch needs, as one specifier ("" if none)."""
    from importlib.metadata import PackageNotFoundError, version
    from packaging.version import InvalidVersion, Version
    try:
        torch = Version(version("torch"))
    except (PackageNotFoundError, InvalidVersion):
        return ""
    return ",".join(cap for dist, below, cap in TORCH_CAPS
                    if _canonical(dist) == _canonical(name) and torch < Version(below))


def needed(name, line):
    """What to pip-install for this requirement (capped to releases that import on the installed torch), or None
    when it is satisfied (or not for this platform). An installed release past a cap (one that cannot import on
    this torch) is replaced."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
    except ImportError:     # cannot read versions or markers: presence is all that can be checked
        return None if is_installed(name) else line
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        return None
    specifier = req.specifier & SpecifierSet(torch_caps(req.name))
    target = f"{req.name}{specifier}"
    if not is_installed(name):
        return target
    try:
        return None if specifier.contains(version(name), prereleases=True) else target
    except PackageNotFoundError:    # importable under that name but not an installed distribution
        return None


def is_installed(name):
    """Whether distribution ``name`` is installed (the webui's own check where it runs this file)."""
    if launch is not None:
        return launch.is_installed(name)
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def pip_install(target, constraints):
    """``pip install target -c constraints``: through the webui's ``launch.run_pip``, else ``python -m pip``."""
    desc = f"SD Slim requirement: {target}"
    if launch is not None:
        launch.run_pip(f'install "{target}" -c "{constraints}"', desc)
        return
    print(desc, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", target, "-c", constraints], check=True)


def _canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_pins(except_name=None):
    """``name==version`` of every installed distribution but ``except_name`` (the one being upgraded), first on
    the path first, as pip sees them; none when ``packaging`` is missing to check the versions."""
    try:
        from importlib.metadata import distributions
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return []
    pins = {}
    for dist in distributions():
        name, version = dist.metadata["Name"], dist.version
        if not name or not version or _canonical(name) == _canonical(except_name or ""):
            continue
        try:
            Version(version)
        except InvalidVersion:      # pip refuses such a constraint line; it cannot be pinned
            continue
        pins.setdefault(_canonical(name), f"{name}=={version}")
    return list(pins.values())


def main(path=REQUIREMENTS):
    with tempfile.TemporaryDirectory(prefix="sdslim-install-") as tmp:
        constraints = os.path.join(tmp, "installed.txt")
        for name, line in requirements(path):
            target = needed(name, line)
            if target is None:
                continue
            with open(constraints, "w", encoding="utf8") as f:
                f.write("".join(pin + "\n" for pin in installed_pins(except_name=name)))
            pip_install(target, constraints)


if __name__ == "__main__":
    main()
