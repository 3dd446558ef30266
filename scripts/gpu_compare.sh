#!/usr/bin/env bash
# The GPU comparison (issue #19), on a machine with one GPU or more: each rank on its own GPU, bf16, NCCL, the
# attention kernel the engine picks (flash-attn where installed, PyTorch's SDPA kernels otherwise), the large
# Flux model (FLUX.1-dev's width, 12 of its blocks, 1024², 512 text tokens). With one GPU only the 1-rank rows run.
#   - the wrapper on 1 GPU next to plain diffusers; Ulysses-2, Ring-2 and CFG-2 against one GPU and against
#     diffusers' own context parallelism (Ulysses-2, Ring-2), side by side in one torchrun job;
#   - PipeFusion-2 (warm-up 1, 20 steps, 2 and 4 patches) against one GPU and Ulysses-2;
#   - --compile against eager on 1 and 2 GPUs (on 1 where there is one).
# Results go to $OUT (default bench/out) as JSON, the tables to stdout. PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out=${OUT:-bench/out}
gpus=$(nvidia-smi -L | wc -l)
mkdir -p "$out"
echo "gpu_compare: $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
"$python" -m bench all --large --max-ranks "$gpus" --runs 5 --json "$out/gpu-all.json"
if [ "$gpus" -ge 2 ]; then
    "$python" -m bench.pipefusion --large --steps 20 --patches 2 4 --runs 3 --json "$out/gpu-pipefusion.json"
    "$python" -m bench.compile --large --ranks 1 2 --runs 3 --json "$out/gpu-compile.json"
else
    "$python" -m bench.compile --large --ranks 1 --runs 3 --json "$out/gpu-compile.json"
fi
