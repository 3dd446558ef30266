"""Qwen-Image-Edit in a real ComfyUI 0.33: the reference image the ComfyUI way.

ReferenceLatent on xDiT Text Encode's conditioning; xDiT Text Encode given the picture (Qwen2.5-VL sees it on the
pool, whose VAE adds its latents as reference_latents); and TextEncodeQwenImageEdit(Plus)'s conditioning, whose
multi-billion-parameter text model a test cannot run, in its layout through the test-only XDiTTestConditioning
(tests/comfyui_probe/xdit_test_nodes.py). Each LATENT equals diffusers' Qwen-Image-Edit (Plus) pipeline given the
same prompts and references within 1e-4; other references miss by far more.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_comfyui import FAMILIES, _node_error, saved_latent, workflow
from test_comfyui_native import NEGATIVE, SEED, SIZE, STEPS, _conditioning, _pool, _sampler, _stop_pools  # noqa: F401
from xdit_test_helpers import ROOT, TOLERANCE, diffusers_with_reference_latents

QWEN_EDIT = "tiny-qwen-image-edit-comfy"


@pytest.fixture(scope="module")
def qwen_edit_model(comfy):
    """A Qwen-Image-Edit folder on the tiny Qwen-Image's parts, so its VAE is ×8 as ComfyUI's latents are (the
    built-in tiny edit models' ×32 VAE fits pixel references encoded at ~1024², not ComfyUI's latents)."""
    from diffusers import QwenImageEditPipeline

    from parallel.loading import tiny_models

    parts = tiny_models.build_tiny_pipeline("qwen-image", seed=6).components
    folder = comfy.work / "models" / "diffusers" / QWEN_EDIT
    QwenImageEditPipeline(**parts, processor=None).save_pretrained(folder, safe_serialization=True)
    return folder


def _qwen_edit_reference(model_dir, vae_space: torch.Tensor, steps=4, size=64, seed=7) -> torch.Tensor:
    """diffusers' Qwen-Image-Edit in one process on the same prompts (Qwen-Image's text template, as xDiT Text
    Encode and ComfyUI's TextEncodeQwenImageEdit without an image encode them), ComfyUI's noise, and the
    reference given as latents; in ComfyUI's latent space."""
    from diffusers import QwenImagePipeline

    from xdit_test_helpers import diffusers_with_reference_latents, load_pipeline_folder

    pipeline = load_pipeline_folder(model_dir)
    text = QwenImagePipeline(**{k: getattr(pipeline, k) for k in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")})
    embeds, _ = text.encode_prompt("a cat on a mat", device="cpu")
    negative, _ = text.encode_prompt("blurry", device="cpu")
    config = pipeline.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (config.latents_mean, config.latents_std))
    noise = torch.randn((1, 16, size // 8, size // 8), generator=torch.manual_seed(seed))
    latents = diffusers_with_reference_latents(
        model_dir, "qwen-image-edit", (vae_space - mean) / std, prompt_embeds=embeds, negative_prompt_embeds=negative,
        true_cfg_scale=FAMILIES["qwen-image"][1], latents=pipeline._pack_latents(noise, 1, 16, size // 8, size // 8),
        num_inference_steps=steps, height=size, width=size)
    latents = pipeline._unpack_latents(latents, size, size, 8)
    return latents * std[:, :, None] + mean[:, :, None]


def test_qwen_image_edit_with_reference_latent_equals_diffusers(comfy, qwen_edit_model):
    """xDiT Text Encode → ReferenceLatent (a 48 × 80 px reference's latents, LoadLatent) → xDiT Sampler on a
    Qwen-Image-Edit pool (Ulysses 2: the reference tokens sharded with the noisy ones) equals diffusers; another
    reference misses by far more; without a reference the sampler says which node gives one."""
    vae_space = torch.randn((1, 16, 6, 10), generator=torch.Generator().manual_seed(3))
    save_file({"latent_tensor": vae_space, "latent_format_version_0": torch.tensor([])},
              comfy.work / "output" / "qwen-edit-ref.latent")
    graph = workflow("qwen-image", prefix="edit")
    graph["1"]["inputs"]["model"] = QWEN_EDIT
    graph["8"] = {"class_type": "LoadLatent", "inputs": {"latent": "qwen-edit-ref.latent [output]"}}
    graph["9"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["2", 0], "latent": ["8", 0]}}
    graph["5"]["inputs"]["positive"] = ["9", 0]
    entry = comfy.wait(comfy.queue(graph))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    expected = _qwen_edit_reference(qwen_edit_model, vae_space)
    latent = saved_latent(comfy, entry)
    assert latent.shape == expected.shape == (1, 16, 1, 8, 8)
    assert (latent - expected).abs().max().item() <= TOLERANCE
    assert (_qwen_edit_reference(qwen_edit_model, -vae_space) - expected).abs().max().item() > 100 * TOLERANCE

    del graph["9"], graph["8"]
    graph["5"]["inputs"]["positive"] = ["2", 0]
    assert "add ComfyUI's ReferenceLatent" in _node_error(comfy, graph)


# diffusers' Qwen-Image-Edit from the prompt strings and a picture, run by ComfyUI's python: the one the pool runs
# in, whose transformers may resize the picture for Qwen2.5-VL with torchvision (the test bed's) rather than PIL
EDIT_REFERENCE = """
import sys

import PIL.Image
import torch
from safetensors.torch import save_file

root, model, picture, out, size = *sys.argv[1:5], int(sys.argv[5])
sys.path[:0] = [root, root + "/tests"]
from xdit_test_helpers import diffusers_latents, load_pipeline_folder

pipeline = load_pipeline_folder(model)
scale, tokens = pipeline.vae_scale_factor, size // pipeline.vae_scale_factor
noise = torch.randn((1, 16, tokens, tokens), generator=torch.manual_seed(7))
latents = diffusers_latents(pipeline, "qwen-image-edit", prompt="a cat on a mat", negative_prompt="blurry",
                            image=PIL.Image.open(picture).convert("RGB"), true_cfg_scale=4.0, num_inference_steps=4,
                            height=size, width=size, latents=pipeline._pack_latents(noise, 1, 16, tokens, tokens))
config = pipeline.vae.config
mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
save_file({"latents": pipeline._unpack_latents(latents, size, size, scale) * std + mean}, out)
"""


def test_qwen_image_edit_prompts_are_encoded_with_their_image_on_the_pool(comfy):
    """LoadImage → xDiT Text Encode with the image, positive and negative (Qwen2.5-VL sees the picture; the pool's VAE
    adds its latents as reference_latents, as TextEncodeQwenImageEdit with vae and image does) → xDiT Sampler on the
    built-in Qwen-Image-Edit (its ×32 VAE: a 64² ComfyUI latent is 256² pixels to it, the pool says) equals diffusers'
    pipeline given the prompt strings and the picture; another picture misses by far more. An image given to a model
    whose text encoders see none is one node error."""
    import subprocess

    import numpy as np
    import PIL.Image

    from parallel.loading import builtin_models

    rng = np.random.default_rng(5)
    for name in ("edit-ref.png", "edit-other.png"):
        PIL.Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(comfy.work / "input" / name)
    graph = workflow("qwen-image-edit", prefix="edit-image")
    graph["7"] = {"class_type": "LoadImage", "inputs": {"image": "edit-ref.png"}}
    for node in ("2", "3"):
        graph[node]["inputs"]["image"] = ["7", 0]
    entry = comfy.wait(comfy.queue(graph))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latent = saved_latent(comfy, entry)

    def expected(picture: str) -> torch.Tensor:
        out = comfy.work / f"{picture}.reference.safetensors"
        model = builtin_models.builtin_model_dir("xdit-tiny-qwen-image-edit")
        run = subprocess.run([str(comfy.python), "-c", EDIT_REFERENCE, str(ROOT), str(model),
                              str(comfy.work / "input" / picture), str(out), "256"],
                             cwd=comfy.comfy, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return load_file(out)["latents"]

    assert latent.shape == (1, 16, 1, 8, 8)
    assert (latent - expected("edit-ref.png")).abs().max().item() <= TOLERANCE
    assert (latent - expected("edit-other.png")).abs().max().item() > 100 * TOLERANCE

    text_to_image = workflow("qwen-image", prefix="no-image")
    text_to_image["7"] = graph["7"]
    text_to_image["2"]["inputs"]["image"] = ["7", 0]
    assert "QwenImagePipeline's text encoders take no image" in _node_error(comfy, text_to_image)


EDIT_PLUS = "tiny-qwen-image-edit-plus-comfy"


def test_qwen_image_edit_plus_takes_text_encode_qwen_image_edit_plus_references(comfy):
    """TextEncodeQwenImageEdit(Plus) appends each reference image's VAEEncode ([1, 16, 1, h, w], Qwen-Image's video
    latent format) to the conditioning's reference_latents, positive and negative alike: two of them reach a
    Qwen-Image-Edit Plus pool (a ×8 VAE, as ComfyUI's latents are) and equal diffusers' pipeline given those
    references; negated references miss by far more."""
    from diffusers import QwenImageEditPlusPipeline, QwenImagePipeline

    from parallel.loading import tiny_models

    parts = tiny_models.build_tiny_pipeline("qwen-image", seed=6).components
    folder = comfy.work / "models" / "diffusers" / EDIT_PLUS
    QwenImageEditPlusPipeline(**parts, processor=None).save_pretrained(folder, safe_serialization=True)
    text = QwenImagePipeline(**{k: parts[k] for k in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")})
    with torch.no_grad():
        embeds, negative = (text.encode_prompt(t, device="cpu")[0] for t in ("turn it into a watercolor", NEGATIVE))
    vae_space = torch.randn((2, 16, 1, 6, 10), generator=torch.Generator().manual_seed(3))
    references = {f"reference_latents.{i}": vae_space[i : i + 1] for i in range(2)}
    graph = {"pool": _pool(EDIT_PLUS),
             "positive": _conditioning(comfy, "edit-positive.safetensors", {"cond": embeds, **references}),
             "negative": _conditioning(comfy, "edit-negative.safetensors", {"cond": negative, **references}),
             "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
             "sampler": _sampler(["positive", 0], ["negative", 0], ["latent", 0], 4.0),
             "save": {"class_type": "SaveLatent", "inputs": {"samples": ["sampler", 0], "filename_prefix": "edit_plus"}}}
    entry = comfy.wait(comfy.queue(graph), 300)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]

    config = parts["vae"].config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
    noise = torch.randn((1, 16, SIZE // 8, SIZE // 8), generator=torch.manual_seed(SEED))

    def expected(model_space: torch.Tensor) -> torch.Tensor:
        latents = diffusers_with_reference_latents(
            folder, "qwen-image-edit-plus", model_space, prompt_embeds=embeds, negative_prompt_embeds=negative,
            true_cfg_scale=4.0, latents=QwenImagePipeline._pack_latents(noise, 1, 16, SIZE // 8, SIZE // 8),
            num_inference_steps=STEPS, height=SIZE, width=SIZE)
        return QwenImagePipeline._unpack_latents(latents, SIZE, SIZE, 8) * std + mean

    saved, model_space = saved_latent(comfy, entry, "save"), ((vae_space - mean) / std)[:, :, 0]
    assert saved.shape == (1, 16, 1, SIZE // 8, SIZE // 8)
    assert (saved - expected(model_space)).abs().max().item() <= TOLERANCE
    assert (saved - expected(-model_space)).abs().max().item() > 100 * TOLERANCE
