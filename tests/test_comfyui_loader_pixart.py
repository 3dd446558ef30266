"""Load Diffusion Model (xDiT Pool) on PixArt-Σ and PixArt-α in a real ComfyUI 0.33: KSampler (euler / normal at cfg
4.5: the templates have no PixArt workflow) with UNETLoader swapped for the loader gives what ComfyUI's own PixArt
(comfy/ldm/pixart/pixartms.py) gives on the same file.

The files are tiny PixArts in the PixArt repository's layout (blocks.*, y_embedder's null caption, the saved position
table) at ComfyUI's fixed widths (hidden 1152 in 16 heads, T5's 4096), one block; α with its micro-conditions. Their
table is for 1024 px (sample size 128, interpolation 2) and the prompts sample at 512×384, where ComfyUI lays the
positions on another grid than diffusers' default for the file: the family's model call lays ComfyUI's. The prompts
are CONDITIONINGs as ComfyUI's T5 for PixArt gives them (no padding, no mask: the test-only XDiTTestConditioning node;
T5-XXL is too big for a CPU test), positive and negative of different lengths (ComfyUI repeats both to one length).
Text-to-image from sigma 157 (PixArt's linear schedule) ends at latents near 5000, where float32 holds no 1e-4: img2img
at denoise 0.4 from a latent is held to 1e-4, text-to-image to ~32 float32 steps of its size (4e-6 of it).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from test_comfyui_loader import _loader, _run
from xdit_test_helpers import TOLERANCE

# ComfyUI's attention as on the GPUs a pool runs on (PyTorch's SDPA), not its CPU default (the sub-quadratic kernel)
COMFY_ARGS = ("--use-pytorch-cross-attention",)

FILES = {"pixart-sigma": "tiny-pixart-sigma.safetensors", "pixart-alpha": "tiny-pixart-alpha.safetensors"}
WIDTH, HEIGHT, STEPS, CFG = 512, 384, 4, 4.5


@pytest.fixture(scope="module")
def files(comfy) -> None:
    from diffusers import PixArtTransformer2DModel

    from original_layouts import original_layout
    from parallel.loading import tiny_models as tm

    for seed, (family, name) in enumerate(FILES.items()):
        transformer = tm._peak_attention(tm._seeded(
            seed + 3, PixArtTransformer2DModel, num_attention_heads=16, attention_head_dim=72, in_channels=4,
            out_channels=8, num_layers=1, sample_size=128, patch_size=2, cross_attention_dim=1152, caption_channels=4096,
            interpolation_scale=2, use_additional_conditions=family == "pixart-alpha"), tm.QK_SCALE)
        weights = original_layout(family, transformer)
        save_file({k: v.contiguous() for k, v in weights.items()}, comfy.work / "models" / "diffusion_models" / name)
    g = torch.Generator().manual_seed(13)
    for prompt, tokens in (("positive", 7), ("negative", 3), ("other", 7)):
        save_file({"cond": torch.randn(1, tokens, 4096, generator=g)}, comfy.work / "input" / f"pixart-{prompt}.safetensors")
    save_file({"samples": torch.randn(1, 4, HEIGHT // 8, WIDTH // 8, generator=g)}, comfy.work / "input" / "pixart-start.safetensors")


def _prompt(file: str, layout: dict, positive: str = "positive") -> dict:
    """UNETLoader's and the loader's KSampler side by side on the same prompt, latent and seed: text-to-image, and
    img2img at denoise 0.4 from a latent."""
    swapped = _loader(**layout)
    swapped["inputs"]["unet_name"] = file
    prompt = {
        "positive": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": f"pixart-{positive}.safetensors"}},
        "negative": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": "pixart-negative.safetensors"}},
        "latent": {"class_type": "EmptyLatentImage", "inputs": {"width": WIDTH, "height": HEIGHT, "batch_size": 1}},
        "start": {"class_type": "XDiTTestLatent", "inputs": {"tensors": "pixart-start.safetensors"}},
        "stock-unet": {"class_type": "UNETLoader", "inputs": {"unet_name": file, "weight_dtype": "default"}},
        "xdit-unet": swapped,
    }
    for side in ("stock", "xdit"):
        for run, latent, denoise in (("", "latent", 1.0), ("-img2img", "start", 0.4)):
            prompt[side + run] = {"class_type": "KSampler", "inputs": {
                "model": [f"{side}-unet", 0], "seed": 5, "steps": STEPS, "cfg": CFG, "sampler_name": "euler",
                "scheduler": "normal", "positive": ["positive", 0], "negative": ["negative", 0],
                "latent_image": [latent, 0], "denoise": denoise}}
            prompt[f"save-{side}{run}"] = {"class_type": "SaveLatent", "inputs": {"samples": [side + run, 0],
                                                                                   "filename_prefix": side + run}}
    return prompt


def _equal(latents: dict) -> None:
    """img2img within 1e-4; text-to-image within 4e-6 of its size (~32 float32 steps). PixArt's linear schedule starts
    at sigma 157 and SDXL's scale divides by 0.13: an untrained model's latents end near 5000, whose float32 step is
    4.9e-4, so 1e-4 is finer than either side can hold there."""
    assert (latents["xdit-img2img"] - latents["stock-img2img"]).abs().max().item() <= TOLERANCE
    size = latents["stock"].abs().max().item()
    assert (latents["xdit"] - latents["stock"]).abs().max().item() <= 4e-6 * size


@pytest.mark.parametrize("layout", [{"ulysses_degree": 2}, {"cfg_parallel": True}], ids=["ulysses2", "cfg2"])
@pytest.mark.parametrize("family", list(FILES))
def test_pixart_with_the_loader_swapped_equals_comfyuis_own(comfy, files, family, layout):
    latents = _run(comfy, _prompt(FILES[family], layout))
    assert latents["stock-img2img"].abs().max().item() > 0.1
    _equal(latents)


def test_another_prompt_on_the_loader_misses_comfyuis_own(comfy, files):
    """Negative control: the comparison sees the conditioning (another prompt, same file, seed and layout)."""
    other = _run(comfy, _prompt(FILES["pixart-sigma"], {"ulysses_degree": 2}, positive="other"))
    latents = _run(comfy, _prompt(FILES["pixart-sigma"], {"ulysses_degree": 2}))
    with pytest.raises(AssertionError):
        _equal({**latents, "xdit": other["xdit"], "xdit-img2img": other["xdit-img2img"]})
    assert (other["xdit-img2img"] - latents["stock-img2img"]).abs().max().item() > 1e-2
