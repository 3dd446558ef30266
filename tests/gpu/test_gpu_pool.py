"""A one-rank pool on the GPU, over NCCL, in bf16, serving the FLUX.1-width model: its jobs against diffusers' own
bf16 pipeline on the same card (within 1.5× diffusers' own bf16 error from its fp32 result); its status (the card,
NCCL, no peer-to-peer to decide on one card); cancel inside a job's steps; xDiT Model's single calls (an Euler
sampler stepping on the client, each prediction one pool call) against diffusers' pipeline with the same Euler
steps; xDiT VAE Decode against the pipeline's own VAE. The pool's overhead against the same pipeline in-process
is timed by bench.pool_overhead (scripts/gpu_check.sh), not here.
"""

from __future__ import annotations

import time

import pytest
import torch

from workers.client import JobCancelledError

from conftest import FACTOR, relative_l2
from pool_helpers import serving


@pytest.fixture(scope="module")
def pool(flux_width, tmp_path_factory):
    with serving(flux_width["folder"], tmp_path_factory.mktemp("gpu_pool"), "--nproc", "1", "--dtype", "bf16") as client:
        yield client


def job_of(flux_width, steps: int | None = None) -> dict:
    m = flux_width["model"]
    return {"steps": steps or flux_width["call"]["num_inference_steps"], "guidance_scale": m.guidance_scale,
            "height": m.height, "width": m.width}


def test_a_bf16_pool_over_nccl_is_within_diffusers_own_bf16_error(pool, flux_width, record):
    status = pool.status()
    assert status["dtype"] == "bf16" and status["world_size"] == 1
    assert status["p2p"] == "n/a" and status["cards"][0]["name"] == torch.cuda.get_device_name(0)
    ours = pool.sample(flux_width["inputs"], job_of(flux_width))
    error = relative_l2(ours, flux_width["reference"]["fp32"])
    record("pool_bf16_relative_l2_from_fp32", error)
    record("diffusers_bf16_relative_l2_from_fp32", flux_width["own_error"])
    assert error <= FACTOR * flux_width["own_error"], (error, flux_width["own_error"])
    assert relative_l2(ours, flux_width["reference"]["bf16"]) <= flux_width["own_error"]


def test_cancel_lands_inside_the_job_within_two_seconds(pool, flux_width, record):
    seen, asked = [], []

    def cancel_after_first_step():
        if seen and not asked:
            asked.append(time.monotonic())
        return bool(seen)

    with pytest.raises(JobCancelledError) as cancelled:
        pool.sample(flux_width["inputs"], job_of(flux_width, steps=200), on_step=seen.append,
                    should_cancel=cancel_after_first_step)
    latency = time.monotonic() - asked[0]
    record("cancel_latency_s", latency)
    assert latency < 2.0 and cancelled.value.step <= seen[-1].params["index"] + 2
    assert pool.wait_until_idle(30)["state"] == "idle"


def test_model_calls_stepping_euler_on_the_client_equal_diffusers_euler(pool, flux_width, record):
    """xDiT Model's path: ComfyUI's sampler steps on the client and each prediction is one pool call."""
    from parallel.families.base import pack_2x2, unpack_2x2

    model, inputs = flux_width["model"], flux_width["inputs"]
    expected, sigmas = flux_width["reference"]["bf16"], flux_width["sigmas"]  # diffusers' bf16 run, its Euler steps
    x = unpack_2x2(inputs["latents"], model.height, model.width).to(torch.bfloat16)
    conditioning = {"prompt_embeds": inputs["prompt_embeds"].to(torch.bfloat16),
                    "pooled_prompt_embeds": inputs["pooled_prompt_embeds"].to(torch.bfloat16),
                    "guidance": torch.full((1,), model.guidance_scale)}
    for sigma, following in zip(sigmas[:-1], sigmas[1:]):
        v = pool.evaluate({"latents": x, "sigma": sigma.reshape(1)}, conditioning)["prediction"]
        x = (x.float() + (following - sigma) * v.float()).to(torch.bfloat16)
    ours = pack_2x2(x)
    error = relative_l2(ours, expected)
    record("model_call_euler_relative_l2_to_diffusers_bf16", error)
    assert error <= FACTOR * flux_width["own_error"]


def test_vae_decode_on_the_pool_equals_the_pipelines_vae(pool, flux_width, record):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(flux_width["folder"], subfolder="vae", torch_dtype=torch.bfloat16).to("cuda")
    latents = torch.randn(1, vae.config.latent_channels, 128, 128, generator=torch.Generator().manual_seed(0))
    images, _ = pool.decode(latents)
    with torch.no_grad():
        expected = vae.decode(latents.to("cuda", torch.bfloat16)).sample.float().cpu()
    error = relative_l2(images, expected)
    record("vae_decode_relative_l2", error)
    assert images.shape == expected.shape and error <= 1e-2
