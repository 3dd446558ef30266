"""Load Diffusion Model (xDiT Pool) on Z-Image Turbo in a real ComfyUI 0.33: the sampling part of the official
template (image_z_image_turbo: ModelSamplingAuraFlow shift 3, ConditioningZeroOut's negative, KSampler res_multistep /
simple at cfg 1, EmptySD3LatentImage) runs with only UNETLoader swapped, and gives what ComfyUI's own model gives.

ComfyUI recognises Z-Image only at its released width, so the file is the smallest it loads: one main layer at dim
3840 (3.6 GB in float32, built once per run: conftest's z_image_file). Few tokens and two steps keep it to seconds of
compute; ComfyUI's own model is freed before the pool loads, so the two never hold the weights at once. The prompt is
a CONDITIONING as ComfyUI's lumina2 encoder gives it (its hidden states and an all-valid attention mask; the
test-only XDiTTestConditioning node, at the file's 64-wide text: Qwen3 4B is too big for a CPU test). Z-Image Turbo
samples without CFG, so only Ulysses 2.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from test_comfyui_loader import _loader, _run
from xdit_test_helpers import TOLERANCE

# ComfyUI's attention as on the GPUs a pool runs on (PyTorch's SDPA), not its CPU default (the sub-quadratic kernel)
COMFY_ARGS = ("--use-pytorch-cross-attention",)

SIZE, STEPS = 64, 2


def _template(file: str, swapped: bool, prompt: str = "z-image-positive") -> dict:
    if swapped:
        unet = _loader(ulysses_degree=2)
        unet["inputs"]["unet_name"] = file
    else:
        unet = {"class_type": "UNETLoader", "inputs": {"unet_name": file, "weight_dtype": "default"}}
    return {
        "unet": unet,
        "shift": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["unet", 0], "shift": 3.0}},
        "positive": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": f"{prompt}.safetensors"}},
        "negative": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["positive", 0]}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "ksampler": {"class_type": "KSampler", "inputs": {
            "model": ["shift", 0], "seed": 5, "steps": STEPS, "cfg": 1.0, "sampler_name": "res_multistep",
            "scheduler": "simple", "positive": ["positive", 0], "negative": ["negative", 0],
            "latent_image": ["latent", 0], "denoise": 1.0}},
        "save-ksampler": {"class_type": "SaveLatent", "inputs": {"samples": ["ksampler", 0], "filename_prefix": "zi"}},
    }


def test_z_image_turbo_with_the_loader_swapped_equals_comfyuis_own_on_ulysses_2(comfy, z_image_file):
    from large_files import Z_IMAGE_TEXT

    (comfy.work / "models" / "diffusion_models" / z_image_file.name).symlink_to(z_image_file)
    g = torch.Generator().manual_seed(17)
    for name, tokens in (("z-image-positive", 12), ("z-image-other", 12)):
        save_file({"cond": torch.randn(1, tokens, Z_IMAGE_TEXT, generator=g), "attention_mask": torch.ones(1, tokens)},
                  comfy.work / "input" / f"{name}.safetensors")
    stock = _run(comfy, _template(z_image_file.name, swapped=False))["ksampler"]
    comfy.post("/free", {"unload_models": True, "free_memory": True})  # ComfyUI's copy goes before the pool loads
    swapped = _run(comfy, _template(z_image_file.name, swapped=True))["ksampler"]
    assert stock.abs().max().item() > 0.1
    assert (swapped - stock).abs().max().item() <= TOLERANCE
    # negative control: another prompt samples another image
    other = _run(comfy, _template(z_image_file.name, swapped=True, prompt="z-image-other"))["ksampler"]
    assert (other - stock).abs().max().item() > 1e-2
