#!/usr/bin/env bash
# `.gpu_deps/`: what the device machine's image lacks for bench/gpu_suite.py, to carry there (it cannot
# download): the diffusers and gguf wheels (the versions tested here; bench/gpu_suite.py unpacks them at start;
# gguf for sdslim's GGUF writer/reader in the sampling part) and bitsandbytes for the 8-bit AdamW rows (unpacked
# under site/, CUDA 13 libraries only), for Python 3.12, x86-64. (gguf's own imports: numpy, pyyaml, tqdm, requests,
# all in the device image.)
# bench/gpu_suite.py puts both on its processes' path by itself when the folder exists (never in --dry-run).
#   bash bench/gpu_suite_deps.sh      # ~16 MB; git-ignored
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DIFFUSERS=$("$PY" -c "import diffusers; print(diffusers.__version__)")
GGUF=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
BNB=${SDSLIM_BNB:-0.50.2}
PLATFORM=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 --platform any)
rm -rf .gpu_deps
"$PY" -m pip download --quiet --no-deps --dest .gpu_deps "${PLATFORM[@]}" "diffusers==$DIFFUSERS" "gguf==$GGUF"
# the placement tests on CUDA (pytest -k cuda, after the suite) also run A1111's LDM UNet: its package and omegaconf
"$PY" -m pip download --quiet --no-deps --dest .gpu_deps "${PLATFORM[@]}" stable-diffusion-sdkit==2.1.5 omegaconf
"$PY" -m pip wheel --quiet --no-deps --wheel-dir .gpu_deps antlr4-python3-runtime==4.9.3   # an sdist: built here
"$PY" -m pip install --quiet --no-deps --target .gpu_deps/site "${PLATFORM[@]}" "bitsandbytes==$BNB"
# one library per CUDA release (4 MB each): keep the CPU one and CUDA 13.0 (the image's torch is cu130)
find .gpu_deps/site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete
rm -rf .gpu_deps/site/bin
echo "wrote .gpu_deps: diffusers $DIFFUSERS, gguf $GGUF (wheels), bitsandbytes $BNB, $(du -sh .gpu_deps | cut -f1)" \
     "(a device call carries at most 64 MiB, working tree included)"
