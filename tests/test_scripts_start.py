"""Every script in tools/ and bench/ imports and parses its arguments (a moved core module must not break them)."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("tools", "bench") for p in (ROOT / d).glob("*.py")
                 if p.name != "tiny_common.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(script):
    """A script prints its usage; a module of helpers (no ``__main__`` block) imports cleanly."""
    is_script = '__name__ == "__main__"' in (ROOT / script).read_text()
    r = subprocess.run([sys.executable, script] + (["--help"] if is_script else []), cwd=ROOT, capture_output=True,
                       text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout or not is_script
