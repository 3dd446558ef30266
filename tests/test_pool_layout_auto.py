"""`--layout auto` on the pool: the layout chosen per job size, shown in status, the results exact.

One served pool (the tiny Flux, 2 ranks) told its link runs at 100 kB/s: the first job of a size measures the
compute and chooses PipeFusion (the traffic decides at that rate), the same size again reuses the choice without
measuring, a batch of two with true CFG (where DP and CFG parallel become valid and move no activations) chooses
again, and every job equals diffusers. Status and `python -m workers status` show the prediction table.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from parallel.loading import tiny_models
from parallel.cli.launch import rank_environment

from xdit_test_helpers import TOLERANCE
from pool_helpers import ROOT, reference, serving

FAMILY = "flux"
PARAMS = {"steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64}


@pytest.fixture(scope="module")
def auto_pool(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("auto-pool")
    with serving(tiny_model_dirs[FAMILY], work, "--nproc", "2", "--layout", "auto", "--link", "0.0001,10000",
                 "--warmup-steps", "4") as client:
        yield client, work


def test_status_before_any_job_shows_the_start_layout(auto_pool):
    status = auto_pool[0].status()
    assert status["layout_auto"]["link"] == "0.0001,10000" and status["layout_auto"]["last"] is None
    # the tiny Flux has 2 heads: Ulysses over both ranks
    assert status["parallel"]["ulysses_degree"] == 2 and status["layout_auto"]["current"] == "ulysses=2"


def test_each_job_size_chooses_once_and_every_job_is_exact(auto_pool, tiny_model_dirs):
    client, work = auto_pool
    inputs = tiny_models.make_inputs(FAMILY, negative=False)
    expected = reference(tiny_model_dirs[FAMILY], FAMILY, inputs, PARAMS)
    for _ in range(2):
        latents = client.sample(inputs, PARAMS)
        assert (latents - expected).abs().max().item() <= TOLERANCE
    status = client.status()
    auto = status["layout_auto"]
    assert [c["job"] for c in auto["choices"]] == ["64x64, batch 1, 4 steps"]  # measured once for both jobs
    assert auto["last"]["layout"] == "pipefusion=2" == status["parallel"]["description"]
    rows = auto["last"]["predictions"]
    assert [r["layout"] for r in rows][0] == "pipefusion=2" and len(rows) == 3  # Ulysses, Ring, PipeFusion
    assert all(a["step_s"] <= b["step_s"] for a, b in zip(rows, rows[1:]))  # fastest first
    assert auto["last"]["table"][0].startswith("links (given)")
    assert "layout auto for 64x64, batch 1, 4 steps chose [pipefusion=2]" in (work / "serve.log").read_text()

    # another size: a batch of two with true CFG; DP 2 and CFG 2 now run too and send no activations
    call = {"true_cfg_scale": 2.0}
    params = {**PARAMS, "call": call}
    batch = tiny_models.make_inputs(FAMILY, batch=2, seed=1)
    latents = client.sample(batch, params)
    assert (latents - reference(tiny_model_dirs[FAMILY], FAMILY, batch, params)).abs().max().item() <= TOLERANCE
    auto = client.status()["layout_auto"]
    assert len(auto["choices"]) == 2 and auto["last"]["job"] == "64x64, batch 2, 4 steps, CFG"
    assert len(auto["last"]["predictions"]) == 5 and auto["last"]["layout"] in ("dp=2", "cfg=2")

    # the first size again: no new measurement, the layout switches back
    assert (client.sample(inputs, PARAMS) - expected).abs().max().item() <= TOLERANCE
    status = client.status()
    assert len(status["layout_auto"]["choices"]) == 2 and status["parallel"]["description"] == "pipefusion=2"


def test_status_command_prints_the_table(auto_pool):
    client, _ = auto_pool
    run = subprocess.run([sys.executable, "-m", "workers", "status", "--endpoint", client.endpoint], cwd=ROOT,
                         env=rank_environment(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "layout_auto: link 0.0001,10000, now pipefusion=2" in run.stdout
    assert "chose [pipefusion=2] for 64x64, batch 1, 4 steps" in run.stdout and "ms/step" in run.stdout


def test_degrees_with_layout_auto_are_one_error_line(tiny_model_dirs):
    run = subprocess.run([sys.executable, "-m", "workers", "serve", "--model", str(tiny_model_dirs[FAMILY]),
                          "--endpoint", "tcp://127.0.0.1:1", "--nproc", "2", "--layout", "auto", "--ring-degree", "2"],
                         cwd=ROOT, env=rank_environment(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0
    assert run.stderr.startswith("error: --layout auto chooses the degrees itself")
