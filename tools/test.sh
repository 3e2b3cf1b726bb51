#!/usr/bin/env bash
# README command 2: set up .venv (torch==2.13.0 CPU) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"   # no spinning threads on a shared 2-core box
exec .venv/bin/python -m pytest -q "$@"
