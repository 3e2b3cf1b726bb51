"""AUTOMATIC1111 installer: pip-installs what SD Slim needs from requirements.txt through the webui's helpers.

The webui runs this file at start-up and after an install from the Extensions tab, with its own ``launch``
module importable. torch, torchvision, torchaudio and xformers are never installed or changed here: the
webui owns them.
"""
import os
import re

import launch

REQUIREMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements.txt")
WEBUI_OWNED = {"torch", "torchvision", "torchaudio", "xformers"}
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


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


def needed(name, line):
    """What to pip-install for this requirement, or None when it is satisfied (or not for this platform)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        from packaging.requirements import Requirement
    except ImportError:     # cannot read versions or markers: presence is all that can be checked
        return None if launch.is_installed(name) else line
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        return None
    target = f"{req.name}{req.specifier}"
    if not launch.is_installed(name):
        return target
    try:
        return None if req.specifier.contains(version(name), prereleases=True) else target
    except PackageNotFoundError:    # importable under that name but not an installed distribution
        return None


def main(path=REQUIREMENTS):
    for name, line in requirements(path):
        target = needed(name, line)
        if target is not None:
            launch.run_pip(f'install "{target}"', f"SD Slim requirement: {target}")


if __name__ == "__main__":
    main()
