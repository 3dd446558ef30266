"""A Wan video workflow in a real ComfyUI: EmptyHunyuanLatentVideo → xDiT Sampler → SaveLatent.

The tiny Wan 2.2 pipeline (two experts) samples 9 frames at 48×48 (27 tokens, split unevenly over
Ulysses 2) from ComfyUI's noise of the seed; the saved 5-D LATENT equals diffusers' single-process
result converted to ComfyUI's Wan21 latent space (x · std + mean) within 1e-4. Previews (the middle
latent frame) arrive over the websocket. A second xDiT Sampler at denoise 0.6 restyles that video
(video-to-video, ComfyUI's meaning of denoise) and equals diffusers' WanPipeline on the tail of a 6-step
schedule from the first video noised with ComfyUI's noise of its seed (tests/test_pool_video.py builds
that reference). xDiT VAE Decode decodes the first video on the pool's two ranks; SaveImage's frames
equal diffusers' tiled decode of the saved latent to 8-bit truncation.

Wan 2.2 image-to-video as ComfyUI hands it over: EmptyImage → ComfyUI's own WanImageToVideo (its VAE a Wan
2.1 VAE of the real architecture with random weights, written by ComfyUI's own code) → xDiT Sampler equals
diffusers' WanImageToVideoPipeline with that same VAE (loaded by diffusers' from_single_file) encoding the
start image itself.

Wan 2.2 TI2V 5B end to end: ComfyUI's own Wan22ImageToVideoLatent makes its 48-channel latent (its VAE
input, unused without a start image, is a tiny TAESD written by ComfyUI's own code), and xDiT Sampler's
result equals diffusers' in ComfyUI's Wan22 latent space.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import torch
from PIL import Image
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from test_comfyui import native_format_taken
from test_pool_video import tiled_reference, video_to_video_reference
from xdit_test_helpers import TOLERANCE, diffusers_latents

FAMILY, FRAMES, SIZE, STEPS, CFG, SEED = "wan22", 9, 48, 4, 5.0, 5
DENOISE, SEED_2 = 0.6, 11
SIZE_5B = 64  # TI2V 5B's ×16 VAE: 4 × 4 latent pixels, 3 latent frames, 12 tokens
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
        "7": {"class_type": "XDiTSampler", "inputs": {
            "pool": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["5", 0], "seed": SEED_2,
            "steps": STEPS, "cfg": CFG, "sampler": "default", "denoise": DENOISE, "preview": False}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"video2video_{FAMILY}"}},
        "9": {"class_type": "XDiTVAEDecode", "inputs": {"pool": ["1", 0], "samples": ["5", 0], "tile_size": 0}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": f"frames_{FAMILY}"}},
    }


SHAPE = (1, 16, (FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8)


def reference(model_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' results for ComfyUI's noise of SEED, and of the video-to-video pass from it with
    ComfyUI's noise of SEED_2, in ComfyUI's Wan21 latent space."""
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    with torch.no_grad():
        positive, _ = pipeline.encode_prompt(POSITIVE, do_classifier_free_guidance=False, max_sequence_length=512)
        negative, _ = pipeline.encode_prompt(NEGATIVE, do_classifier_free_guidance=False, max_sequence_length=512)
    inputs = {"prompt_embeds": positive, "negative_prompt_embeds": negative}
    latents = diffusers_latents(pipeline, **inputs, latents=torch.randn(SHAPE, generator=torch.manual_seed(SEED)),
                                guidance_scale=CFG, num_inference_steps=STEPS, height=SIZE, width=SIZE, num_frames=FRAMES)
    params = {"steps": STEPS, "guidance_scale": CFG, "height": SIZE, "width": SIZE, "denoise": DENOISE,
              "call": {"num_frames": FRAMES}}
    noise = torch.randn(SHAPE, generator=torch.manual_seed(SEED_2))
    restyled = video_to_video_reference(model_dir, {**inputs, "latents": noise}, latents, params)
    # WanPipeline's own decode step: ComfyUI's Wan21 process_out has the same numbers.
    mean = torch.tensor(pipeline.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipeline.vae.config.latents_std).view(1, -1, 1, 1, 1)
    return latents * std + mean, restyled * std + mean


def test_wan_video_workflow_equals_diffusers_and_streams_previews(comfy, video_model_dirs):
    prompt_id, _, previews, _ = comfy.run_watching(workflow())
    entry = comfy.wait(prompt_id)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    assert previews >= 1
    saved = {}
    for node in ("6", "8"):
        info = entry["outputs"][node]["latents"][0]
        saved[node] = load_file(comfy.work / "output" / info["subfolder"] / info["filename"])["latent_tensor"]
    expected, restyled = reference(video_model_dirs[FAMILY])
    assert saved["6"].shape == expected.shape == (1, 16, 3, SIZE // 8, SIZE // 8)
    assert (saved["6"] - expected).abs().max().item() <= TOLERANCE
    assert (saved["8"] - restyled).abs().max().item() <= TOLERANCE
    assert (saved["8"] - expected).abs().max().item() > 100 * TOLERANCE  # the second pass did restyle it
    frames = [entry["outputs"]["10"]["images"][i] for i in range(FRAMES)]
    pixels = torch.stack([torch.from_numpy(np.array(Image.open(comfy.work / "output" / f["subfolder"] / f["filename"])))
                          for f in frames]).float() / 255
    decoded = (tiled_reference(video_model_dirs[FAMILY], saved["6"], 2)[0] / 2 + 0.5).clamp(0, 1).movedim(0, -1)
    assert pixels.shape == decoded.shape == (FRAMES, SIZE, SIZE, 3)
    assert (pixels - decoded).abs().max().item() <= 1 / 255 + TOLERANCE  # SaveImage truncates to 8 bits


def ti2v_workflow(vae_name: str) -> dict:
    graph = workflow()
    graph["1"]["inputs"]["model"] = "xdit-tiny-wan22-5b (built-in, no download)"
    graph["4"] = {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}}
    graph["11"] = {"class_type": "Wan22ImageToVideoLatent", "inputs": {
        "vae": ["4", 0], "width": SIZE_5B, "height": SIZE_5B, "length": FRAMES, "batch_size": 1}}
    graph["5"]["inputs"]["latent_image"] = ["11", 0]
    graph["6"]["inputs"]["filename_prefix"] = "video_wan22-5b"
    return {key: graph[key] for key in ("1", "2", "3", "4", "11", "5", "6")}


def test_wan22_ti2v_5b_workflow_equals_diffusers(comfy, video_model_dirs):
    vae_name = "xdit_tiny_taesd48.safetensors"
    script = ("import sys; out = sys.argv[1]; sys.argv = sys.argv[:1] + ['--cpu']; import comfy.options; "
              "comfy.options.enable_args_parsing(); import comfy.taesd.taesd as t; "
              "from safetensors.torch import save_file; save_file(t.TAESD(latent_channels=48).state_dict(), out)")
    subprocess.run([str(comfy.python), "-c", script, str(comfy.work / "models" / "vae" / vae_name)],
                   cwd=comfy.comfy, check=True, capture_output=True)
    entry = comfy.wait(comfy.queue(ti2v_workflow(vae_name)))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    info = entry["outputs"]["6"]["latents"][0]
    latent = load_file(comfy.work / "output" / info["subfolder"] / info["filename"])["latent_tensor"]

    pipeline = DiffusionPipeline.from_pretrained(video_model_dirs["wan22-5b"])
    with torch.no_grad():
        positive, _ = pipeline.encode_prompt(POSITIVE, do_classifier_free_guidance=False, max_sequence_length=512)
        negative, _ = pipeline.encode_prompt(NEGATIVE, do_classifier_free_guidance=False, max_sequence_length=512)
    shape = (1, 48, (FRAMES - 1) // 4 + 1, SIZE_5B // 16, SIZE_5B // 16)
    expected = diffusers_latents(pipeline, prompt_embeds=positive, negative_prompt_embeds=negative,
                                 latents=torch.randn(shape, generator=torch.manual_seed(SEED)), guidance_scale=CFG,
                                 num_inference_steps=STEPS, height=SIZE_5B, width=SIZE_5B, num_frames=FRAMES)
    mean = torch.tensor(pipeline.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipeline.vae.config.latents_std).view(1, -1, 1, 1, 1)
    expected = expected * std + mean  # ComfyUI's Wan22 process_out
    assert latent.shape == expected.shape == shape
    assert (latent - expected).abs().max().item() <= TOLERANCE


WAN_VAE_SCRIPT = """
import math, sys
out = sys.argv[1]; sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import torch, comfy.ldm.wan.vae as wan
from safetensors.torch import save_file
torch.manual_seed(0)
vae = wan.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0)
weights = {}
for name, value in vae.state_dict().items():  # ComfyUI's layers skip weight init: give them torch's default
    w = torch.empty(value.shape)
    if w.ndim > 1:
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    else:
        w.fill_(1.0 if name.endswith("gamma") else 0.0)
    weights[name] = w.half()
save_file(weights, out)
"""
START_COLOR = 0x4080C0


def test_wan_image_to_video_from_comfyuis_node_equals_diffusers(comfy, tmp_path):
    from diffusers import AutoencoderKLWan

    from parallel.loading import tiny_models

    vae_file = comfy.work / "models" / "vae" / "xdit_wan21_vae_random.safetensors"
    subprocess.run([str(comfy.python), "-c", WAN_VAE_SCRIPT, str(vae_file)], cwd=comfy.comfy, check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(comfy.comfy)})
    graph = workflow()
    graph["1"]["inputs"]["model"] = "xdit-tiny-wan22-i2v (built-in, no download)"
    graph["4"] = {"class_type": "VAELoader", "inputs": {"vae_name": vae_file.name}}
    graph["11"] = {"class_type": "EmptyImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1, "color": START_COLOR}}
    graph["12"] = {"class_type": "WanImageToVideo", "inputs": {
        "positive": ["2", 0], "negative": ["3", 0], "vae": ["4", 0], "width": SIZE, "height": SIZE, "length": FRAMES,
        "batch_size": 1, "start_image": ["11", 0]}}
    graph["5"]["inputs"].update(positive=["12", 0], negative=["12", 1], latent_image=["12", 2])
    graph["6"]["inputs"]["filename_prefix"] = "i2v_wan22"
    entry = comfy.wait(comfy.queue({key: graph[key] for key in ("1", "2", "3", "4", "11", "12", "5", "6")}))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    info = entry["outputs"]["6"]["latents"][0]
    latent = load_file(comfy.work / "output" / info["subfolder"] / info["filename"])["latent_tensor"]

    pipeline = DiffusionPipeline.from_pretrained(tiny_models.save_tiny_pipeline("wan22-i2v", tmp_path / "i2v"))
    config = tmp_path / "vae_config"
    with torch.device("meta"):
        AutoencoderKLWan().save_config(config)
    pipeline.vae = AutoencoderKLWan.from_single_file(str(vae_file), config=str(config), torch_dtype=torch.float32)
    with torch.no_grad():
        positive, _ = pipeline.encode_prompt(POSITIVE, do_classifier_free_guidance=False, max_sequence_length=512)
        negative, _ = pipeline.encode_prompt(NEGATIVE, do_classifier_free_guidance=False, max_sequence_length=512)
    rgb = torch.tensor([(START_COLOR >> shift & 0xFF) / 0xFF for shift in (16, 8, 0)])
    image = rgb.view(1, 3, 1, 1).expand(1, 3, SIZE, SIZE)
    expected = diffusers_latents(pipeline, prompt_embeds=positive, negative_prompt_embeds=negative, image=image,
                                 latents=torch.randn(SHAPE, generator=torch.manual_seed(SEED)), guidance_scale=CFG,
                                 num_inference_steps=STEPS, height=SIZE, width=SIZE, num_frames=FRAMES)
    mean = torch.tensor(pipeline.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipeline.vae.config.latents_std).view(1, -1, 1, 1, 1)
    expected = expected * std + mean
    assert latent.shape == expected.shape == SHAPE
    assert (latent - expected).abs().max().item() <= TOLERANCE


HV15, HV15_SIZE, HV15_CFG = "hunyuanvideo15", 48, 6.0  # ×16 VAE: 3 × 3 latent pixels, 3 latent frames, 27 tokens
HV15_POSITIVE = 'a neon sign that says "open" in the rain'  # a quoted text: byT5 glyph tokens too


def hunyuan_video15_workflow() -> dict:
    """ComfyUI 0.33's own EmptyHunyuanVideo15Latent (32 channels at 1/16) and HunyuanVideo15 latent format; xDiT Text
    Encode (both text streams and their masks travel in the CONDITIONING). On 0.3.64, which has neither, xDiT Empty
    Latent and the family's declared format stand in (tests/test_families.py checks they convert alike)."""
    graph = workflow()
    graph["1"]["inputs"]["model"] = f"xdit-tiny-{HV15} (built-in, no download)"
    graph["2"]["inputs"]["text"] = HV15_POSITIVE
    graph["4"] = {"class_type": "EmptyHunyuanVideo15Latent", "inputs": {
        "width": HV15_SIZE, "height": HV15_SIZE, "length": FRAMES, "batch_size": 1}}
    graph["5"]["inputs"]["cfg"] = HV15_CFG
    graph["6"]["inputs"]["filename_prefix"] = f"video_{HV15}"
    return {key: graph[key] for key in ("1", "2", "3", "4", "5", "6")}


def test_hunyuan_video15_workflow_equals_diffusers(comfy, video_model_dirs):
    from diffusers import ClassifierFreeGuidance

    entry = comfy.wait(comfy.queue(hunyuan_video15_workflow()))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    info = entry["outputs"]["6"]["latents"][0]
    saved = load_file(comfy.work / "output" / info["subfolder"] / info["filename"])["latent_tensor"]
    pipeline = DiffusionPipeline.from_pretrained(video_model_dirs[HV15])
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=HV15_CFG)
    names = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    with torch.no_grad():
        inputs = {**dict(zip(names, pipeline.encode_prompt(HV15_POSITIVE, device="cpu"))),
                  **{f"negative_{n}": t for n, t in zip(names, pipeline.encode_prompt(NEGATIVE, device="cpu"))}}
    assert inputs["prompt_embeds_mask_2"].sum() > 0  # the glyph stream is in play
    shape = (1, 32, (FRAMES - 1) // 4 + 1, HV15_SIZE // 16, HV15_SIZE // 16)
    noise = torch.randn(shape, generator=torch.manual_seed(SEED))
    with torch.no_grad():
        latents = pipeline(**inputs, latents=noise, num_inference_steps=STEPS, height=HV15_SIZE, width=HV15_SIZE,
                           num_frames=FRAMES, output_type="latent", return_dict=False)[0]
    expected = latents / pipeline.vae.config.scaling_factor  # ComfyUI keeps the VAE's own latents
    assert saved.shape == expected.shape == shape
    assert (saved - expected).abs().max().item() <= TOLERANCE
    assert (saved - latents).abs().max().item() > 100 * TOLERANCE  # the scale is applied, not skipped
    assert native_format_taken(comfy, "HunyuanVideo15Pipeline", "HunyuanVideo15")  # ComfyUI's class, not the declared
