#!/usr/bin/env bash
# Create ./.venv and install sdslim into it.  Usage: tools/setup.sh demo|test
#   demo: uses a torch that is already importable (the venv sees system site-packages); installs
#         ${SDSLIM_TORCH:-torch==2.13.0} only when there is none.
#   test: pins torch==2.13.0 (the CPU build) and adds the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-demo}
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv --system-site-packages .venv
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)
if [ "$mode" = test ]; then
  torch_spec="torch==2.13.0"
elif .venv/bin/python -c "import torch" 2>/dev/null; then
  torch_spec="torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
else
  torch_spec="${SDSLIM_TORCH:-torch==2.13.0}"
fi
echo "$torch_spec" > .venv/torch-constraint.txt
.venv/bin/python -c "import torch" 2>/dev/null && [ "$mode" != test ] || "${pip[@]}" install -c .venv/torch-constraint.txt "$torch_spec"
"${pip[@]}" install -c .venv/torch-constraint.txt -e ".[gguf]"   # the demo's GGUF Q4_0 row
if [ "$mode" = test ]; then
  "${pip[@]}" install -c .venv/torch-constraint.txt -r requirements-dev.txt
  "${pip[@]}" install --no-deps stable-diffusion-sdkit==2.1.5   # real LDM/A1111 UNet blocks for tests
  "${pip[@]}" install --no-deps open_clip_torch                 # CLIP's BPE vocabulary file (no torchvision pull)
fi
