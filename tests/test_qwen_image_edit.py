"""Qwen-Image-Edit and Edit Plus: reference images through real ranks, refusals, and a pool job.

test_engine_layouts runs both tiny edit models (one reference; Plus: two) through every layout of the image
families (Ulysses 2 and 4, Ring 2 and 4, Ulysses 2 × Ring 2, CFG, CFG × Ulysses 2, DP 2) against diffusers'
own pipelines, with a sequence split without exchange as their negative control. Here, through real ranks: an
output of another shape (64 × 128: 2 noisy tokens beside 256 reference tokens) under Ulysses 2 with a check
that the reference image is what the result follows (another image misses by far more); Plus with three
references under Ring 2 and a batch of two prompts over two data-parallel ranks, which diffusers' Plus refuses
in one call (its reference is the two prompts one by one); refusals in one line each: no image, PipeFusion, a
Plus batch a rank would get whole. A pool (Ulysses 2) takes the reference images over the wire and equals
diffusers.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from pool_helpers import serving
from xdit_test_helpers import (TOLERANCE, case_errors, diffusers_latents, diffusers_with_reference_latents,
                               run_engine_cases)

EDIT, PLUS, STEPS = "qwen-image-edit", "qwen-image-edit-plus", 2


def call(height: int = 64, width: int = 64) -> dict:
    return {"num_inference_steps": STEPS, "guidance_scale": 1.0, "true_cfg_scale": 4.0, "height": height, "width": width}


# name: (model, layout, inputs: (batch, references, height, width), expected error or None)
CASES = {
    "edit-ulysses2-wide": (EDIT, {"ulysses_degree": 2}, (1, 1, 64, 128), None),
    "plus-ring2-three": (PLUS, {"ring_degree": 2}, (1, 3, 64, 64), None),
    "plus-dp2-batch": (PLUS, {"dp_degree": 2}, (2, 2, 64, 64), None),
    # references as model-space latents (ComfyUI's ReferenceLatent): 48 × 80 pixels, 6 × 10 latent pixels, 15 tokens
    "edit-latents-ulysses2": (EDIT, {"ulysses_degree": 2}, (1, (1, 16, 6, 10), 64, 64), None),
    "plus-latents-ring2": (PLUS, {"ring_degree": 2}, (1, (2, 16, 6, 10), 64, 64), None),
    "edit-latents-odd": (EDIT, {"ulysses_degree": 2}, (1, (1, 16, 5, 10), 64, 64),
                         "reference latents of 5x10 do not pack into 2x2 tokens"),
    "edit-no-image": (EDIT, {"ulysses_degree": 2}, (1, 0, 64, 64), "QwenImageEditPipeline edits reference images: send `image`, [1, 3, H, W] pixels"),
    # PipeFusion cuts [noisy; reference] tokens into patches (warm-up = steps: exact), with reference latents too
    # (128²: the ×32 VAE's two token rows; 4 noisy + 256 reference tokens, or 4 + 2 × 15)
    "edit-pp2": (EDIT, {"pipefusion_degree": 2, "warmup_steps": STEPS}, (1, 1, 128, 128), None),
    "plus-pp2-latents": (PLUS, {"pipefusion_degree": 2, "warmup_steps": STEPS}, (1, (2, 16, 6, 10), 128, 128), None),
    "edit-pp2-odd-total": (EDIT, {"pipefusion_degree": 2}, (1, (1, 16, 6, 10), 128, 128),
                           "19 tokens (15 of them the reference images') do not split into 2 PipeFusion patches"),
    "plus-batch-on-one-rank": (PLUS, {"ulysses_degree": 2}, (2, 2, 64, 64),
                               "samples one prompt per call and this batch of 2 gives 2 to a rank"),
}


def edit_inputs(model: str, batch: int, references: int | tuple, height: int, width: int, seed: int = 0) -> dict:
    inputs = tiny_models.make_inputs(model, batch=batch, height=height, width=width, seed=seed)
    if isinstance(references, tuple):  # the references' latents of this shape
        inputs["image"] = torch.randn(references, generator=torch.Generator().manual_seed(seed + 7))
    elif not references:
        del inputs["image"]
    elif references != len(inputs["image"]):
        image = inputs["image"][:1]
        inputs["image"] = torch.cat([image.roll(i, dims=-1) for i in range(references)])  # references that differ
    return inputs


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen_edit")
    specs = []
    for name, (model, layout, (batch, references, height, width), _) in CASES.items():
        inputs = work / f"{name}-in.safetensors"
        save_file(edit_inputs(model, batch, references, height, width), inputs)
        specs.append({"name": name, "model": str(tiny_model_dirs[model]), "inputs": str(inputs), "layout": layout,
                      "output": str(work / f"{name}.safetensors"), "call": call(height, width)})
    run_engine_cases(2, specs, work)
    return {spec["name"]: spec for spec in specs}


def _outcome(runs, name: str):
    spec = runs[name]
    errors = case_errors(spec["output"])
    return (None, errors) if errors else (load_file(spec["output"])["latents"], "")


def _reference(runs, tiny_model_dirs, name: str, **changes):
    model, _, (_, references, height, width), _ = CASES[name]
    inputs = {**load_file(runs[name]["inputs"]), **changes}
    if isinstance(references, tuple):
        return diffusers_with_reference_latents(tiny_model_dirs[model], model, inputs.pop("image"), **inputs,
                                                **call(height, width))
    return diffusers_latents(tiny_model_dirs[model], model, **inputs, **call(height, width))


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[3] is None])
def test_edit_equals_diffusers(runs, tiny_model_dirs, name):
    parallel, error = _outcome(runs, name)
    assert parallel is not None, error[-2000:]
    expected = _reference(runs, tiny_model_dirs, name)
    assert parallel.shape == expected.shape
    assert (parallel - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", ["edit-ulysses2-wide", "edit-latents-ulysses2"])
def test_the_result_follows_the_reference_image(runs, tiny_model_dirs, name):
    parallel, error = _outcome(runs, name)
    assert parallel is not None, error[-2000:]
    image = load_file(runs[name]["inputs"])["image"]
    other = _reference(runs, tiny_model_dirs, name, image=1 - image if image.shape[1] == 3 else -image)
    assert (parallel - other).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[3] is not None])
def test_what_cannot_run_is_refused_in_one_line(runs, name):
    parallel, error = _outcome(runs, name)
    assert parallel is None and CASES[name][3] in error, error[-2000:]


def test_a_pool_takes_the_reference_images_and_encodes_prompts_with_them(tiny_model_dirs, tmp_path):
    """Plus on a pool (Ulysses 2) with its text encoders: reference pixels over the wire equal diffusers; prompts
    encoded on the pool with two reference images (Qwen2.5-VL sees them; their latents come back as `image`) give
    what diffusers' pipeline gives from the prompt strings and the pictures, and another picture misses by far more."""
    from parallel.families.base import pictures
    from workers.client import JobFailed

    inputs = edit_inputs(PLUS, 1, 2, 64, 64, seed=3)
    with serving(tiny_model_dirs[PLUS], tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders") as client:
        params = {"steps": STEPS, "guidance_scale": 1.0, "height": 64, "width": 64, "call": {"true_cfg_scale": 4.0}}
        latents = client.sample(inputs, params)
        positive, negative = (client.encode(text, image=inputs["image"]) for text in ("a cat on a mat", "blurry"))
        job = {"latents": inputs["latents"], "image": positive["image"],
               **{f"{prefix}{name}": encoded[name] for prefix, encoded in (("", positive), ("negative_", negative))
                  for name in ("prompt_embeds", "prompt_embeds_mask") if name in encoded}}
        from_prompts = client.sample(job, params)
        with pytest.raises(JobFailed, match=r"image has shape \[1, 1, 8, 8\]; QwenImageEditPlusPipeline encodes text"):
            client.encode("a cat", image=torch.rand(1, 1, 8, 8))
    expected = diffusers_latents(tiny_model_dirs[PLUS], PLUS, **inputs, **call())
    assert (latents - expected).abs().max().item() <= TOLERANCE
    assert positive["image"].shape == (2, 16, 32, 32)  # ~1024² through the tiny ×32 VAE

    def from_strings(image):
        return diffusers_latents(tiny_model_dirs[PLUS], PLUS, prompt="a cat on a mat", negative_prompt="blurry",
                                 image=pictures(image), latents=inputs["latents"], **call())

    assert (from_prompts - from_strings(inputs["image"])).abs().max().item() <= TOLERANCE
    assert (from_prompts - from_strings(inputs["image"].flip(-1))).abs().max().item() > 100 * TOLERANCE


def test_the_saved_processor_is_transformers_own_and_loads_for_images_alone(tiny_model_dirs):
    """The tiny edit models save Qwen-Image-Edit's real layout (transformers' Qwen2VLProcessor); saved and loaded
    without torchvision, it loads as that class for images alone (parallel/loading/vl_processors.py) and encodes as the
    pipeline it was saved from."""
    import PIL.Image
    from transformers import Qwen2VLProcessor

    from parallel.loading import tiny_models, vl_processors

    folder = tiny_model_dirs[EDIT]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    processor = vl_processors.stand_ins(folder, index)["processor"]
    assert isinstance(processor, Qwen2VLProcessor) and type(processor).__name__ == "Qwen2VLProcessor"
    built = tiny_models.build_tiny_pipeline(EDIT, seed=0)
    picture = PIL.Image.new("RGB", (40, 24), (200, 30, 90))
    text = "<|vision_start|><|image_pad|><|vision_end|> a cat"
    ours, theirs = (p(text=[text], images=[picture], return_tensors="pt") for p in (processor, built.processor))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (ours["input_ids"] == processor.image_token_id).sum() == ours["image_grid_thw"].prod() // 4
