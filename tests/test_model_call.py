"""Single model calls on real pools (what xDiT Model sends for ComfyUI's samplers), against diffusers.

A sampler that steps on the client and asks the pool for each prediction (Euler on flow matching, CFG
with cond and uncond batched in one call, as ComfyUI batches them) must reproduce diffusers' own
single-process pipeline within 1e-4 on every layout that takes model calls; conditioning travels once.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline

from parallel.loading import tiny_models
from workers.client import JobFailed
from workers.rank.conditioning import key_of

from pool_helpers import serving
from xdit_test_helpers import TOLERANCE

STEPS, SIZE, GUIDANCE = 3, 64, 4.5
LAYOUTS = {
    "ulysses2": ("--nproc", "2", "--ulysses-degree", "2"),
    "ring2": ("--nproc", "2", "--ring-degree", "2"),
    "cfg2": ("--nproc", "2", "--cfg-parallel"),
    "dp2": ("--nproc", "2", "--dp-degree", "2"),
}


def _pipeline_result(model_dir, family: str, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' latents (unpacked, [B, C, h, w]) and the sigmas its scheduler stepped through."""
    pipe = DiffusionPipeline.from_pretrained(model_dir)
    call = {"num_inference_steps": STEPS, "height": SIZE, "width": SIZE, "output_type": "latent", "return_dict": False}
    with torch.no_grad():
        if family == "flux":
            latents = pipe(latents=inputs["packed"], prompt_embeds=inputs["prompt_embeds"],
                           pooled_prompt_embeds=inputs["pooled_prompt_embeds"], guidance_scale=3.5, **call)[0]
            latents = pipe._unpack_latents(latents, SIZE, SIZE, pipe.vae_scale_factor)
        elif family == "qwen-image":  # one branch: the pipeline's true CFG rescales norms, ComfyUI's CFG does not
            latents = pipe(latents=inputs["packed"], prompt_embeds=inputs["prompt_embeds"],
                           prompt_embeds_mask=inputs["prompt_embeds_mask"], **call)[0]
            latents = pipe._unpack_latents(latents, SIZE, SIZE, pipe.vae_scale_factor)[:, :, 0]
        else:
            latents = pipe(latents=inputs["latents"], guidance_scale=GUIDANCE,
                           **{k: v for k, v in inputs.items() if "embeds" in k}, **call)[0]
    return latents, pipe.scheduler.sigmas.clone()


def _inputs(family: str, batch: int = 1) -> dict:
    inputs = tiny_models.make_inputs(family, batch=batch, height=SIZE, width=SIZE, seed=5, negative=family == "sd3")
    if family != "sd3":
        inputs["packed"] = inputs["latents"]  # what FluxPipeline takes; the pool takes them unpacked
        inputs["latents"] = _unpack(inputs["packed"])
    return inputs


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    from parallel.families.base import unpack_2x2

    return unpack_2x2(packed, SIZE, SIZE)


def _euler_on_pool(client, family: str, inputs: dict, sigmas: torch.Tensor) -> torch.Tensor:
    """Euler steps on the client, each prediction one pool call; SD3 with CFG (uncond, cond batched)."""
    x = inputs["latents"].clone()
    batch = x.shape[0]
    if family == "flux":
        conditioning = {"prompt_embeds": inputs["prompt_embeds"], "pooled_prompt_embeds": inputs["pooled_prompt_embeds"],
                        "guidance": torch.full((batch,), 3.5)}
    elif family == "qwen-image":
        conditioning = {"prompt_embeds": inputs["prompt_embeds"]}
    else:
        conditioning = {"prompt_embeds": torch.cat([inputs["negative_prompt_embeds"], inputs["prompt_embeds"]]),
                        "pooled_prompt_embeds": torch.cat([inputs["negative_pooled_prompt_embeds"], inputs["pooled_prompt_embeds"]])}
    for sigma, following in zip(sigmas[:-1], sigmas[1:]):
        if family != "sd3":
            v = client.evaluate({"latents": x, "sigma": sigma.repeat(batch)}, conditioning)["prediction"]
        else:
            uncond, cond = client.evaluate({"latents": torch.cat([x, x]), "sigma": sigma.repeat(2 * batch)}, conditioning)["prediction"].chunk(2)
            v = uncond + GUIDANCE * (cond - uncond)
        x = x + (following - sigma) * v
    return x


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    out = {}
    for family, batch in (("sd3", 1), ("sd3", 2), ("flux", 1), ("qwen-image", 1)):
        inputs = _inputs(family, batch)
        out[family, batch] = (inputs, *_pipeline_result(tiny_model_dirs[family], family, inputs))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sampler_stepping_on_the_client_equals_diffusers(tiny_model_dirs, references, tmp_path, layout):
    batch = 2 if layout == "dp2" else 1
    inputs, expected, sigmas = references["sd3", batch]
    with serving(tiny_model_dirs["sd3"], tmp_path, *LAYOUTS[layout]) as client:
        result = _euler_on_pool(client, "sd3", inputs, sigmas)
        assert client.status()["model_calls"] == STEPS
    assert (result - expected).abs().max().item() < TOLERANCE
    wrong = dict(inputs, prompt_embeds=inputs["negative_prompt_embeds"])  # negative control: must not match
    assert (_euler_on_reference(tiny_model_dirs["sd3"], wrong, sigmas) - expected).abs().max().item() > 1e-2


def _euler_on_reference(model_dir, inputs, sigmas) -> torch.Tensor:
    """The same client-side loop against diffusers' transformer in this process (for the negative control)."""
    transformer = DiffusionPipeline.from_pretrained(model_dir).transformer

    class InProcess:
        @staticmethod
        def evaluate(tensors, conditioning):
            with torch.no_grad():
                return {"prediction": transformer(
                    hidden_states=tensors["latents"], timestep=tensors["sigma"] * 1000,
                    encoder_hidden_states=conditioning["prompt_embeds"],
                    pooled_projections=conditioning["pooled_prompt_embeds"], return_dict=False)[0]}

    return _euler_on_pool(InProcess, "sd3", inputs, sigmas)


def test_flux_calls_and_conditioning_that_travels_once(tiny_model_dirs, references, tmp_path):
    inputs, expected, sigmas = references["flux", 1]
    with serving(tiny_model_dirs["flux"], tmp_path, *LAYOUTS["ulysses2"]) as client:
        result = _euler_on_pool(client, "flux", inputs, sigmas)
        assert (result - expected).abs().max().item() < TOLERANCE
        # the last call sent only latents and sigma: the conditioning went with the first call alone
        assert client.last_call_bytes == inputs["latents"].nbytes + 4

        # a pool that no longer holds a key (evicted, restarted) says so, and the client sends it again
        fresh = {"prompt_embeds": inputs["prompt_embeds"] + 1, "pooled_prompt_embeds": inputs["pooled_prompt_embeds"],
                 "guidance": torch.full((1,), 3.5)}
        client._held.add(key_of(fresh["prompt_embeds"]))
        call = {"latents": inputs["latents"], "sigma": sigmas[:1]}
        again = client.evaluate(call, fresh)["prediction"]
        assert client.last_call_bytes > inputs["latents"].nbytes + fresh["prompt_embeds"].nbytes
        assert torch.equal(client.evaluate(call, fresh)["prediction"], again)

        with pytest.raises(JobFailed, match=r"latents have shape \[1, 4, 8, 8\]; FluxPipeline takes \[batch, 16"):
            client.evaluate({"latents": torch.zeros(1, 4, 8, 8), "sigma": sigmas[:1]}, fresh)
        with pytest.raises(JobFailed, match="has distilled guidance: send 'guidance'"):
            client.evaluate(call, {k: v for k, v in fresh.items() if k != "guidance"})
        with pytest.raises(JobFailed, match="does not hash to its key"):
            client._held.clear()
            planted = dict(fresh, pooled_prompt_embeds=fresh["pooled_prompt_embeds"] * 2)
            client.send = _planting(client.send, key_of(fresh["pooled_prompt_embeds"]))
            client.evaluate(call, planted)


def _planting(send, key: str):
    """A client that sends a tensor under another tensor's key."""
    def planted(message):
        message.params["conditioning"]["pooled_prompt_embeds"] = key
        return send(message)

    return planted


def test_qwen_image_calls_on_a_ulysses_pool_equal_diffusers(tiny_model_dirs, references, tmp_path):
    inputs, expected, sigmas = references["qwen-image", 1]
    with serving(tiny_model_dirs["qwen-image"], tmp_path, *LAYOUTS["ulysses2"]) as client:
        result = _euler_on_pool(client, "qwen-image", inputs, sigmas)
    assert (result - expected).abs().max().item() < TOLERANCE


def test_pipefusion_pools_refuse_model_calls(tiny_model_dirs, references, tmp_path):
    inputs, _, sigmas = references["sd3", 1]
    with serving(tiny_model_dirs["sd3"], tmp_path, "--nproc", "2", "--pipefusion-degree", "2") as client:
        with pytest.raises(JobFailed, match="PipeFusion pipelines patches across the steps.*pipefusion degree 1"):
            client.evaluate({"latents": inputs["latents"], "sigma": sigmas[:1]},
                            {"prompt_embeds": inputs["prompt_embeds"], "pooled_prompt_embeds": inputs["pooled_prompt_embeds"]})
        assert client.status()["state"] == "idle"


def test_every_rank_keeps_the_conditioning_rank_0_leaves_out():
    """RankConditioning: copies fed the same calls agree on what is held, so rank 0 sends a prompt once and
    every rank fills it back in; evicted conditioning travels again; a rank that lost a copy fails loudly."""
    from workers.rank.conditioning import RankConditioning

    prompts = [torch.randn(1, 4, 8) + i for i in range(3)]
    rank0, rank1 = RankConditioning(max_entries=2), RankConditioning(max_entries=2)

    def call(prompt):
        keys, tensors = {"prompt_embeds": key_of(prompt)}, {"latents": torch.zeros(1, 2), "prompt_embeds": prompt}
        sent = rank0.to_send(keys, tensors)
        got = [copy.on_device(keys, sent, torch.device("cpu"), torch.float64) for copy in (rank0, rank1)]
        for out in got:
            assert out["prompt_embeds"].dtype == torch.float64 and torch.equal(out["prompt_embeds"], prompt.double())
        return set(sent)

    assert call(prompts[0]) == {"latents", "prompt_embeds"}  # new: it travels
    assert call(prompts[0]) == {"latents"}  # held by every rank: left out
    call(prompts[1]), call(prompts[2])  # two newer prompts evict the first (two entries at most)
    assert call(prompts[0]) == {"latents", "prompt_embeds"}
    with pytest.raises(RuntimeError, match="does not hold conditioning 'prompt_embeds'"):
        RankConditioning().on_device({"prompt_embeds": key_of(prompts[0])}, {}, torch.device("cpu"), torch.float32)
