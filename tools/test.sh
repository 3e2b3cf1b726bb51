#!/usr/bin/env bash
# README command 2: set up .venv (torch==2.13.0 CPU) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"   # no spinning threads on a shared 2-core box
# Two pytest processes (pytest-xdist), a test file each at a time: much of the suite waits on subprocesses (the
# VRAM estimator's workers, CLI runs, a browser), so two cores run it in ~8 min instead of ~13. `-n 0` runs it in
# this one process; SDSLIM_TEST_WORKERS=N sets another count.
exec .venv/bin/python -m pytest -q -n "${SDSLIM_TEST_WORKERS:-2}" --dist loadfile "$@"
