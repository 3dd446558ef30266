"""FLUX.2 [klein] and [dev]: uneven image tokens with 4-axis rotary ids, and the Qwen3 text encoder on a pool.

test_engine_layouts runs the tiny [klein] base model through every layout (real CFG as two calls). Here:
contract E on 48 × 80 pixels (15 image tokens: uneven over 2 ranks) under Ulysses 2 and Ring 2 equals
diffusers' single-process Flux2KleinPipeline within 1e-4; the pool's text encoding (three stacked Qwen3
layers, padded to 512 tokens as the pipeline pads them) equals diffusers' encode_prompt, and a job with it
equals diffusers; two reference images (`image`, their tokens split with the image's) equal diffusers given the
same images; a guidance-distilled [klein] refuses CFG parallel in one line. FLUX.2 [dev] (distilled
guidance embedded, Mistral 3 text, packed latents out) on the same uneven tokens under Ulysses 2 equals
diffusers' Flux2Pipeline, its guidance_scale reaching the guidance embedder; it refuses CFG parallel in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from pool_helpers import serving
from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun

FAMILY, STEPS, GUIDANCE = "flux2-klein", 4, 4.0
HEIGHT, WIDTH = 48, 80
CALL = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH}


def _engine(model, inputs, output, *flags):
    return torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                    "--steps", str(STEPS), "--guidance-scale", str(GUIDANCE), "--height", str(HEIGHT),
                    "--width", str(WIDTH), *flags)


@pytest.mark.parametrize("flags", [("--ulysses-degree", "2"), ("--ring-degree", "2")], ids=["ulysses2", "ring2"])
def test_uneven_tokens_equal_diffusers(tiny_model_dirs, tmp_path, flags):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH), inputs)
    run = _engine(tiny_model_dirs[FAMILY], inputs, output, *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(inputs), **CALL)
    assert expected.shape == (1, 32, HEIGHT // 8, WIDTH // 8)  # what the pipeline returns: unpatchified
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("flags", [("--ulysses-degree", "2"), ("--ring-degree", "2")], ids=["ulysses2", "ring2"])
def test_reference_images_are_split_with_the_image(tiny_model_dirs, tmp_path, flags):
    """Two 64×64 references (16 tokens each; FLUX.2 takes none under 64 px) after the 15 image tokens: 47 tokens,
    uneven over 2 ranks; equal to
    diffusers given the same references as PIL images, and different from the run without them."""
    from parallel.families.flux2 import reference_images

    references = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    plain = tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH)
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({**plain, "image": references}, inputs)
    run = _engine(tiny_model_dirs[FAMILY], inputs, output, *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    got = load_file(output)["latents"]
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **plain, image=reference_images(references), **CALL)
    assert (got - expected).abs().max().item() <= TOLERANCE
    without = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **plain, **CALL)
    assert (got - without).abs().max().item() > 10 * TOLERANCE  # the references take part


def test_pipefusion_refuses_reference_images_in_one_line(tiny_model_dirs, tmp_path):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({**tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH), "image": torch.rand(1, 3, 64, 64)}, inputs)
    run = _engine(tiny_model_dirs[FAMILY], inputs, output, "--pipefusion-degree", "2", "--warmup-steps", str(STEPS))
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1 and "PipeFusion does not take FLUX.2 reference images" in errors[0]


def test_flux2_dev_uneven_tokens_and_its_distilled_guidance(tiny_model_dirs, tmp_path):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs("flux2-dev", height=HEIGHT, width=WIDTH), inputs)
    model = tiny_model_dirs["flux2-dev"]
    run = torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                   "--steps", str(STEPS), "--guidance-scale", "2.5", "--height", str(HEIGHT), "--width", str(WIDTH),
                   "--ulysses-degree", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    got = load_file(output)["latents"]
    expected = diffusers_latents(model, "flux2-dev", **load_file(inputs), **{**CALL, "guidance_scale": 2.5})
    assert got.shape == expected.shape == (1, HEIGHT // 16 * WIDTH // 16, 128)  # packed, as Flux2Pipeline returns it
    assert (got - expected).abs().max().item() <= TOLERANCE
    other = diffusers_latents(model, "flux2-dev", **load_file(inputs), **CALL)  # guidance 4
    assert (got - other).abs().max().item() > 10 * TOLERANCE
    refused = torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                       "--steps", "2", "--height", str(HEIGHT), "--width", str(WIDTH), "--cfg-parallel")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode != 0 and len(errors) == 1 and "FLUX.2 [dev] is guidance-distilled" in errors[0]


def test_a_distilled_klein_refuses_cfg_parallel(tiny_model_dirs, tmp_path):
    distilled = tmp_path / "distilled"
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs[FAMILY])
    pipeline.register_to_config(is_distilled=True)
    pipeline.save_pretrained(distilled)
    assert json.loads((distilled / "model_index.json").read_text())["is_distilled"] is True
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs(FAMILY), inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(distilled), "--inputs", str(inputs), "--output", str(output),
                   "--steps", "2", "--guidance-scale", "4", "--height", "64", "--width", "64", "--cfg-parallel")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1 and "guidance-distilled" in errors[0], run.stderr[-3000:]


@pytest.mark.parametrize("family", ["flux2-klein", "flux2-dev"])
def test_the_pools_text_encoder_matches_diffusers(tiny_model_dirs, tmp_path, family):
    """Qwen3 ([klein]) and Mistral 3 ([dev]) encodings on a pool equal the pipeline's own encode_prompt."""
    from diffusers import DiffusionPipeline

    with serving(tiny_model_dirs[family], tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders") as client:
        pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs[family])
        encoded = {text: client.encode(text)["prompt_embeds"] for text in ("a red fox in the snow", "")}
        for text, embeds in encoded.items():
            assert torch.equal(embeds, pipeline.encode_prompt(text, device="cpu")[0]), text
        inputs = {"latents": tiny_models.make_inputs(family)["latents"], "prompt_embeds": encoded["a red fox in the snow"]}
        if family == "flux2-klein":
            inputs["negative_prompt_embeds"] = encoded[""]
        latents = client.sample(inputs, {"steps": STEPS, "guidance_scale": GUIDANCE, "height": 64, "width": 64})
        expected = diffusers_latents(pipeline, family, **inputs, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                                     height=64, width=64)
        assert (latents - expected).abs().max().item() <= TOLERANCE


def test_klein_model_latents_are_its_loop_latents(tiny_model_dirs):
    """[klein] returns its latents unpatchified and denormalised; asked for `model_latents` (as xDiT Sampler asks) the
    pool returns them as the pipeline's loop kept them at the last step: ComfyUI's FLUX.2 LATENT, packed."""
    from types import SimpleNamespace

    from diffusers import DiffusionPipeline

    from parallel.families.flux2 import xFuserFlux2KleinPipeline

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs[FAMILY])
    seen = {}

    def on_step_end(pipe, index, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    inputs = tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH)
    with torch.no_grad():
        out = pipeline(**inputs, **{**CALL, "num_inference_steps": 2}, output_type="latent", return_dict=False,
                       callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"])[0]
    model = xFuserFlux2KleinPipeline.model_latents(SimpleNamespace(module=pipeline), out)
    assert model.shape == seen["latents"].shape == (1, (HEIGHT // 16) * (WIDTH // 16), 128)
    assert (model - seen["latents"]).abs().max().item() <= TOLERANCE
    unnormalised = pipeline._pack_latents(pipeline._patchify_latents(out))  # the negative control
    assert (unnormalised - seen["latents"]).abs().max().item() > 100 * TOLERANCE
