"""The benchmark runs end to end (tiny model, one round) and writes complete, finite results.

No timing assertions: on the tiny model the times measure Python and gloo latency, nothing else.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from parallel.cli.launch import ROOT, rank_environment

ROW_NUMBERS = ("median_s", "spread", "step_ms", "efficiency", "work_ceiling", "bytes_per_step",
               "bytes_per_step_analytic", "max_abs_diff", "foreign_cores")


def test_bench_all_tiny_writes_finite_results(tmp_path):
    out = tmp_path / "results.json"
    run = subprocess.run([sys.executable, "-m", "bench", "all", "--tiny", "--runs", "1", "--json", str(out)],
                         cwd=ROOT, env=rank_environment(threads_per_rank=None), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "### efficiency" in run.stdout

    results = json.loads(out.read_text())
    assert set(results) == {"meta", "suites", "goals", "raw"}
    assert set(results["suites"]) == {"overhead", "efficiency", "diffusers-cp"}
    assert math.isfinite(results["suites"]["overhead"]["overhead"])
    ran = set()
    for table in results["suites"].values():
        for row in table["rows"]:
            ran.add(row["layout"])
            for key in ROW_NUMBERS:
                assert math.isfinite(row[key]), (row["layout"], key, row[key])
            if row["ranks"] > 1:  # every parallel layout returned the single-rank result and sent what it should
                assert row["max_abs_diff"] < 1e-4, row
                assert math.isclose(row["bytes_per_step"], row["bytes_per_step_analytic"]), row
    assert {"xdit-1", "xdit-ulysses2", "xdit-ring2", "xdit-cfg2", "diffusers-cp-ulysses2", "diffusers-cp-ring2"} <= ran
    assert {g["layout"] for g in results["goals"]} >= {"xdit-1", "xdit-ulysses2", "xdit-cfg2"}


def test_bench_model_call_tiny_prices_a_call_and_its_bytes(tmp_path):
    out = tmp_path / "model_call.json"
    run = subprocess.run([sys.executable, "-m", "bench.model_call", "--model", "tiny", "--runs", "2", "--json", str(out)],
                         cwd=ROOT, env=rank_environment(threads_per_rank=None), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(math.isfinite(result[key]) for key in ("in_process_ms", "pool_ms", "added_ms"))
    assert result["max_abs_diff"] < 1e-4
    assert 0 < result["later_call_bytes"] < result["first_call_bytes"]  # the conditioning travelled once


def test_bench_loader_call_tiny_times_both_models_of_one_file(tmp_path, comfyui_install):
    """The loader's MODEL and ComfyUI's own, built by ComfyUI from one file, timed side by side: equal answers."""
    comfy, python = comfyui_install
    out = tmp_path / "loader_call.json"
    run = subprocess.run([sys.executable, "-m", "bench.loader_call", "--tiny", "--runs", "2", "--comfyui", str(comfy),
                          "--python", str(python), "--json", str(out)],
                         cwd=ROOT, env=rank_environment(threads_per_rank=None), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(len(times) == 2 and all(math.isfinite(t) for t in times) for times in result["runs"].values())
    assert set(result["runs"]) == {"comfyui", "loader"} and result["max_abs_diff"] < 1e-4


def test_bench_quantized_storage_tiny_keeps_fp8_and_q8_0_under_055(tmp_path):
    out = tmp_path / "quantized_storage.json"
    run = subprocess.run([sys.executable, "-m", "bench.quantized_storage", "--model", "tiny", "--runs", "1",
                          "--json", str(out)],
                         cwd=ROOT, env=rank_environment(threads_per_rank=None), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows["fp8_scaled"]["storage"]) == {"float8_e4m3fn", "bfloat16"} and "Q8_0" in rows["gguf_q8_0"]["storage"]
    assert rows["fp8_scaled"]["ratio_to_bf16"] <= 0.55 and rows["gguf_q8_0"]["ratio_to_bf16"] <= 0.55
    assert all(math.isfinite(r["step_s"]) for r in rows.values())
