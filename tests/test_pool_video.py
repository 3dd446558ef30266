"""Wan 2.2 (both experts held by every rank) on a served pool: a video job equals diffusers.

A real `python -m workers serve` pool with Ring 2 samples a 9-frame 48×48 video, whose 27 tokens
split unevenly, with `num_frames` in the job's call map; the result and the step previews are checked.
xDiT VAE Decode's job decodes the video on both ranks, equal to diffusers' tiled decode in one process with
the same tiles, and refuses an image latent with one line. Video-to-video (denoise 0.6, ComfyUI's meaning: the last 4 steps of a 6-step schedule, from the init video
noised to that point) equals diffusers with its scheduler cut the way its img2img pipelines cut it (full
schedule, later timesteps, begin index), across Wan 2.2's expert switch. A LoRA in ComfyUI's Wan layout goes
into both experts by default and into the low-noise expert alone when the job names it, each equal to
diffusers with the LoRA loaded into those experts. Then Wan 2.2's own `guidance_scale_2` (the low-noise expert's guidance) reaches the pool through the same
generic call map and the latents equal diffusers' with it (negative control: they differ from the job
without it), and a call parameter the family does not declare is refused at submit with one line.
"""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file

from parallel.loading import tiny_models
import pytest

from pool_helpers import free_endpoint, idle_client, pool_processes, reference, start_serve, stop_serve, wait_gone
from workers.client import JobFailed
from xdit_test_helpers import TOLERANCE, diffusers_latents

FAMILY = "wan22"
FRAMES, SIZE = 9, 48


def test_wan22_video_job_on_a_ring2_pool_equals_diffusers(video_model_dirs, tmp_path):
    model = video_model_dirs[FAMILY]
    endpoint = free_endpoint()
    process = start_serve(model, endpoint, "--nproc", "2", "--ring-degree", "2", log=tmp_path / "serve.log")
    client = None
    try:
        client, status = idle_client(endpoint)
        assert status["pipeline"] == "WanPipeline" and status["inputs"] == {"prompt_embeds": 32, "negative_prompt_embeds": 32}
        inputs = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE, num_frames=FRAMES)
        params = {"steps": 4, "guidance_scale": 5.0, "height": SIZE, "width": SIZE, "call": {"num_frames": FRAMES}}
        previews = []
        latents = client.sample(inputs, params, on_step=lambda message: previews.append(message.tensors["preview"].shape))
        expected = reference(model, FAMILY, inputs, params)
        assert latents.shape == expected.shape == (1, 16, 3, SIZE // 8, SIZE // 8)
        assert (latents - expected).abs().max().item() <= TOLERANCE
        assert previews == [torch.Size([1, 16, 3, SIZE // 8, SIZE // 8])] * 4

        second = {**params, "call": {"num_frames": FRAMES, "guidance_scale_2": 2.0}}
        expert_guided = client.sample(inputs, second)
        assert (expert_guided - reference(model, FAMILY, inputs, second)).abs().max().item() <= TOLERANCE
        assert (expert_guided - latents).abs().max().item() > 100 * TOLERANCE, "guidance_scale_2 must change the result"

        init = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE, num_frames=FRAMES, seed=5)["latents"]
        to_video = {**params, "denoise": 0.6}
        restyled = client.sample({**inputs, "init_latents": init}, to_video)
        assert (restyled - video_to_video_reference(model, inputs, init, to_video)).abs().max().item() <= TOLERANCE
        assert (restyled - latents).abs().max().item() > 100 * TOLERANCE, "the init video must change the result"

        lora = wan_lora(tmp_path / "wan_lora.safetensors")
        experts = {}
        for expert in ("", "transformer_2"):
            spec = {"path": lora, "strength": 0.8, **({"expert": expert} if expert else {})}
            experts[expert] = client.sample(inputs, {**params, "loras": [spec]})
            assert (experts[expert] - lora_reference(model, inputs, params, lora, 0.8, expert)).abs().max().item() <= TOLERANCE
        assert (experts[""] - experts["transformer_2"]).abs().max().item() > 100 * TOLERANCE
        assert (experts["transformer_2"] - latents).abs().max().item() > 100 * TOLERANCE

        clip = torch.randn((1, 16, 3, 16, 16), generator=torch.Generator().manual_seed(2))  # 3 × 3 tiles of 8
        decoded, info = client.decode(clip)
        assert (decoded - tiled_reference(model, clip, 2)).abs().max().item() <= TOLERANCE
        shares = [r["tiles"] for r in info["ranks"]]
        assert sum(shares) == info["tiles"] and min(shares) >= 1  # every rank decoded its share
        with pytest.raises(JobFailed, match=r"decodes 5-D latents .* with 16 channels, got \[1, 16, 16, 16\]"):
            client.decode(clip[:, :, 0])

        with pytest.raises(JobFailed) as refused:
            client.sample(inputs, {**params, "call": {"true_cfg_scale": 2.0}})
        assert "WanPipeline does not take true_cfg_scale; it takes guidance_scale_2, num_frames" in str(refused.value)
        assert "\n" not in str(refused.value)
        pids = pool_processes(client.status())
    finally:
        if client is not None:
            client.close()
        stop_serve(process)
    assert process.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert wait_gone(pids) == []


def video_to_video_reference(model, inputs: dict, init: torch.Tensor, params: dict) -> torch.Tensor:
    """diffusers' WanPipeline in one process on the last `steps` of a `steps / denoise` schedule: its
    UniPC scheduler set for the whole schedule, the first timesteps dropped and its begin index moved
    (as diffusers' img2img pipelines do), started from the init video noised to the first kept timestep."""
    pipeline = DiffusionPipeline.from_pretrained(model)
    scheduler, steps = pipeline.scheduler, params["steps"]
    total = int(steps / params["denoise"])
    own = scheduler.set_timesteps

    def last_steps(count, *args, **kwargs):
        own(total, *args, **kwargs)
        scheduler.timesteps = scheduler.timesteps[total - count:]
        scheduler.set_begin_index(total - count)

    own(total)
    start = scheduler.add_noise(init, inputs["latents"], scheduler.timesteps[total - steps:][:1])
    scheduler.set_timesteps = last_steps
    return diffusers_latents(pipeline, FAMILY, **{**inputs, "latents": start}, num_inference_steps=steps,
                             guidance_scale=params["guidance_scale"], height=params["height"], width=params["width"],
                             **params["call"])


def wan_lora(path) -> str:
    """A LoRA in the layout ComfyUI users download for Wan (diffusion_model.blocks.N.self_attn.q ...)."""
    g = torch.Generator().manual_seed(3)
    weights = {}
    for block in (0, 1):
        for layer in ("self_attn.q", "self_attn.o", "ffn.0"):
            out = 64  # the tiny Wan: inner and feed-forward widths 64
            weights[f"diffusion_model.blocks.{block}.{layer}.lora_A.weight"] = torch.randn(4, 64, generator=g) * 0.3
            weights[f"diffusion_model.blocks.{block}.{layer}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.3
    save_file(weights, path)
    return str(path)


def lora_reference(model, inputs: dict, params: dict, lora: str, strength: float, expert: str) -> torch.Tensor:
    """diffusers' WanPipeline with the LoRA loaded into both experts ("") or only into `expert`."""
    pipeline = DiffusionPipeline.from_pretrained(model)
    for name in ("transformer", "transformer_2") if not expert else (expert,):
        pipeline.load_lora_weights(lora, adapter_name=name, load_into_transformer_2=name == "transformer_2")
        getattr(pipeline, name).set_adapters([name], weights=[strength])
    return diffusers_latents(pipeline, FAMILY, **inputs, num_inference_steps=params["steps"],
                             guidance_scale=params["guidance_scale"], height=params["height"], width=params["width"],
                             **params["call"])


def tiled_reference(model, latents: torch.Tensor, world: int) -> torch.Tensor:
    """diffusers' own tiled decode in one process, with the tiles the pool chose for `world` ranks."""
    from parallel.model_executor.vae_decode import fit_tiles

    vae = DiffusionPipeline.from_pretrained(model).vae
    fit_tiles(vae, latents, world)
    with torch.no_grad():
        return vae.tiled_decode(latents, return_dict=False)[0]
