#!/usr/bin/env bash
# Issue #38's GPU check, on a machine with a CUDA GPU (a lent one: see bench/RESULTS.md), within 8 minutes:
#   - tests/gpu (pytest; the README's CPU command never collects them): a 1-rank pool over NCCL in bf16 on the
#     FLUX.1-width bench model against diffusers bf16 on the same card, cancel inside a job, xDiT Model's single
#     calls, xDiT VAE Decode, fp8 and GGUF storage, fp8 matmuls, --compile, the CUDA attention kernels (flash-attn's
#     where `import flash_attn` works), two ranks sharing the card (--share-gpus), a call's peak memory against
#     bench.memory_table, the device plan with the real queries;
#   - bench.fp8_linear (FLUX.1-dev's projections one at a time: bf16 against fp8 matmuls and their parts);
#   - bench.pool_overhead (the pool against the same pipeline in-process: goal ≤ 2%), bench.quantized_storage
#     (bf16, fp8, GGUF Q8_0 and fp8 matmuls side by side, on 3 of the large model's blocks: writing the 12-block
#     GGUF alone outran its stage on the first lent H200; goal ≥ 1.3× for fp8 matmuls), bench.link_table --measure
#     (its compute calibrated on this card, saved to bench/link_table_blocks.json);
#   - bench.gpu_report: the numbers into bench/RESULTS.md under the card's name (and, with $OUT set, as the device
#     tool brings files back, RESULTS.md, the measured blocks and every stage's output into $OUT).
# Without CUDA it says so in one line and exits 2. Python: $PYTHON, else .venv/bin/python if it has torch, else
# python3. Packages the machine lacks (diffusers, pyzmq, gguf, ftfy) come as wheels in .whl/ (scripts/gpu_wheels.sh
# downloads them beside the repo; carry .whl). Exit 0: every test passed within the budget.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python=${PYTHON:-}
if [ -z "$python" ]; then
    if .venv/bin/python -c "import torch" 2>/dev/null; then python=.venv/bin/python; else python=python3; fi
fi
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here ($python: torch.cuda.is_available() is not True); run it on a machine with one" >&2
    exit 2
fi
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/xdit-site .whl/*.whl
    export PYTHONPATH="/tmp/xdit-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
missing=$("$python" - <<'PY'
import importlib.util
need = ["diffusers", "transformers", "safetensors", "zmq", "msgpack", "gguf", "peft", "accelerate", "sentencepiece", "pytest"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: this Python lacks $missing: run scripts/gpu_wheels.sh where pip works and carry .whl" >&2
    exit 2
fi
out=${OUT:-bench/out/gpu-check}
mkdir -p "$out"
export XDIT_GPU_OUT="$out" PYTHONUNBUFFERED=1
card=$("$python" -c "import torch; print(torch.cuda.get_device_name(0))")
torch_version=$("$python" -c "import torch; print(torch.__version__)")
echo "gpu_check: $card, torch $torch_version, $("$python" -c 'import torch; print(torch.cuda.device_count())') GPU(s)"
tests=(tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_pool.py)
if "$python" -c "import flash_attn" 2>/dev/null; then tests+=(tests/gpu/test_gpu_flash_attn.py); fi
touch "$out/gpu_check.log"
stage() {  # stage SECONDS NAME COMMAND...: run with a time limit, its output to the log, its tables and verdicts shown
    local limit=$1 name=$2 mark code
    shift 2
    echo "gpu_check: $name (at most ${limit} s, from $((SECONDS - start)) s)"
    mark=$(wc -l < "$out/gpu_check.log")
    timeout "$limit" "$@" >> "$out/gpu_check.log" 2>&1
    code=$?
    tail -n +"$((mark + 1))" "$out/gpu_check.log" | grep -E "^(\||FAILED|ERROR|E  |[0-9]+ (passed|failed))" || true
    [ "$code" -eq 0 ] || echo "gpu_check: $name ended with status $code$([ "$code" -eq 124 ] && echo ' (its time limit)')" \
        | tee -a "$out/gpu_check.log"
}
stage 40 "bench.fp8_linear" "$python" -m bench.fp8_linear --iters 50 --json "$out/fp8_linear.json"
stage 250 "tests/gpu" "$python" -m pytest -q -p no:cacheprovider -o addopts= --timeout 200 --junitxml "$out/junit.xml" \
    --basetemp /tmp/xdit-gpu-tests "${tests[@]}"
stage 90 "bench.pool_overhead" "$python" -m bench.pool_overhead --model large --runs 3 --steps 4 --json "$out/pool_overhead.json"
stage 60 "bench.quantized_storage" "$python" -m bench.quantized_storage --model large --blocks 1,2 --runs 5 \
    --json "$out/quantized_storage.json"
stage 50 "bench.link_table --measure" "$python" -m bench.link_table --measure --blocks "$out/link_table_blocks.json" \
    --json "$out/link_table.json"
cp "$out/link_table_blocks.json" bench/link_table_blocks.json 2>/dev/null || true
"$python" -m bench.gpu_report "$out" --card "$card" --torch "$torch_version" --seconds $((SECONDS - start))
code=$?
cp bench/RESULTS.md "$out/RESULTS.md"
echo "gpu_check: done in $((SECONDS - start)) s (budget 480 s), bench/RESULTS.md updated"
exit $code
