"""Load Diffusion Model (xDiT Pool) on Qwen-Image-Edit in a real ComfyUI 0.33: the sampling part of the official
Qwen-Image-Edit (2509) template runs with only UNETLoader swapped, and gives what ComfyUI's own model gives.

The file is test_comfyui_model's tiny Qwen-Image single file (ComfyUI's own widths, one block). The prompts are
CONDITIONINGs as TextEncodeQwenImageEditPlus gives them (the test-only XDiTTestConditioning node: Qwen2.5-VL 7B is
too big for a CPU test): the text, and `reference_latents` appended, each reference's VAE latent [1, 16, 1, h, w]
(two of different sizes), on the positive and the negative alike. ComfyUI's model places each reference's tokens
after the image's at frame index 1, 2, ... (`index`), or also modulates them at timestep 0 (`index_timestep_zero`,
the default of Qwen-Image-Edit 2511's files); FluxKontextMultiReferenceLatentMethod sets another.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from test_comfyui_loader import _loader, _run
from test_comfyui_model import QWEN, qwen_checkpoint  # noqa: F401 - fixture
from xdit_test_helpers import TOLERANCE

STEPS, SIZE, CFG = 3, 64, 2.5
REFERENCES = ((8, 8), (4, 8))  # latent pixels: 64 × 64 and 32 × 64 px pictures


@pytest.fixture(scope="module")
def prompts(comfy, qwen_checkpoint) -> None:  # noqa: F811 - the fixture
    """The positive and negative conditioning, each with the same two reference latents appended."""
    g = torch.Generator().manual_seed(13)
    references = {f"reference_latents.{i}": torch.randn(1, 16, 1, h, w, generator=g) for i, (h, w) in enumerate(REFERENCES)}
    for name, tokens in (("qwen-edit-positive", 9), ("qwen-edit-negative", 5)):
        cond = torch.randn(1, tokens, 3584, generator=g)
        save_file({"cond": cond, **references}, comfy.work / "input" / f"{name}.safetensors")
        save_file({"cond": cond}, comfy.work / "input" / f"{name}-alone.safetensors")


def _template(swapped: bool, method: str = "", references: bool = True, file: str = f"{QWEN}.safetensors",
              **layout) -> dict:
    """The template's sampling part: the model through ModelSamplingAuraFlow (shift 3) and CFGNorm, KSampler euler /
    simple at cfg 2.5 on an empty latent; `method` sets the references' placement on both prompts."""
    if swapped:
        unet = _loader(**(layout or {"ulysses_degree": 2}))
        unet["inputs"]["unet_name"] = file
    else:
        unet = {"class_type": "UNETLoader", "inputs": {"unet_name": file, "weight_dtype": "default"}}
    prompt = {
        "unet": unet,
        "shift": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["unet", 0], "shift": 3.0}},
        "norm": {"class_type": "CFGNorm", "inputs": {"model": ["shift", 0], "strength": 1.0}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "ksampler": {"class_type": "KSampler", "inputs": {
            "model": ["norm", 0], "seed": 5, "steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["positive", 0], "negative": ["negative", 0], "latent_image": ["latent", 0], "denoise": 1.0}},
        "save-ksampler": {"class_type": "SaveLatent", "inputs": {"samples": ["ksampler", 0], "filename_prefix": "qe"}},
    }
    for side in ("positive", "negative"):
        text = {"class_type": "XDiTTestConditioning", "inputs": {
            "tensors": f"qwen-edit-{side}{'' if references else '-alone'}.safetensors"}}
        prompt[side] = text
        if method:
            prompt[f"{side}-text"] = text
            prompt[side] = {"class_type": "FluxKontextMultiReferenceLatentMethod", "inputs": {
                "conditioning": [f"{side}-text", 0], "reference_latents_method": method}}
    return prompt


def _equal(swapped: dict, stock: dict) -> torch.Tensor:
    assert stock["ksampler"].abs().max().item() > 0.1
    assert (swapped["ksampler"] - stock["ksampler"]).abs().max().item() <= TOLERANCE
    return stock["ksampler"]


def test_qwen_image_edit_reference_latents_through_the_loader_equal_comfyuis_own_on_ulysses_2_and_cfg_2(comfy, prompts):
    stock = _run(comfy, _template(swapped=False))
    _equal(_run(comfy, _template(swapped=True)), stock)
    _equal(_run(comfy, _template(swapped=True, cfg_parallel=True)), stock)
    # negative control: the references act (without them the pool samples another image)
    alone = _run(comfy, _template(swapped=True, references=False))["ksampler"]
    assert (alone - stock["ksampler"]).abs().max().item() > 1e-2


def test_qwen_image_edit_2511s_timestep_zero_references_equal_comfyuis_own(comfy, prompts):
    """A 2511 file (the same weights with Comfy-Org's `__index_timestep_zero__` marker): ComfyUI's model then
    modulates the references at timestep 0 by default, and so does the pool."""
    from safetensors.torch import load_file

    folder = comfy.work / "models" / "diffusion_models"
    file = f"{QWEN}-2511.safetensors"
    save_file({**load_file(folder / f"{QWEN}.safetensors"), "model.diffusion_model.__index_timestep_zero__": torch.tensor([])},
              folder / file)
    stock = _equal(_run(comfy, _template(swapped=True, file=file)), _run(comfy, _template(swapped=False, file=file)))
    # negative control: the references at the call's timestep (`index`) sample another image
    assert (_run(comfy, _template(swapped=True, file=file, method="index"))["ksampler"] - stock).abs().max().item() > 1e-3
    entry = comfy.wait(comfy.queue(_template(swapped=True, file=file, method="offset")), 600)
    errors = [m[1]["exception_message"] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors and "the reference method 'offset'" in errors[0], errors
