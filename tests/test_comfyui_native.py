"""ComfyUI 0.33's own encoders' conditionings and its own image-to-video and edit nodes, on the pool.

ComfyUI's text encoders for the 2026 families (CLIPLoader types qwen_image, flux2, lumina2 for Z-Image,
hunyuan_video_15, wan) are built at their released sizes, so the tests hand xDiT Sampler the CONDITIONING they give,
in their layout, through the test-only node XDiTTestConditioning (tests/comfyui_probe/xdit_test_nodes.py): `cond`
with only the valid tokens (or padded, with `attention_mask`: Z-Image here), HunyuanVideo 1.5's byT5 glyph text as
`conditioning_byt5small`, Wan's UMT5 text padded with zeros to 512 tokens. The tensors are the tiny pipelines' own
encodings, so each LATENT must equal diffusers' single-process pipeline given those encodings (1e-4), sampled from
ComfyUI's own empty-latent node for the model; a conditioning of the real encoder's width is one node error naming
the widths and the encoder. Qwen-Image-Edit Plus takes TextEncodeQwenImageEdit(Plus)'s reference latents (two, as
VAEEncode gives them). HunyuanVideo 1.5 image-to-video takes ComfyUI's own HunyuanVideo15ImageToVideo node, its VAE
a tiny TAEHV written by ComfyUI's own code, with and without a clip_vision_output (Qwen-Image-Edit's nodes:
tests/test_comfyui_edit.py).
"""

from __future__ import annotations

import json
import subprocess
from unittest import mock

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file

from test_comfyui import _node_error, native_format_taken, saved_latent
from xdit_test_helpers import TOLERANCE, diffusers_latents

SEED, STEPS, POSITIVE, NEGATIVE = 7, 3, 'a neon sign that says "open" in the rain', "blurry"
# encoder type: (tiny family, video, empty-latent node, cfg, the released encoder's width)
ENCODERS = {"qwen_image": ("qwen-image", False, "EmptySD3LatentImage", 4.0, 3584),
            "flux2": ("flux2-klein", False, "EmptyFlux2LatentImage", 4.0, 7680),
            "lumina2": ("z-image", False, "EmptySD3LatentImage", 2.0, 2560),
            "hunyuan_video_15": ("hunyuanvideo15", True, "EmptyHunyuanVideo15Latent", 6.0, 3584),
            "wan": ("wan", True, "EmptyHunyuanLatentVideo", 5.0, 4096)}
HINTS = {"qwen_image": "Qwen-Image's CLIPLoader", "flux2": "CLIPLoader type flux2", "lumina2": "CLIPLoader type lumina2",
         "hunyuan_video_15": "CLIPLoader type hunyuan_video_15", "wan": "UMT5-XXL"}
SIZE, FRAMES = 48, 9  # video: 3 × 3 latent pixels (×16) or 6 × 6 (Wan, ×8), 3 latent frames
IMAGE_SIZE = 64


@pytest.fixture(autouse=True)
def _stop_pools(comfy):
    """Each test's pools stop after it: a module of seven 2-rank pools would hold ~7 GB for nothing."""
    yield
    for pool in comfy.get("/xdit/pools")["pools"]:
        if pool["status"].get("state") != "stopped":
            comfy.post(f"/xdit/pools/{pool['id']}/stop")


def _pool(model: str) -> dict:
    return {"class_type": "XDiTPool", "inputs": {
        "model": model, "nproc": 2, "ulysses_degree": 2, "ring_degree": 1, "pipefusion_degree": 1, "num_patches": 0,
        "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1, "text_encoders": True, "dtype": "auto", "devices": "",
        "threads_per_rank": 1, "endpoint": ""}}


def _sampler(positive, negative, latent, cfg: float) -> dict:
    return {"class_type": "XDiTSampler", "inputs": {
        "pool": ["pool", 0], "positive": positive, "negative": negative, "latent_image": latent, "seed": SEED,
        "steps": STEPS, "cfg": cfg, "sampler": "default", "denoise": 1.0, "preview": False}}


def _conditioning(comfy, name: str, tensors: dict) -> dict:
    save_file({k: v.contiguous() for k, v in tensors.items()}, comfy.work / "input" / name)
    return {"class_type": "XDiTTestConditioning", "inputs": {"tensors": name}}


def _encodings(pipeline, encoder: str, text: str) -> tuple[dict, dict]:
    """(what ComfyUI's own encoder gives, as conditioning tensors; the pipeline's own inputs for the same text)."""
    with torch.no_grad():
        if encoder == "hunyuan_video_15":
            embeds, mask, glyphs, glyph_mask = pipeline.encode_prompt(text, device="cpu")
            comfy = {"cond": embeds[:, mask[0].bool()]}  # ComfyUI drops the padding (and the mask where none is left)
            if glyph_mask.any():  # byT5 runs only for quoted text
                comfy["conditioning_byt5small"] = glyphs[:, glyph_mask[0].bool()]
            return comfy, {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": glyphs,
                           "prompt_embeds_mask_2": glyph_mask}
        if encoder == "wan":  # UMT5 padded with zeros to 512 tokens, ComfyUI's and diffusers' alike
            embeds, _ = pipeline.encode_prompt(text, do_classifier_free_guidance=False, max_sequence_length=512)
            return {"cond": embeds}, {"prompt_embeds": embeds}
        if encoder == "lumina2":  # valid tokens only; ComfyUI pads a batch of prompts and says so in attention_mask
            (embeds,), _ = pipeline.encode_prompt(text, do_classifier_free_guidance=False)
            padded = torch.cat([embeds[None], torch.zeros(1, 3, embeds.shape[-1])], 1)
            mask = torch.cat([torch.ones(1, embeds.shape[0]), torch.zeros(1, 3)], 1)
            return {"cond": padded, "attention_mask": mask}, {"prompt_embeds": [embeds]}
        embeds = pipeline.encode_prompt(text, device="cpu")[0]  # Qwen-Image, FLUX.2: [1, tokens, width]
        return {"cond": embeds}, {"prompt_embeds": embeds}


def _reference(pipeline, encoder: str, positive: dict, negative: dict, shape: tuple) -> torch.Tensor:
    """diffusers' pipeline in one process on those inputs and ComfyUI's noise of SEED, in ComfyUI's latent space."""
    family, video, _, cfg, _ = ENCODERS[encoder]
    noise = torch.randn(shape, generator=torch.manual_seed(SEED))
    inputs = {**positive, **{f"negative_{name}": value for name, value in negative.items()}}
    size = {"height": SIZE, "width": SIZE, **({"num_frames": FRAMES} if video else {})}
    if encoder == "hunyuan_video_15":
        from diffusers import ClassifierFreeGuidance

        pipeline.guider = ClassifierFreeGuidance(guidance_scale=cfg)
        latents = diffusers_latents(pipeline, family, **inputs, latents=noise, num_inference_steps=STEPS, **size)
        return latents / pipeline.vae.config.scaling_factor
    if encoder in ("qwen_image", "wan"):
        packed = encoder == "qwen_image"
        call = {"true_cfg_scale": cfg} if packed else {"guidance_scale": cfg}
        latents = pipeline._pack_latents(noise, 1, 16, SIZE // 8, SIZE // 8) if packed else noise
        latents = diffusers_latents(pipeline, family, **inputs, **call, latents=latents, num_inference_steps=STEPS, **size)
        latents = pipeline._unpack_latents(latents, SIZE, SIZE, 8) if packed else latents
        config = pipeline.vae.config
        mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
        return latents * std + mean
    guidance = cfg - 1 if encoder == "lumina2" else cfg
    latents = diffusers_latents(pipeline, family, **inputs, guidance_scale=guidance, latents=noise,
                                num_inference_steps=STEPS, **size)
    if encoder == "lumina2":
        return latents / 0.3611 + 0.1159  # ComfyUI's Flux latent format
    bn = pipeline.vae.bn  # FLUX.2 [klein] returns its latents unpatchified and denormalised
    std = torch.sqrt(bn.running_var + pipeline.vae.config.batch_norm_eps).view(1, -1, 1, 1)
    return (pipeline._patchify_latents(latents) - bn.running_mean.view(1, -1, 1, 1)) / std


@pytest.mark.parametrize("encoder", ENCODERS)
def test_comfyuis_own_encoder_conditioning_samples_like_diffusers(comfy, tiny_model_dirs, video_model_dirs, encoder):
    family, video, empty, cfg, released_width = ENCODERS[encoder]
    model_dir = (video_model_dirs if video else tiny_model_dirs)[family]
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    (positive, own_positive), (negative, own_negative) = (_encodings(pipeline, encoder, t) for t in (POSITIVE, NEGATIVE))
    latent = {"width": SIZE, "height": SIZE, "batch_size": 1, **({"length": FRAMES} if video else {})}
    graph = {"pool": _pool(f"xdit-tiny-{family} (built-in, no download)"),
             "positive": _conditioning(comfy, f"{encoder}-positive.safetensors", positive),
             "negative": _conditioning(comfy, f"{encoder}-negative.safetensors", negative),
             "latent": {"class_type": empty, "inputs": latent},
             "sampler": _sampler(["positive", 0], ["negative", 0], ["latent", 0], cfg),
             "save": {"class_type": "SaveLatent", "inputs": {"samples": ["sampler", 0], "filename_prefix": encoder}}}
    entry = comfy.wait(comfy.queue(graph), 300)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    saved = saved_latent(comfy, entry, "save")
    # the noise has the empty latent's shape (Qwen-Image's is an image latent, kept by ComfyUI as one frame)
    noise_shape = (1, 16, SIZE // 8, SIZE // 8) if encoder == "qwen_image" else tuple(saved.shape)
    expected = _reference(pipeline, encoder, own_positive, own_negative, noise_shape)
    assert saved.shape == expected.shape
    assert (saved - expected).abs().max().item() <= TOLERANCE
    if encoder == "hunyuan_video_15":  # negative control: the glyph stream is in play
        unseen = {**own_positive, "prompt_embeds_mask_2": own_positive["prompt_embeds_mask_2"] * 0}
        without = _reference(pipeline, encoder, unseen, own_negative, noise_shape)
        assert (saved - without).abs().max().item() > 100 * TOLERANCE
        assert native_format_taken(comfy, "HunyuanVideo15Pipeline", "HunyuanVideo15")

    wide = dict(positive, cond=torch.zeros(1, 5, released_width))
    graph["positive"] = _conditioning(comfy, f"{encoder}-released-width.safetensors", wide)
    error = _node_error(comfy, graph)
    assert f"prompt_embeds is {released_width} wide but this pool's" in error and "needs" in error, error[:1500]
    assert HINTS[encoder] in error, error[:1500]  # which of ComfyUI's encoders gives the right width


def test_xdit_empty_latent_makes_what_comfyuis_own_empty_latent_nodes_make(comfy):
    """xDiT Empty Latent, the fallback where ComfyUI has no empty-latent node for the model (0.3.64: FLUX.2,
    HunyuanVideo 1.5), makes what ComfyUI 0.33's EmptyFlux2LatentImage and EmptyHunyuanVideo15Latent make."""
    prompt, common = {}, {"width": 80, "height": 48, "batch_size": 2}
    for key, family, native, extra in (("flux2", "flux2-klein", "EmptyFlux2LatentImage", {}),
                                       ("hv15", "hunyuanvideo15", "EmptyHunyuanVideo15Latent", {"length": FRAMES})):
        prompt[f"{key}-pool"] = _pool(f"xdit-tiny-{family} (built-in, no download)")
        prompt[f"{key}-xdit"] = {"class_type": "XDiTEmptyLatent", "inputs": {"pool": [f"{key}-pool", 0], **common, **extra}}
        prompt[f"{key}-native"] = {"class_type": native, "inputs": {**common, **extra}}
        for which in ("xdit", "native"):
            prompt[f"save-{key}-{which}"] = {"class_type": "SaveLatent", "inputs": {
                "samples": [f"{key}-{which}", 0], "filename_prefix": f"empty_{key}_{which}"}}
    entry = comfy.wait(comfy.queue(prompt))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    for key, shape in (("flux2", (2, 128, 3, 5)), ("hv15", (2, 32, 3, 3, 5))):
        xdit, native = (saved_latent(comfy, entry, f"save-{key}-{which}") for which in ("xdit", "native"))
        assert xdit.shape == native.shape == shape and torch.equal(xdit, native)


TAEHV_SCRIPT = """
import sys
out = sys.argv[1]; sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import torch, comfy.latent_formats, comfy.taesd.taehv as taehv
from safetensors.torch import save_file
torch.manual_seed(0)
model = taehv.TAEHV(latent_channels=32, latent_format=comfy.latent_formats.HunyuanVideo15)  # lighttae_hv15's layout
weights = {}
for name, value in model.state_dict().items():  # ComfyUI's layers skip weight init: give them one
    weights[name] = torch.nn.init.kaiming_normal_(torch.empty(value.shape), a=1.0) if value.ndim > 1 else torch.zeros(value.shape)
save_file(weights, out)
"""
START_COLOR, VISION_TOKENS = 0x4080C0, 9


def test_hunyuan_video15_image_to_video_from_comfyuis_own_node_equals_diffusers(comfy):
    """xDiT Text Encode → ComfyUI's HunyuanVideo15ImageToVideo (its VAE a tiny TAEHV of ComfyUI's lighttae_hv15 layout,
    written by ComfyUI's own code; with a clip_vision_output, and without) → xDiT Sampler on the built-in tiny
    image-to-video model, which takes the node's start-image encoding and vision tokens as they come. Each equals
    diffusers' HunyuanVideo15ImageToVideoPipeline whose VAE encode gives ComfyUI's encoding of the same image
    (VAEEncode) and whose SigLIP gives those vision tokens (none: zeros, which its transformer masks)."""
    import types

    import PIL.Image
    from diffusers import ClassifierFreeGuidance

    from parallel.loading import builtin_models

    vae_file = comfy.work / "models" / "vae" / "xdit_taehv15_random.safetensors"
    subprocess.run([str(comfy.python), "-c", TAEHV_SCRIPT, str(vae_file)], cwd=comfy.comfy, check=True, capture_output=True)
    vision = torch.randn((1, VISION_TOKENS, 16), generator=torch.Generator().manual_seed(4))
    save_file({"last_hidden_state": vision}, comfy.work / "input" / "vision.safetensors")
    graph = {"pool": _pool("xdit-tiny-hunyuanvideo15-i2v (built-in, no download)"),
             "positive": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["pool", 0], "text": POSITIVE}},
             "negative": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["pool", 0], "text": NEGATIVE}},
             "vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae_file.name}},
             "image": {"class_type": "EmptyImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1,
                                                              "color": START_COLOR}},
             "vision": {"class_type": "XDiTTestClipVision", "inputs": {"tensors": "vision.safetensors"}},
             "encoded": {"class_type": "VAEEncode", "inputs": {"pixels": ["image", 0], "vae": ["vae", 0]}},
             "save-encoded": {"class_type": "SaveLatent", "inputs": {"samples": ["encoded", 0], "filename_prefix": "start"}}}
    for name, extra in (("with-vision", {"clip_vision_output": ["vision", 0]}), ("without", {})):
        graph[f"i2v-{name}"] = {"class_type": "HunyuanVideo15ImageToVideo", "inputs": {
            "positive": ["positive", 0], "negative": ["negative", 0], "vae": ["vae", 0], "width": SIZE, "height": SIZE,
            "length": FRAMES, "batch_size": 1, "start_image": ["image", 0], **extra}}
        graph[f"sampler-{name}"] = _sampler([f"i2v-{name}", 0], [f"i2v-{name}", 1], [f"i2v-{name}", 2], 6.0)
        graph[f"save-{name}"] = {"class_type": "SaveLatent", "inputs": {"samples": [f"sampler-{name}", 0],
                                                                        "filename_prefix": f"i2v_{name}"}}
    entry = comfy.wait(comfy.queue(graph), 300)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    start = saved_latent(comfy, entry, "save-encoded")
    assert start.shape == (1, 32, 1, SIZE // 16, SIZE // 16) and start.abs().max() > 0.1

    pipeline = DiffusionPipeline.from_pretrained(builtin_models.builtin_model_dir("xdit-tiny-hunyuanvideo15-i2v"))
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=6.0)
    names = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    with torch.no_grad():
        inputs = {**dict(zip(names, pipeline.encode_prompt(POSITIVE, device="cpu"))),
                  **{f"negative_{n}": t for n, t in zip(names, pipeline.encode_prompt(NEGATIVE, device="cpu"))}}
    noise = torch.randn((1, 32, (FRAMES - 1) // 4 + 1, SIZE // 16, SIZE // 16), generator=torch.manual_seed(SEED))
    picture = PIL.Image.new("RGB", (SIZE, SIZE), tuple(START_COLOR >> shift & 0xFF for shift in (16, 8, 0)))

    def expected(encoded: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        answer = types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: encoded))
        with mock.patch.object(pipeline.vae, "encode", lambda *a, **k: answer), \
                mock.patch.object(pipeline, "_get_image_embeds", lambda **k: embeds), \
                mock.patch.object(pipeline.video_processor, "calculate_default_height_width", lambda **k: (SIZE, SIZE)), \
                torch.no_grad():
            latents = pipeline(image=picture, **inputs, latents=noise, num_inference_steps=STEPS, num_frames=FRAMES,
                               output_type="latent", return_dict=False)[0]
        return latents / pipeline.vae.config.scaling_factor  # ComfyUI keeps the VAE's own latents

    no_vision = torch.zeros(1, VISION_TOKENS, 16)
    for name, embeds in (("with-vision", vision), ("without", no_vision)):
        saved = saved_latent(comfy, entry, f"save-{name}")
        assert saved.shape == noise.shape
        assert (saved - expected(start, embeds)).abs().max().item() <= TOLERANCE, name
    assert (saved - expected(-start, no_vision)).abs().max().item() > 100 * TOLERANCE  # the start image is in play
    assert (saved - expected(start, vision)).abs().max().item() > 100 * TOLERANCE  # and the vision tokens
    assert native_format_taken(comfy, "HunyuanVideo15ImageToVideoPipeline", "HunyuanVideo15")
