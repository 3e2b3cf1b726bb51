#!/usr/bin/env bash
# README command 1: set up .venv and run the demo (the whole mission on the shipped tiny model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh demo
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"   # no spinning OpenMP threads on a shared box
exec .venv/bin/sdslim demo --out "${1:-out/demo}"
