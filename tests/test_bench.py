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


def test_an_emulated_link_delays_a_collective_by_its_bytes_and_hides_behind_compute():
    """bench/emulated_link.py on a real (one-rank gloo) group: a collective waited on at once takes the link's time for
    its bytes, stretched by `scale`; an asynchronous one started before compute that outlasts it costs nothing at its
    wait; outside `emulating` nothing is delayed."""
    import time

    import torch
    import torch.distributed as dist

    from bench.emulated_link import emulating, link_for

    link = link_for("10gbe", gpu_tflops=2.0, own_tflops=0.5)
    assert link.scale == 4.0 and math.isclose(link.delay(1.25e6, messages=2), (2 * 30e-6 + 1e-3) * 4.0)
    tensor = torch.zeros(12_500_000 // 4)  # 12.5 MB: 10 ms on 10 GbE, 40 ms stretched
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def seconds(call) -> float:
            start = time.perf_counter()
            call()
            return time.perf_counter() - start

        def overlapped() -> None:  # start the transfer, compute for longer than it takes, then wait for it
            work = dist.broadcast(tensor, src=0, async_op=True)
            time.sleep(compute)
            work.wait()

        compute = link.delay(tensor.nbytes) + 0.02
        with emulating(link):
            waited = seconds(lambda: dist.broadcast(tensor, src=0))
            hidden = seconds(overlapped) - compute
        plain = seconds(lambda: dist.broadcast(tensor, src=0))
    finally:
        dist.destroy_process_group()
    assert waited >= link.delay(tensor.nbytes) > 0.04 and hidden < 0.01 and plain < 0.01, (waited, hidden, plain)


def test_bench_under_an_emulated_link_records_it_and_keeps_the_results(tmp_path):
    out = tmp_path / "results.json"
    run = subprocess.run([sys.executable, "-m", "bench", "efficiency", "--tiny", "--runs", "1", "--link", "10gbe",
                          "--gpu-tflops", "0.5", "--json", str(out)],
                         cwd=ROOT, env=rank_environment(threads_per_rank=None), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    meta = results["meta"]
    assert meta["link"]["name"] == "10gbe" and math.isclose(meta["link"]["scale"], 0.5 / meta["cpu_tflops"])
    rows = {row["layout"]: row for row in results["suites"]["efficiency"]["rows"]}
    assert rows["xdit-ulysses2"]["max_abs_diff"] < 1e-4 and rows["xdit-ring2"]["max_abs_diff"] < 1e-4  # time, not results


def test_layout_auto_under_an_emulated_link_predicts_for_it(tmp_path):
    """bench.layout_auto --link: every layout timed under the emulated link and predicted for that link, stretched
    alike (not probed), each prediction beside its clock."""
    out = tmp_path / "auto.json"
    run = subprocess.run([sys.executable, "-m", "bench.layout_auto", "--tiny", "--runs", "1", "--steps", "2",
                          "--link", "25gbe", "--gpu-tflops", "1", "--json", str(out)],
                         cwd=ROOT, env=rank_environment(threads_per_rank=None), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    link = result["emulated_link"]
    assert link["name"] == "25gbe" and math.isclose(link["scale"], 1 / result["cpu_tflops"])
    assert result["links"].startswith("links (given)") and f"{3.1e9 / link['scale'] / 1e9:.3g} GB/s" in result["links"]
    assert all(row["measured_s"] > 0 and row["step_s"] > 0 for row in result["layouts"])
    assert "timed under 25gbe emulated" in run.stdout


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
