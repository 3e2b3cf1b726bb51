"""Every import inside sdslim_core follows the layer order of docs/ARCHITECTURE.md (function-local ones included)."""
import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "sdslim_core"
# lower index = lower layer; a module may import its own layer and lower ones
LAYERS = [{"optional", "devices"}, {"layout"}, {"io"}, {"ops"}, {"modules"}, {"tiny", "vram", "text"}, {"train"}, {"apps", "hosts"},
          {"cli", "ui"}]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
HOSTS = ("comfy", "comfy_api", "comfy_extras", "folder_paths", "server", "nodes", "modules", "scripts")  # ComfyUI, A1111


def imports(path: Path):
    """(imported sdslim_core layer or None, top-level absolute module, line) of every import in ``path``."""
    tree = ast.parse(path.read_text())
    pkg = list(path.relative_to(CORE.parent).parent.parts)      # the package relative imports start from
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else [])
                mod = ".".join(base)
            else:
                mod = node.module or ""
            if mod == "sdslim_core":        # ``from sdslim_core import layout``: the names are the layers
                for a in node.names:
                    yield f"sdslim_core.{a.name}", node.lineno
            else:
                yield mod, node.lineno


def layer_of(path: Path) -> str:
    rel = path.relative_to(CORE)
    return rel.parts[0].removesuffix(".py")


SOURCES = sorted(p for p in CORE.rglob("*.py") if p != CORE / "__init__.py")


def test_every_core_module_has_a_layer():
    unknown = {layer_of(p) for p in SOURCES} - set(LEVEL)
    assert not unknown, f"add {sorted(unknown)} to LAYERS here and to the Layers table of docs/ARCHITECTURE.md"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(CORE)))
def test_imports_follow_the_layers(path):
    own = LEVEL[layer_of(path)]
    wrong = []
    for mod, line in imports(path):
        top = mod.split(".")[0]
        if top in HOSTS and not mod.startswith("sdslim_core"):
            wrong.append(f"line {line}: {mod} (a host module; host glue belongs in nodes/ or scripts/)")
        if mod.startswith("sdslim_core."):
            target = mod.split(".")[1]
            if target in LEVEL and LEVEL[target] > own:
                wrong.append(f"line {line}: {mod} (layer {LEVEL[target]} above this module's layer {own})")
    assert not wrong, f"{path.relative_to(CORE)}: " + "; ".join(wrong)


def test_the_checker_sees_a_wrong_import(monkeypatch):
    """The test above can fail: an io module importing ops is reported."""
    bad = CORE / "io" / "adapters.py"
    source = bad.read_text() + "\n\ndef _late():\n    from ..ops import fold\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == bad else Path.read_bytes(self).decode())
    with pytest.raises(AssertionError, match=r"sdslim_core\.ops.*layer 3 above this module's layer 2"):
        test_imports_follow_the_layers(bad)
