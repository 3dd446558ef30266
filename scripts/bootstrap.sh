#!/usr/bin/env bash
# Create .venv (once) and install what the project needs on a fresh machine.
# torch goes first and is pinned by a constraints file on every later pip call, so no other
# package can pull a different (CUDA) torch. XDIT_TORCH overrides the pin (e.g. a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
torch_pin="${XDIT_TORCH:-torch==2.13.0}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
constraints=.venv/constraints.txt
echo "$torch_pin" > "$constraints"
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "$torch_pin"
"${pip[@]}" -c "$constraints" -r requirements.txt "$@"
