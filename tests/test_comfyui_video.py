"""A Wan video workflow in a real ComfyUI: EmptyHunyuanLatentVideo → xDiT Sampler → SaveLatent.

The tiny Wan 2.2 pipeline (two experts) samples 9 frames at 48×48 (27 tokens, split unevenly over
Ulysses 2) from ComfyUI's noise of the seed; the saved 5-D LATENT equals diffusers' single-process
result converted to ComfyUI's Wan21 latent space (x · std + mean) within 1e-4. Previews (the middle
latent frame) arrive over the websocket. Skipped without the ComfyUI test bed (tests/testbed.py).
"""

from __future__ import annotations

import json

import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from xdit_test_helpers import TOLERANCE, diffusers_latents

FAMILY, FRAMES, SIZE, STEPS, CFG, SEED = "wan22", 9, 48, 4, 5.0, 5
POSITIVE, NEGATIVE = "a red fox in the snow", "blurry"



def workflow() -> dict:
    return {
        "1": {"class_type": "XDiTPool", "inputs": {
            "model": f"xdit-tiny-{FAMILY} (built-in, no download)", "nproc": 2, "ulysses_degree": 2, "ring_degree": 1,
            "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1,
            "text_encoders": True, "dtype": "auto", "devices": "", "threads_per_rank": 1, "endpoint": ""}},
        "2": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": POSITIVE}},
        "3": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": NEGATIVE}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": SIZE, "height": SIZE, "length": FRAMES, "batch_size": 1}},
        "5": {"class_type": "XDiTSampler", "inputs": {
            "pool": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": SEED,
            "steps": STEPS, "cfg": CFG, "sampler": "default", "denoise": 1.0, "preview": True}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"video_{FAMILY}"}},
    }


def reference(model_dir) -> torch.Tensor:
    """diffusers' result for ComfyUI's noise of SEED, in ComfyUI's Wan21 latent space."""
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    shape = (1, 16, (FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8)
    noise = torch.randn(shape, generator=torch.manual_seed(SEED))
    with torch.no_grad():
        positive, _ = pipeline.encode_prompt(POSITIVE, do_classifier_free_guidance=False, max_sequence_length=512)
        negative, _ = pipeline.encode_prompt(NEGATIVE, do_classifier_free_guidance=False, max_sequence_length=512)
    latents = diffusers_latents(pipeline, prompt_embeds=positive, negative_prompt_embeds=negative, latents=noise,
                                guidance_scale=CFG, num_inference_steps=STEPS, height=SIZE, width=SIZE, num_frames=FRAMES)
    # WanPipeline's own decode step: ComfyUI's Wan21 process_out has the same numbers.
    mean = torch.tensor(pipeline.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipeline.vae.config.latents_std).view(1, -1, 1, 1, 1)
    return latents * std + mean


def test_wan_video_workflow_equals_diffusers_and_streams_previews(comfy, video_model_dirs):
    prompt_id, _, previews, _ = comfy.run_watching(workflow())
    entry = comfy.wait(prompt_id)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    assert previews >= 1
    info = entry["outputs"]["6"]["latents"][0]
    latent = load_file(comfy.work / "output" / info["subfolder"] / info["filename"])["latent_tensor"]
    expected = reference(video_model_dirs[FAMILY])
    assert latent.shape == expected.shape == (1, 16, 3, SIZE // 8, SIZE // 8)
    assert (latent - expected).abs().max().item() <= TOLERANCE
