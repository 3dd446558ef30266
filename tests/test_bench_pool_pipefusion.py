"""The pool-overhead and PipeFusion benchmarks run end to end on the tiny model (no timing asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from parallel.cli.launch import ROOT, rank_environment


def run(module: str, out, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", module, "--json", str(out), *args], cwd=ROOT, env=rank_environment(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_pool_overhead_benchmark(tmp_path):
    report = run("bench.pool_overhead", tmp_path / "pool.json", "--model", "tiny", "--runs", "1", "--steps", "2")
    assert set(report["rows"]) == {"in-process", "pool", "pool + previews"}
    assert all(math.isfinite(row["median_s"]) for row in report["rows"].values())
    assert report["max_abs_diff"] == 0.0  # the pool computes exactly what the pipeline does
    for side in ("pool", "pool + previews"):  # the pool's time split at rank 0's steps
        row = report["rows"][side]
        assert 0 < row["steps_on_rank_s"] <= row["median_s"] and row["outside_steps_s"] >= 0


def test_pipefusion_benchmark(tmp_path):
    report = run("bench.pipefusion", tmp_path / "pf.json", "--tiny", "--runs", "1")
    rows = report["rows"]
    assert set(rows) == {"1 rank (diffusers)", "ulysses2", "pipefusion2", "pipefusion2, step by step"}
    # the flowing patches send each patch's next latents back where the step by step run broadcasts the output
    for name in ("ulysses2", "pipefusion2", "pipefusion2, step by step"):
        assert rows[name]["bytes_per_step_per_rank"] == rows[name]["bytes_analytic"]
        assert math.isfinite(rows[name]["efficiency"])
    assert rows["ulysses2"]["max_abs_diff_vs_1_rank"] < 1e-4
