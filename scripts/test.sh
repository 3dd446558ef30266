#!/usr/bin/env bash
# Set up the environment from scratch if needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh -r requirements-dev.txt
exec .venv/bin/python -m pytest "$@"
