"""Every script in tools/ and bench/ imports and parses its arguments (a moved core module must not break them)."""
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("tools", "bench") for p in (ROOT / d).glob("*.py")
                 if p.name != "tiny_common.py")


def _start(script: str) -> subprocess.CompletedProcess:
    is_script = '__name__ == "__main__"' in (ROOT / script).read_text()
    return subprocess.run([sys.executable, script] + (["--help"] if is_script else []), cwd=ROOT, capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def started() -> dict:
    """Every script started, two at a time (each start is mostly the interpreter importing torch)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SCRIPTS, pool.map(_start, SCRIPTS)))


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(script, started):
    """A script prints its usage; a module of helpers (no ``__main__`` block) imports cleanly."""
    is_script = '__name__ == "__main__"' in (ROOT / script).read_text()
    r = started[script]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout or not is_script
