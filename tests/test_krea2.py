"""Krea 2: the joined [text; image] sequence split unevenly, text padded in the middle, Krea's own guidance.

test_engine_layouts runs the tiny model through every layout at 64² (the tiny inputs pad each prompt between its
text and its 5-token chat suffix, as Krea2Pipeline pads to 512). Here, in one engine_cases launch per world size:
48 × 80 pixels (15 image tokens) with a 24-token prompt of 22 valid tokens and a negative of 9 (joined: 37 and 24
tokens, uneven over 2 and 4 ranks) under Ulysses 2 and 4, Ring 2, Ulysses 2 × Ring 2, CFG 2, CFG 2 × Ulysses 2 and
data parallel 2 (a batch whose prompts differ in length) equal diffusers' single-process Krea2Pipeline within 1e-4;
PipeFusion 2 with warm-up = steps (guided) equals it and with warm-up 1 (unguided, as Turbo samples) stays within
its stale-K/V bound; a sequence split without exchange misses; prompts of different lengths in one batch are refused
under Ulysses in one line. The model calls of ComfyUI's samplers equal the transformer call of the pipeline's loop.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases

FAMILY, STEPS, GUIDANCE = "krea2", 4, 3.0
HEIGHT, WIDTH, TEXT = 48, 80, 24
UNEVEN = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH}
SQUARE = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": 64, "width": 64}
CASES = {  # name: (ranks, layout, inputs, call)
    "ulysses2": (2, {"ulysses_degree": 2}, "uneven", UNEVEN),
    "ring2": (2, {"ring_degree": 2}, "uneven", UNEVEN),
    "cfg2": (2, {"cfg_degree": 2}, "uneven", UNEVEN),
    "dp2": (2, {"dp_degree": 2}, "batch", UNEVEN),
    "pipefusion2": (2, {"pipefusion_degree": 2, "warmup_steps": STEPS}, "square", SQUARE),
    "pipefusion2-warmup1": (2, {"pipefusion_degree": 2, "warmup_steps": 1}, "square", {**SQUARE, "guidance_scale": 0.0}),
    "ulysses2-no-exchange": (2, {"ulysses_degree": 2}, "uneven", UNEVEN),
    "ulysses2-batch": (2, {"ulysses_degree": 2}, "batch", UNEVEN),
    "ulysses4": (4, {"ulysses_degree": 4}, "uneven", UNEVEN),
    "ulysses2_ring2": (4, {"ulysses_degree": 2, "ring_degree": 2}, "uneven", UNEVEN),
    "cfg2_ulysses2": (4, {"cfg_degree": 2, "ulysses_degree": 2}, "uneven", UNEVEN),
}
EXACT = [name for name in CASES if name not in ("pipefusion2-warmup1", "ulysses2-no-exchange", "ulysses2-batch")]


def uneven_inputs() -> dict[str, torch.Tensor]:
    """A 24-token prompt of 17 words and the 5-token suffix after 2 padding tokens; a negative of 4 and 5."""
    inputs = tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH, text_tokens=TEXT)
    position = torch.arange(TEXT)
    for name, words in (("prompt_embeds_mask", 17), ("negative_prompt_embeds_mask", 4)):
        inputs[name] = ((position < words) | (position >= TEXT - 5))[None]
    return inputs


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("krea2")
    inputs = {"uneven": uneven_inputs(),
              "batch": tiny_models.make_inputs(FAMILY, batch=2, height=HEIGHT, width=WIDTH, text_tokens=TEXT),
              "square": tiny_models.make_inputs(FAMILY)}
    for name, tensors in inputs.items():
        save_file(tensors, work / f"{name}.safetensors")
    for nproc in (2, 4):
        specs = [{"name": name, "model": str(tiny_model_dirs[FAMILY]), "inputs": str(work / f"{given}.safetensors"),
                  "output": str(work / f"{name}.safetensors"), "layout": layout, "call": call,
                  "fault": "no_exchange" if name.endswith("no-exchange") else None}
                 for name, (n, layout, given, call) in CASES.items() if n == nproc]
        run_engine_cases(nproc, specs, work)
    return work


def _compare(runs, tiny_model_dirs, name: str) -> float:
    _, _, given, call = CASES[name]
    errors = case_errors(runs / f"{name}.safetensors")
    assert not errors, errors[-3000:]
    got = load_file(runs / f"{name}.safetensors")["latents"]
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(runs / f"{given}.safetensors"), **call)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    return (got - expected).abs().max().item(), (got - expected).norm().item() / expected.norm().item()


@pytest.mark.parametrize("name", EXACT)
def test_layouts_equal_diffusers(runs, tiny_model_dirs, name):
    error, _ = _compare(runs, tiny_model_dirs, name)
    assert error <= TOLERANCE, f"{name}: max |parallel - diffusers| = {error:.3g}"


def test_pipefusion_after_one_warmup_step_stays_within_its_stale_bound(runs, tiny_model_dirs):
    error, relative = _compare(runs, tiny_model_dirs, "pipefusion2-warmup1")
    assert 10 * TOLERANCE < error and relative < 0.05  # stale, visibly, and within its bound


def test_negative_control_sequence_split_without_exchange_misses(runs, tiny_model_dirs):
    error, _ = _compare(runs, tiny_model_dirs, "ulysses2-no-exchange")
    assert error > 100 * TOLERANCE


def test_prompts_of_different_lengths_in_one_batch_are_refused_under_ulysses(runs):
    errors = case_errors(runs / "ulysses2-batch.safetensors")
    assert errors.count("LayoutError") >= 1
    assert "the samples of this batch have texts of different lengths" in errors.splitlines()[-1]


def test_model_call_equals_the_pipelines_transformer_call(tiny_model_dirs):
    """One model call (ComfyUI's unpacked latents, its flattened text, sigma) equals the transformer as Krea2Pipeline's
    loop calls it, and misses it at another sigma."""
    from diffusers import DiffusionPipeline

    from parallel.families.base import unpack_2x2
    from parallel.layout.config import ParallelConfig
    from parallel.model_executor.model_call import evaluate
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper

    from xdit_test_helpers import one_rank

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs[FAMILY])
    gen = torch.Generator().manual_seed(5)
    latents, text = torch.randn(2, 16, 8, 10, generator=gen), torch.randn(2, 7, 3, 16, generator=gen)
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        packed = pipeline._pack_latents(latents, 2, 16, 8, 10)
        expected = pipeline.transformer(hidden_states=packed, encoder_hidden_states=text, timestep=sigma,
                                        position_ids=pipeline.prepare_position_ids(7, 4, 5, "cpu"),
                                        encoder_attention_mask=torch.ones(2, 7, dtype=torch.bool), return_dict=False)[0]
    with one_rank(ParallelConfig()):
        wrapper = xFuserPipelineBaseWrapper.wrap(pipeline)
        got = evaluate(wrapper, {"latents": latents, "sigma": sigma, "prompt_embeds": text.flatten(2)})["prediction"]
        other = evaluate(wrapper, {"latents": latents, "sigma": sigma / 2, "prompt_embeds": text.flatten(2)})["prediction"]
        wrapper.unwrap()
    assert (got - unpack_2x2(expected, 64, 80)).abs().max().item() <= TOLERANCE
    assert (other - got).abs().max().item() > 100 * TOLERANCE
