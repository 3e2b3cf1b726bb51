"""docs/ARCHITECTURE.md's Public API block names real objects with their real signatures."""
import inspect
import pkgutil
import types
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"


def api_lines() -> list[str]:
    text = DOC.read_text()
    block = text.split("## Public API", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


class _Bare(str):
    def __repr__(self):
        return str(self)


def _bare(annotation):
    return _Bare(annotation.strip("'\"")) if isinstance(annotation, str) else annotation


def signature_text(obj) -> str:
    """``inspect.signature`` text, string annotations unquoted, the default op namespace named ``TORCH_OPS``."""
    sig = inspect.signature(obj)
    params = []
    for p in sig.parameters.values():
        default = _Bare("TORCH_OPS") if isinstance(p.default, types.SimpleNamespace) else p.default
        params.append(p.replace(annotation=_bare(p.annotation), default=default))
    ret = sig.return_annotation
    return str(sig.replace(parameters=params, return_annotation=_bare(ret.strip("'") if isinstance(ret, str) else ret)))


def test_block_is_not_empty():
    assert len(api_lines()) > 20


@pytest.mark.parametrize("line", api_lines())
def test_documented_signature_matches(line):
    name, _, rest = line.partition("(")
    assert name.startswith("sdslim_core."), line
    assert signature_text(pkgutil.resolve_name(name)) == "(" + rest, f"{name}: update docs/ARCHITECTURE.md"
