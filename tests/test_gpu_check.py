"""The GPU check on a machine without CUDA (this one): `scripts/gpu_check.sh` says so in one line and exits 2; the
README's test command does not collect tests/gpu (so nothing there is ever skipped here); and bench/gpu_report.py
turns a check's outputs (stand-ins here) into a bench/RESULTS.md section under the card's name, replaced on a rerun.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench import gpu_report

from xdit_test_helpers import ROOT


def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_2():
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("gpu_check: no CUDA GPU here") and len(run.stderr.splitlines()) == 1


def test_the_readme_test_command_does_not_collect_tests_gpu():
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert len(collected) > 1000 and not [line for line in collected if line.startswith("tests/gpu/")]
    assert (ROOT / "tests/gpu/test_gpu_pool.py").is_file()  # it exists; it is left out, not missing


def _stand_in_outputs(folder, speedup: float) -> None:
    (folder / "junit.xml").write_text('<testsuites><testsuite name="pytest" time="95.0">'
                                      '<testcase name="test_a"/><testcase name="test_b"/></testsuite></testsuites>')
    (folder / "tests.json").write_text(json.dumps({"cancel_latency_s": 0.4, "pool_bf16_relative_l2_from_fp32": 0.011,
                                                   "diffusers_bf16_relative_l2_from_fp32": 0.010}))
    rows = {"in-process": {"median_s": 1.0, "overhead": 0.0},
            "pool": {"median_s": 1.01, "overhead": 0.01, "steps_on_rank_s": 1.002, "outside_steps_s": 0.008},
            "pool + previews": {"median_s": 1.02, "overhead": 0.02}}
    (folder / "pool_overhead.json").write_text(json.dumps({"model": "large-flux", "steps": 4, "rows": rows}))
    side = lambda step, ratio: {"step_s": step, "ratio_to_bf16": ratio, "relative_l2_to_bf16": 0.02}  # noqa: E731
    (folder / "quantized_storage.json").write_text(json.dumps({"rows": {
        "bf16": side(0.30, 1.0), "fp8_scaled": side(0.38, 0.5), "gguf_q8_0": side(0.41, 0.53),
        "fp8_matmul": side(0.30 / speedup, 0.5)}}))
    timing = lambda ms, on_card: {"ms": ms, "on_card_ms": on_card}  # noqa: E731
    projection = {"bf16": timing(0.16, 0.12), "fp8, per tensor": timing(0.34, 0.13), "_scaled_mm alone": timing(0.1, 0.07),
                  "fp8": {**timing(0.1, 0.12 / speedup), "speedup": 1.6, "speedup_on_card": speedup, "relative_l2_to_bf16": 0.019},
                  "_scaled_mm with the bias": {"error": "RuntimeError: not here"},
                  **{f"quantizer, {how}": {**timing(0.02, 0.01), "codes_differing": 0.0, "scales_equal": True}
                     for how in ("triton", "compiled", "eager")}}
    (folder / "fp8_linear.json").write_text(json.dumps({"tokens": 4608, "mode": "row", "iters": 30,
                                                        "rows": {"attention 3072→3072": projection}}))


def test_gpu_report_writes_the_cards_section_and_replaces_it_on_a_rerun(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Benchmark results\n\n## Earlier section\n\nkept\n\n{gpu_report.PLACEHOLDER}\n\nnot yet\n")
    _stand_in_outputs(tmp_path, 1.5)
    card = "NVIDIA H100 80GB HBM3"
    args = [str(tmp_path), "--card", card, "--seconds", "400", "--results", str(results)]
    assert gpu_report.main(args) == 0
    text = results.read_text()
    assert "## Earlier section\n\nkept" in text and f"## GPU check on {card}" in text and "not yet" not in text
    assert "| 1-rank pool (NCCL, bf16) vs the same pipeline in-process, large-flux, 4 steps | +1.0%" in text
    assert "rank 0's steps 1.002 s, outside them 0.008 s" in text
    assert "0.200 s vs 0.300 s: 1.50×" in text and "| tests/gpu (pytest) | 2 of 2 passed in 95 s |" in text
    assert "| bench.link_table calibrated | did not finish |" in text  # a stage without output says so
    assert "on the card | 1.50× to 1.50× (table below) | ≥ 1.3× |" in text  # bench.fp8_linear: on-card speed-up first
    assert "| attention 3072→3072 | 0.160 (0.120) | 0.100 (0.080) | 1.60× (1.50×) | 0.340 (0.130) | 0.100 (0.070) | – |" in text
    _stand_in_outputs(tmp_path, 2.0)
    assert gpu_report.main([*args[:-4], "--seconds", "500", "--results", str(results)]) == 1  # over the 8-minute budget
    again = results.read_text()
    assert again.count(f"## GPU check on {card}") == 1 and "2.00×" in again and "1.50×" not in again
