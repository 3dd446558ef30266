"""Qwen-Image: text masks under sequence parallelism, and the pipeline's own text encoder on a pool.

test_engine_layouts runs the tiny Qwen-Image through every layout (true CFG as two calls; data parallel
with a batch whose second prompt is padded). Here, through real ranks: a batch-of-one prompt padded at
the end (as an encoder that pads to a fixed length hands it over) trimmed and exact under Ulysses 2,
Ring 2 and Ulysses 2 × Ring 2 with uneven image tokens (48 × 80 pixels: 15 tokens); prompts of
different lengths refused under Ulysses with one line; the pool's own Qwen2.5-VL text encoding equal to
diffusers' encode_prompt, and its job equal to diffusers.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from pool_helpers import serving
from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases

FAMILY, STEPS = "qwen-image", 4
LAYOUTS = {"ulysses2": (2, {"ulysses_degree": 2}), "ring2": (2, {"ring_degree": 2}),
           "ulysses2_ring2": (4, {"ulysses_degree": 2, "ring_degree": 2})}
HEIGHT, WIDTH = 48, 80  # 3 × 5 = 15 image tokens: uneven over 2 and 4 ranks


def padded_inputs() -> dict[str, torch.Tensor]:
    """One prompt of 11 valid tokens padded to 16, its negative of 9."""
    inputs = tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH)
    for name, valid in (("prompt_embeds_mask", 11), ("negative_prompt_embeds_mask", 9)):
        inputs[name] = (torch.arange(16) < valid).long()[None]
    return inputs


def call(**extra) -> dict:
    return {"num_inference_steps": STEPS, "height": HEIGHT, "width": WIDTH, **extra}


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen")
    inputs = work / "padded.safetensors"
    save_file(padded_inputs(), inputs)
    batch = work / "batch.safetensors"
    save_file(tiny_models.make_inputs(FAMILY, batch=2, height=HEIGHT, width=WIDTH), batch)
    cases = {name: (nproc, layout, inputs) for name, (nproc, layout) in LAYOUTS.items()}
    cases["ulysses2-batch"] = (2, {"ulysses_degree": 2}, batch)
    for nproc in (2, 4):
        specs = [{"name": name, "model": str(tiny_model_dirs[FAMILY]), "inputs": str(path), "layout": layout,
                  "output": str(work / f"{name}.safetensors"), "call": call()}
                 for name, (n, layout, path) in cases.items() if n == nproc]
        run_engine_cases(nproc, specs, work)
    return work, inputs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_prompt_is_trimmed_and_exact(runs, tiny_model_dirs, layout):
    work, inputs = runs
    errors = case_errors(work / f"{layout}.safetensors")
    assert not errors, errors[-3000:]
    parallel = load_file(work / f"{layout}.safetensors")["latents"]
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(inputs), **call())
    assert (parallel - expected).abs().max().item() <= TOLERANCE


def test_the_padding_is_masked_not_ignored(runs, tiny_model_dirs):
    """Negative control: the same embeddings with every token valid give another result."""
    _, inputs = runs
    unmasked = {**load_file(inputs), "prompt_embeds_mask": torch.ones(1, 16, dtype=torch.long)}
    masked = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(inputs), **call())
    assert (diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **unmasked, **call()) - masked).abs().max() > 100 * TOLERANCE


def test_prompts_of_different_lengths_are_refused_under_ulysses(runs):
    work, _ = runs
    errors = case_errors(work / "ulysses2-batch.safetensors")
    assert "\nparallel.layout.config.LayoutError: prompt_embeds_mask pads the shorter prompts of this batch" in errors, errors


def test_the_pools_text_encoder_matches_diffusers(tiny_model_dirs, tmp_path):
    from diffusers import DiffusionPipeline

    with serving(tiny_model_dirs[FAMILY], tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders") as client:
        encoded = client.encode("a red fox in the snow")
        pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs[FAMILY])
        embeds, _ = pipeline.encode_prompt("a red fox in the snow", device="cpu")
        assert torch.equal(encoded["prompt_embeds"], embeds)
        inputs = {**tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH), "prompt_embeds": embeds}
        del inputs["prompt_embeds_mask"]
        latents = client.sample(inputs, {"steps": STEPS, "guidance_scale": 1.0, "height": HEIGHT, "width": WIDTH})
        expected = diffusers_latents(pipeline, FAMILY, **inputs, **call())
        assert (latents - expected).abs().max().item() <= TOLERANCE
