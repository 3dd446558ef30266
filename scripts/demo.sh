#!/usr/bin/env bash
# The main job on a built-in tiny model (no download): 2-rank Ulysses sampling, timed, PNG out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m parallel.demo "$@"
