#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a lent GPU machine that has PyTorch but cannot reach a package index:
# this repo's requirements that its image lacks, for its Python (3.12, x86-64), downloaded here into .whl/ (ignored by
# git; the device tool carries it with `carry: [".whl"]`). The versions are this project's tested ones.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
mkdir -p .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    diffusers==0.42.1 pyzmq==27.3.0 gguf==0.19.0 ftfy==6.3.1 wcwidth==0.9.4 importlib_metadata==8.7.0
ls -l .whl
