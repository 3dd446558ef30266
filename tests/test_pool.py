"""The persistent pool with real processes and sockets: `python -m workers serve` + clients.

One served pool (PixArt-α, Ulysses 2) is shared by the tests in this module, in order; the tests
that kill ranks run last. Every result is compared with diffusers' single-process pipeline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.cli.launch import rank_environment
from workers.client import JobCancelledError, JobFailed, PoolClient

from xdit_test_helpers import TOLERANCE, diffusers_latents
from pool_helpers import (
    PARAMS,
    ROOT,
    free_endpoint,
    idle_client,
    pool_processes,
    reference,
    serving,
    start_serve,
    stop_serve,
    wait_gone,
)

FAMILY = "pixart-alpha"


@pytest.fixture(scope="module")
def pool(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("pool")
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs[FAMILY], endpoint, "--nproc", "2", "--ulysses-degree", "2", log=work / "serve.log")
    client, status = idle_client(endpoint)
    inputs = tiny_models.make_inputs(FAMILY)
    expected = reference(tiny_model_dirs[FAMILY], FAMILY, inputs)
    yield {"endpoint": endpoint, "client": client, "inputs": inputs, "expected": expected, "work": work,
           "process": process, "model": tiny_model_dirs[FAMILY]}
    pids = pool_processes(client.status())
    client.close()
    stop_serve(process)  # SIGTERM of serve stops every rank
    assert process.returncode == 0, (work / "serve.log").read_text()[-3000:]
    assert wait_gone(pids) == [], "processes of the pool survived SIGTERM of serve"


def assert_matches(latents, expected):
    assert (latents - expected).abs().max().item() <= TOLERANCE


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers", *args], cwd=ROOT, env=rank_environment(), capture_output=True, text=True, timeout=300)


def test_two_cli_jobs_equal_diffusers_without_reloading(pool):
    inputs_file = pool["work"] / "in.safetensors"
    save_file(pool["inputs"], inputs_file)
    rank0 = pool["client"].status()["pids"][0]
    times = []
    for i in range(2):
        output = pool["work"] / f"out{i}.safetensors"
        start = time.perf_counter()
        run = cli("sample", "--endpoint", pool["endpoint"], "--inputs", str(inputs_file), "--output", str(output),
                  "--steps", "4", "--guidance-scale", "4.5", "--height", "64", "--width", "64")
        times.append(time.perf_counter() - start)
        assert run.returncode == 0, run.stderr
        assert_matches(load_file(output)["latents"], pool["expected"])
    status = pool["client"].status()
    assert status["pids"][0] == rank0 and status["restarts"] == 0  # same processes: nothing reloaded
    assert status["jobs_done"] >= 2
    print(f"\nCLI job wall times (client start-up included): {times[0]:.2f} s, {times[1]:.2f} s")


def test_status_reports_the_contract_fields(pool):
    status = pool["client"].status()
    for key in ("state", "world_size", "ranks_alive", "jobs_done", "restarts", "model", "parallel", "memory"):
        assert key in status
    assert status["state"] == "idle" and status["world_size"] == 2 and status["ranks_alive"] == 2
    assert status["parallel"]["ulysses_degree"] == 2
    assert all(m["parameter_bytes"] > 0 and m["rss_bytes"] > 0 for m in status["memory"])
    run = cli("status", "--endpoint", pool["endpoint"], "--json")
    assert run.returncode == 0 and '"state": "idle"' in run.stdout


def test_steps_stream_with_previews(pool):
    steps = []
    latents = pool["client"].sample(pool["inputs"], PARAMS, on_step=steps.append)
    assert_matches(latents, pool["expected"])
    assert [s.params["index"] for s in steps] == [1, 2, 3, 4]
    assert all(s.params["total"] == 4 and s.tensors["preview"].shape == (1, 4, 8, 8) for s in steps)


def test_cancel_mid_job_returns_to_idle_within_one_step(pool):
    client = pool["client"]
    seen = []

    def cancel_after_three():
        return len(seen) >= 3

    with pytest.raises(JobCancelledError) as cancelled:
        client.sample(pool["inputs"], {**PARAMS, "steps": 1000}, on_step=seen.append, should_cancel=cancel_after_three)
    assert cancelled.value.step <= seen[-1].params["index"] + 2
    assert client.status()["state"] == "idle"
    assert_matches(client.sample(pool["inputs"], PARAMS), pool["expected"])


def test_several_clients_are_served_fifo(pool):
    results, order = {}, []
    lock = threading.Lock()

    def run(i):
        with PoolClient(pool["endpoint"]) as client:
            latents = client.sample(pool["inputs"], {**PARAMS, "steps": 4 if i else 200})
            with lock:
                results[i] = latents
                order.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    threads[0].start()
    time.sleep(0.3)  # job 0 (longer) is running when the others arrive
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert order[0] == 0 and sorted(order) == [0, 1, 2]
    for i in (1, 2):
        assert_matches(results[i], pool["expected"])


def test_bad_jobs_get_one_clear_error_and_change_nothing(pool):
    client = pool["client"]
    bad = dict(pool["inputs"], latents=torch.randn(1, 4, 9, 8))
    with pytest.raises(JobFailed, match=r"latents have shape \[1, 4, 9, 8\] but .* needs \[1, 4, 8, 8\]"):
        client.sample(bad, PARAMS)
    with pytest.raises(JobFailed, match="scheduler 'flow-euler' does not fit"):
        client.sample(pool["inputs"], {**PARAMS, "scheduler": "flow-euler"})
    with pytest.raises(JobFailed, match="do not split over sequence-parallel degree 2"):
        client.sample(dict(pool["inputs"], latents=torch.randn(1, 4, 6, 6)), {**PARAMS, "height": 48, "width": 48, "steps": 2})
    assert client.status()["restarts"] == 0
    assert_matches(client.sample(pool["inputs"], PARAMS), pool["expected"])


def test_other_schedulers_through_the_pool(pool, tiny_model_dirs):
    latents = pool["client"].sample(pool["inputs"], {**PARAMS, "scheduler": "ddim"})
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, scheduler="ddim", **pool["inputs"], num_inference_steps=4,
                                 guidance_scale=4.5, height=64, width=64)
    assert_matches(latents, expected)
    assert_matches(pool["client"].sample(pool["inputs"], PARAMS), pool["expected"])  # back to the default


def _kill_rank(status: dict, rank: int) -> None:
    os.kill(status["pids"][rank], signal.SIGKILL)


def _wait_restarted(client: PoolClient, before: dict, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.wait_until_idle(timeout_s)
        if status["restarts"] > before["restarts"]:
            return status
        time.sleep(0.1)
    raise AssertionError(f"the pool did not restart: {status}")


def test_kill_rank_while_idle_restarts_the_pool(pool):
    client = pool["client"]
    before = client.status()
    _kill_rank(before, 1)
    status = _wait_restarted(client, before)
    assert status["pids"] != before["pids"] and status["ranks_alive"] == 2
    assert_matches(client.sample(pool["inputs"], PARAMS), pool["expected"])


def test_kill_rank_while_busy_fails_the_job_naming_the_rank(pool):
    client = pool["client"]
    before = client.status()
    seen = []

    def kill_at_step_three(message):
        seen.append(message)
        if len(seen) == 3:
            _kill_rank(before, 1)

    with pytest.raises(JobFailed, match=r"rank 1 \(pid \d+\) died"):
        client.sample(pool["inputs"], {**PARAMS, "steps": 1000}, on_step=kill_at_step_three)
    _wait_restarted(client, before)
    assert_matches(client.sample(pool["inputs"], PARAMS), pool["expected"])


def test_client_stop_and_one_shot_sample_leave_no_process(tiny_model_dirs, tmp_path):
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs["flux"], endpoint, "--nproc", "2", "--ring-degree", "2", log=tmp_path / "serve.log")
    client, status = idle_client(endpoint)
    pids = pool_processes(status)
    assert cli("stop", "--endpoint", endpoint).returncode == 0
    process.wait(30)
    client.close()
    assert wait_gone(pids) == []

    inputs_file = tmp_path / "in.safetensors"
    inputs = tiny_models.make_inputs("flux")
    save_file(inputs, inputs_file)
    output = tmp_path / "out.safetensors"
    run = cli("sample", "--model", str(tiny_model_dirs["flux"]), "--nproc", "2", "--ulysses-degree", "2",
              "--threads-per-rank", "1", "--inputs", str(inputs_file), "--output", str(output),
              "--steps", "4", "--guidance-scale", "3.5", "--height", "64", "--width", "64")
    assert run.returncode == 0, run.stderr[-3000:]
    flux_params = {**PARAMS, "guidance_scale": 3.5}
    assert_matches(load_file(output)["latents"], reference(tiny_model_dirs["flux"], "flux", inputs, flux_params))
    leftovers = subprocess.run(["pgrep", "-f", f"workers.rank --model {tiny_model_dirs['flux']}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


def test_sigkill_of_serve_leaves_no_orphans(tiny_model_dirs, tmp_path):
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs["sd3"], endpoint, "--nproc", "2", "--cfg-parallel", log=tmp_path / "serve.log")
    client, status = idle_client(endpoint)
    pids = pool_processes(status)
    client.close()
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    assert wait_gone(pids, 20) == [], "ranks outlived a SIGKILLed serve"


def test_text_encoding_on_the_pool_equals_the_pipelines_encode_prompt(tiny_model_dirs, tmp_path):
    from diffusers import DiffusionPipeline

    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs["flux"], endpoint, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders",
                          log=tmp_path / "serve.log")
    try:
        client, status = idle_client(endpoint)
        assert status["pipeline"] == "FluxPipeline" and status["inputs"]["pooled_prompt_embeds"] == 16
        encoded = client.encode("a red fox in the snow")
        pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs["flux"])
        with torch.no_grad():
            embeds, pooled, _ = pipeline.encode_prompt("a red fox in the snow", None)
        assert torch.equal(encoded["prompt_embeds"], embeds) and torch.equal(encoded["pooled_prompt_embeds"], pooled)
        client.close()
    finally:
        stop_serve(process)


@pytest.mark.parametrize("family, layout", [("sd3", ("--ring-degree", "2")), ("flux", ("--ulysses-degree", "2")),
                                            ("pixart-sigma", ("--cfg-parallel",)), ("z-image", ("--ulysses-degree", "2")),
                                            ("qwen-image", ("--ring-degree", "2")), ("flux2-klein", ("--ulysses-degree", "2"))])
def test_img2img_on_the_pool_equals_the_same_schedule_in_one_process(tiny_model_dirs, tmp_path, family, layout):
    """denoise < 1: the last `steps` of a steps/denoise schedule from noised init latents, computed in
    one process with the unwrapped pipeline (same sigmas/timesteps and start) as the reference."""
    import copy

    from diffusers import DiffusionPipeline

    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs[family], endpoint, "--nproc", "2", *layout, log=tmp_path / "serve.log")
    try:
        client, _ = idle_client(endpoint)
        inputs = tiny_models.make_inputs(family)
        init = tiny_models.make_inputs(family, seed=5)["latents"]
        guidance = tiny_models.MODELS[family].guidance
        params = {**PARAMS, "guidance_scale": guidance, "denoise": 0.5}
        parallel = client.sample({**inputs, "init_latents": init}, params)
        full = client.sample(inputs, {**params, "denoise": 1.0})
        client.close()
    finally:
        stop_serve(process)

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs[family])
    steps, total = 4, 8
    scheduler = copy.deepcopy(pipeline.scheduler)
    extra = {}
    if family == "pixart-sigma":
        scheduler.set_timesteps(total)
        timesteps = scheduler.timesteps[total - steps:]
        start = scheduler.add_noise(init, inputs["latents"], timesteps[:1])
        extra["timesteps"] = timesteps.tolist()
    else:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        if family == "z-image":  # its own sigmas, the scheduler's static shift
            sigmas, shift = np.linspace(1.0, 1 / total, total)[total - steps:], {}
        elif family in ("flux", "qwen-image"):  # the pipelines' own sigmas, shifted for 16 image tokens
            sigmas = np.linspace(1.0, 1 / total, total)[total - steps:]
            c = scheduler.config
            shift = {"mu": calculate_shift(16, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)}
        elif family == "flux2-klein":  # FLUX.2's empirical shift of the tokens and the steps the call runs
            from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

            sigmas, shift = np.linspace(1.0, 1 / total, total)[total - steps:], {"mu": compute_empirical_mu(16, steps)}
        else:
            sigmas = np.linspace(scheduler.sigma_max, scheduler.sigma_min, total)[total - steps:]
            shift = {}
        scheduler.set_timesteps(sigmas=sigmas, **shift)
        sigma = scheduler.sigmas[0]
        start = sigma * inputs["latents"] + (1 - sigma) * init
        extra["sigmas"] = sigmas.tolist()
    expected = diffusers_latents(pipeline, family, **{**inputs, "latents": start}, **extra, num_inference_steps=steps,
                                 guidance_scale=guidance, height=64, width=64)
    assert (parallel - expected).abs().max().item() <= TOLERANCE
    if family == "flux2-klein":  # [klein] returns its latents denormalised (the VAE's batch norm) and unpatchified
        bn = pipeline.vae.bn
        std = torch.sqrt(bn.running_var + pipeline.vae.config.batch_norm_eps).view(1, -1, 1, 1)
        init = pipeline._unpatchify_latents(init * std + bn.running_mean.view(1, -1, 1, 1))
    # img2img keeps more of the init latents than text-to-image does
    assert (parallel - init).norm() < (full - init).norm()


def test_pipefusion_pool_patches_flow_cancel_and_line_up_for_the_next_job(tiny_model_dirs, tmp_path):
    """Flux on a PipeFusion pool: the patches flow across steps (no stage waits at a step's end, the cancel check
    included), a cancel lands within two steps, and the messages the flow had in flight are taken in, so the
    next job computes exactly what the first did."""
    params = {"steps": 6, "guidance_scale": 3.5, "height": 64, "width": 64}
    inputs = tiny_models.make_inputs("flux")
    with serving(tiny_model_dirs["flux"], tmp_path, "--nproc", "2", "--pipefusion-degree", "2") as client:
        first = client.sample(inputs, params)
        seen = []
        with pytest.raises(JobCancelledError) as cancelled:
            client.sample(inputs, {**params, "steps": 1000}, on_step=seen.append, should_cancel=lambda: len(seen) >= 3)
        assert cancelled.value.step <= seen[-1].params["index"] + 2
        assert client.status()["state"] == "idle"
        assert torch.equal(client.sample(inputs, params), first)
    expected = reference(tiny_model_dirs["flux"], "flux", inputs, params)
    assert 1e-4 < ((first - expected).norm() / expected.norm()).item() < 0.05  # warm-up 1: PipeFusion's stale K/V
