#!/usr/bin/env bash
# Set up everything from scratch if needed, then run the test suite (arguments go to pytest).
# The project's venv, then the ComfyUI test bed and the browser (tests/testbed.py: built once into
# ~/.cache/comfyui-xdit-pool, reused later); -rs prints why any test was skipped, --durations the slowest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/bootstrap.sh -r requirements-dev.txt
echo "test.sh: project venv ready in $((SECONDS - start)) s"
.venv/bin/python tests/testbed.py
exec .venv/bin/python -m pytest -q -rs --durations=40 "$@"
