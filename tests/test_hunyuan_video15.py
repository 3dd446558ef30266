"""HunyuanVideo 1.5 through real torchrun ranks equals diffusers' single-process HunyuanVideo15Pipeline (fp32, 1e-4).

The tiny model (8 latent channels, ×16 VAE, 4 heads) runs on 9-frame 48×48 videos (27 tokens: shards of 14/13 or
7/7/7/6) and 5-frame 64×64 ones (32 tokens, even), with an LLM text and a byT5 glyph text that each end in
padding (the 729 vision tokens text-to-video masks come on top), so every layout also tests the trimmed text
padding. CFG runs in the pipeline's guider, its scale set from the call's guidance_scale. Two torchrun launches
(2 and 4 ranks) run the matrix through tests/engine_cases.py. Negative control: a split without exchange. A
batch whose texts differ in length is refused under Ulysses in one line and runs under CFG and DP. A 2-rank pool
encodes prompts as the pipeline does and samples with its progress from the scheduler's steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import ClassifierFreeGuidance, DiffusionPipeline
from safetensors.torch import load_file, save_file

from parallel import tiny_models

from pool_helpers import serving
from test_engine_layouts import LAYOUTS
from xdit_test_helpers import TOLERANCE, torchrun

FAMILY, STEPS, GUIDANCE = "hunyuanvideo15", 4, 6.0
VIDEOS = {"even": (5, 64, 64), "uneven": (9, 48, 48)}  # (num_frames, height, width)
# (nproc, layout, video, variant)
CASES = [(2, layout, "uneven", "default") for layout in LAYOUTS[2] if layout != "dp2"]  # dp2: below, on a batch of 2
CASES += [(4, layout, "uneven", "default") for layout in LAYOUTS[4]]
CASES += [(2, "ulysses2", "even", "default"), (2, "ring2", "uneven", "unguided"), (4, "cfg2_ulysses2", "even", "default")]
CASES += [(2, "dp2", "uneven", "batch2"), (2, "cfg2", "uneven", "batch2")]
CONTROLS = [(2, "ulysses2", "even", "no_exchange")]
REFUSED = [(2, "ulysses2", "uneven", "batch2")]  # two texts of different lengths: no mask under Ulysses


def case_name(nproc, layout, video, variant) -> str:
    return f"{layout}-{video}" + ("" if variant == "default" else f"-{variant}")


def guidance(variant: str) -> float:
    return 1.0 if variant == "unguided" else GUIDANCE


def reference(model_dir: Path, inputs: Path, video: str, variant: str) -> torch.Tensor:
    """diffusers' own pipeline, its guider made with the case's guidance scale."""
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=guidance(variant))
    frames, height, width = VIDEOS[video]
    with torch.no_grad():
        return pipeline(**load_file(inputs), num_inference_steps=STEPS, height=height, width=width, num_frames=frames,
                        output_type="latent", return_dict=False)[0]


@pytest.fixture(scope="module")
def matrix(video_model_dirs, tmp_path_factory):
    """Run both launches once; return {case: (output file, inputs file)}."""
    work = tmp_path_factory.mktemp("hunyuan_video15")
    results = {}
    for nproc in (2, 4):
        specs = []
        for case in [c for c in CASES + CONTROLS + REFUSED if c[0] == nproc]:
            _, layout, video, variant = case
            frames, height, width = VIDEOS[video]
            batch = 2 if variant == "batch2" else 1
            negative = variant != "unguided"
            inputs = work / f"{video}-b{batch}-{negative}.safetensors"
            if not inputs.exists():
                save_file(tiny_models.make_inputs(FAMILY, batch=batch, height=height, width=width, num_frames=frames,
                                                  negative=negative), inputs)
            name = case_name(*case)
            specs.append({"name": name, "model": str(video_model_dirs[FAMILY]), "inputs": str(inputs),
                          "output": str(work / f"{name}.safetensors"), "layout": LAYOUTS[nproc][layout],
                          "call": {"num_inference_steps": STEPS, "guidance_scale": guidance(variant), "height": height,
                                   "width": width},
                          "scheduler": "default", "fault": variant if variant == "no_exchange" else None})
            results[case] = (Path(specs[-1]["output"]), inputs)
        spec_file = work / f"cases{nproc}.json"
        spec_file.write_text(json.dumps(specs))
        run = torchrun(nproc, "tests/engine_cases.py", str(spec_file))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return results, video_model_dirs[FAMILY]


def _result(matrix, case):
    results, model_dir = matrix
    output, inputs = results[case]
    errors = sorted(output.parent.glob(output.name + ".error*"))
    assert not errors, errors[0].read_text()
    _, _, video, variant = case
    return load_file(output)["latents"], reference(model_dir, inputs, video, variant)


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_layout_matches_single_process_diffusers(matrix, case):
    parallel, expected = _result(matrix, case)
    assert parallel.shape == expected.shape and parallel.ndim == 5
    error = (parallel - expected).abs().max().item()
    assert error <= TOLERANCE, f"{case_name(*case)}: max |parallel - diffusers| = {error:.3g}"


@pytest.mark.parametrize("case", CONTROLS, ids=[case_name(*c) for c in CONTROLS])
def test_a_split_without_exchange_fails_the_check(matrix, case):
    parallel, expected = _result(matrix, case)
    assert (parallel - expected).abs().max().item() > 100 * TOLERANCE


def test_guidance_reaches_the_guider(matrix):
    """The unguided case is not the guided one: the call's guidance_scale is what the guider used."""
    results, model_dir = matrix
    output, inputs = results[(2, "ring2", "uneven", "unguided")]
    guided = reference(model_dir, inputs, "uneven", "default")
    assert (load_file(output)["latents"] - guided).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("case", REFUSED, ids=[case_name(*c) for c in REFUSED])
def test_texts_of_different_lengths_are_refused_under_sequence_parallel(matrix, case):
    results, _ = matrix
    output, _ = results[case]
    error = "\n".join(p.read_text() for p in output.parent.glob(output.name + ".error*"))
    assert "texts of different lengths" in error and "send one prompt per job" in error, error[-2000:]


def test_pool_encodes_as_the_pipeline_and_samples_with_progress(video_model_dirs, tmp_path):
    """Qwen2.5-VL and byT5 encodings on a Ulysses-2 pool equal encode_prompt (a quoted word makes glyph tokens);
    a job with them equals diffusers, and reports every step (from the scheduler: the pipeline takes no callback)."""
    model_dir = video_model_dirs[FAMILY]
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    frames, height, width = VIDEOS["uneven"]
    with serving(model_dir, tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders") as client:
        encoded = {text: client.encode(text) for text in ('a sign that says "open"', "")}
        for text, tensors in encoded.items():
            expected = dict(zip(("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"),
                                pipeline.encode_prompt(text, device="cpu")))
            assert tensors.keys() == expected.keys()
            for name, value in expected.items():
                error = (tensors[name].to(value.dtype) - value).abs().max().item()
                assert error <= 1e-6, (text, name, error)  # byT5 runs in another process's thread count
        inputs = {"latents": tiny_models.make_inputs(FAMILY, height=height, width=width, num_frames=frames)["latents"],
                  **encoded['a sign that says "open"'], **{f"negative_{name}": value for name, value in encoded[""].items()}}
        steps = []
        latents = client.sample(inputs, {"steps": STEPS, "guidance_scale": GUIDANCE, "height": height, "width": width},
                                on_step=lambda message: steps.append(message.params["index"]))
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=GUIDANCE)
    with torch.no_grad():
        expected = pipeline(**inputs, num_inference_steps=STEPS, height=height, width=width, num_frames=frames,
                            output_type="latent", return_dict=False)[0]
    assert steps == list(range(1, STEPS + 1))
    assert (latents - expected).abs().max().item() <= TOLERANCE
