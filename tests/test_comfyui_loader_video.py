"""Load Diffusion Model (xDiT Pool) on Wan and HunyuanVideo 1.5 in a real ComfyUI 0.33: the sampling part of the
official Wan 2.1 text-to-video, Wan 2.2 14B and HunyuanVideo 1.5 720p templates runs with only UNETLoader swapped,
and gives what ComfyUI's own model gives on the same files.

The files are tiny transformers in their own layouts (Wan's, Tencent's) at ComfyUI's fixed head size (128) and text
widths, which ComfyUI's UNETLoader detects natively. The prompt is a CONDITIONING in the text encoder's layout (the
test-only XDiTTestConditioning node: UMT5-XXL and Qwen2.5-VL 7B are too big for a CPU test), the same for both models.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_comfyui_loader import _loader, _run
from xdit_test_helpers import TOLERANCE

# ComfyUI's attention as on the GPUs a pool runs on (PyTorch's SDPA, its default there), not its CPU default (the
# sub-quadratic kernel, whose 1e-5 rounding CFG 5 and multistep samplers carry to 1e-3 on these peaked tiny models)
COMFY_ARGS = ("--use-pytorch-cross-attention",)

WAN21 = "tiny-wan21-t2v-comfy.safetensors"
WAN22 = {"high": "tiny_wan2.2_t2v_high_noise_14B_fp16.safetensors",  # names as Comfy-Org ships the pair
         "low": "tiny_wan2.2_t2v_low_noise_14B_fp16.safetensors"}
STEPS, SIZE, FRAMES = 4, 64, 5


def _wan_file(comfy, name: str, seed: int, in_channels: int = 16, out_channels: int = 16, peak: float = 4.0,
              **more) -> None:
    """A two-block Wan 2.1-architecture transformer, attention made peaked (q and k × `peak`), in Wan's own names
    (`more`: Wan 2.1 I2V's CLIP vision widths)."""
    from diffusers import WanTransformer3DModel

    from original_layouts import original_layout
    from parallel.loading import tiny_models

    transformer = tiny_models._peak_attention(tiny_models._seeded(
        seed, WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128,
        in_channels=in_channels, out_channels=out_channels, text_dim=4096, freq_dim=256, ffn_dim=512, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, **more), peak)
    weights = original_layout("wan", transformer)
    save_file({k: v.contiguous() for k, v in weights.items()}, comfy.work / "models" / "diffusion_models" / name)


def _prompts(comfy) -> None:
    """UMT5's CONDITIONING for a positive and a negative prompt as ComfyUI's wan encoder gives it: [1, 512, 4096], the
    tokens after the prompt's zeroed (its tokenizer pads to 512, its model zeroes the masked tokens)."""
    g = torch.Generator().manual_seed(11)
    for name, tokens in (("wan-positive", 12), ("wan-negative", 7)):
        cond = torch.zeros(1, 512, 4096)
        cond[:, :tokens] = torch.randn(1, tokens, 4096, generator=g)
        save_file({"cond": cond}, comfy.work / "input" / f"{name}.safetensors")


def _unet(name: str, swapped: bool) -> dict:
    if swapped:
        loader = _loader(ulysses_degree=2)
        return {**loader, "inputs": {**loader["inputs"], "unet_name": name}}
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def _common() -> dict:
    return {
        "positive": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": "wan-positive.safetensors"}},
        "negative": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": "wan-negative.safetensors"}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {  # the Wan templates' empty latent
            "width": SIZE, "height": SIZE, "length": FRAMES, "batch_size": 1}},
    }


def _wan21_template(swapped: bool, shift: float = 8.0) -> dict:
    """Wan 2.1 text-to-video's sampling part: ModelSamplingSD3 (shift 8), KSampler uni_pc / simple at cfg 6."""
    return {
        **_common(),
        "unet": _unet(WAN21, swapped),
        "shift": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["unet", 0], "shift": shift}},
        "ksampler": {"class_type": "KSampler", "inputs": {
            "model": ["shift", 0], "seed": 5, "steps": STEPS, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple",
            "positive": ["positive", 0], "negative": ["negative", 0], "latent_image": ["latent", 0], "denoise": 1.0}},
        "save-ksampler": {"class_type": "SaveLatent", "inputs": {"samples": ["ksampler", 0], "filename_prefix": "wan21"}},
    }


def test_wan21_text_to_video_with_the_loader_swapped_equals_comfyuis_own_wan(comfy):
    _wan_file(comfy, WAN21, seed=6)
    _prompts(comfy)
    stock = _run(comfy, _wan21_template(swapped=False))["ksampler"]
    swapped = _run(comfy, _wan21_template(swapped=True))["ksampler"]
    assert swapped.shape == stock.shape == (1, 16, 2, SIZE // 8, SIZE // 8)
    assert stock.abs().max().item() > 0.1
    assert (swapped - stock).abs().max().item() <= TOLERANCE
    # negative control: another shift samples another video
    assert (_run(comfy, _wan21_template(swapped=True, shift=3.0))["ksampler"] - stock).abs().max().item() > 1e-3


def _wan22_template(swapped: bool, experts: tuple[str, str] = ("high", "low")) -> dict:
    """Wan 2.2 14B text-to-video's sampling part: one loader per expert, each through ModelSamplingSD3 (shift 8);
    KSamplerAdvanced on the high-noise expert for the first half of the steps (leftover noise returned), then on
    the low-noise expert for the rest."""
    first, second = experts
    half = {"noise_seed": 5, "steps": STEPS, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["positive", 0], "negative": ["negative", 0]}
    return {
        **_common(),
        "unet-high": _unet(WAN22[first], swapped),
        "unet-low": _unet(WAN22[second], swapped),
        "shift-high": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["unet-high", 0], "shift": 8.0}},
        "shift-low": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["unet-low", 0], "shift": 8.0}},
        "high": {"class_type": "KSamplerAdvanced", "inputs": {
            **half, "model": ["shift-high", 0], "add_noise": "enable", "latent_image": ["latent", 0],
            "start_at_step": 0, "end_at_step": STEPS // 2, "return_with_leftover_noise": "enable"}},
        "low": {"class_type": "KSamplerAdvanced", "inputs": {
            **half, "model": ["shift-low", 0], "add_noise": "disable", "latent_image": ["high", 0],
            "start_at_step": STEPS // 2, "end_at_step": 10000, "return_with_leftover_noise": "disable"}},
        "save-low": {"class_type": "SaveLatent", "inputs": {"samples": ["low", 0], "filename_prefix": "wan22"}},
    }


def test_wan22_expert_pair_with_both_loaders_swapped_equals_comfyuis_own_and_shares_one_pool(comfy):
    """Two loaders, one per expert file: one pool holds both experts (one start, no second pool), each MODEL calls
    its own expert; the result equals ComfyUI's own two UNETLoaders. Negative control: the experts crossed."""
    for kind, seed in (("high", 3), ("low", 6)):
        _wan_file(comfy, WAN22[kind], seed)
    _prompts(comfy)
    expected = _run(comfy, _wan22_template(swapped=False))["low"]
    assert expected.abs().max().item() > 0.1
    ours = _run(comfy, _wan22_template(swapped=True))["low"]
    assert (ours - expected).abs().max().item() <= TOLERANCE
    pools = [p for p in comfy.get("/xdit/pools")["pools"] if "wan2.2" in p["key"]["model"]]
    assert len(pools) == 1 and pools[0]["key"]["model"].endswith(WAN22["high"]), pools
    # each rank holds both experts whole, nothing more: the two files' bytes (bench/RESULTS.md sizes the released pair)
    held = sum(tensor.numel() * tensor.element_size() for kind in ("high", "low")
               for tensor in load_file(comfy.work / "models" / "diffusion_models" / WAN22[kind]).values())
    assert [rank["parameter_bytes"] for rank in pools[0]["status"]["memory"]] == [held, held]
    crossed = _run(comfy, _wan22_template(swapped=True, experts=("low", "high")))["low"]
    assert (crossed - expected).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------ image-to-video, TI2V 5B
I2V = {"high": "tiny_wan2.2_i2v_high_noise_14B_fp16.safetensors", "low": "tiny_wan2.2_i2v_low_noise_14B_fp16.safetensors",
       "wan21": "tiny_wan2.1_i2v_480p_14B_fp16.safetensors", "5b": "tiny_wan2.2_ti2v_5B_fp16.safetensors"}
CLIP_VISION = 1280  # ComfyUI's Wan 2.1 I2V projects CLIP ViT-H's 1280-wide features (fixed in its code)


def _wan_vae(comfy) -> None:
    """The Wan 2.1 VAE at width 8 in its own layout (ComfyUI reads the width from the file)."""
    from diffusers import AutoencoderKLWan

    from original_layouts import wan_vae_to_original
    from parallel.loading import tiny_models

    vae = tiny_models._seeded(5, AutoencoderKLWan, base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                              temperal_downsample=[False, True, True])
    save_file({k: v.contiguous() for k, v in wan_vae_to_original(vae).items()},
              comfy.work / "models" / "vae" / "tiny_wan_2.1_vae.safetensors")


@pytest.fixture(scope="module")
def i2v_files(comfy) -> None:
    """Wan 2.2 I2V A14B's two experts and Wan 2.1 I2V (36 input channels: noise, frame mask, start image; the
    latter with CLIP vision), Wan 2.2 TI2V 5B (48 channels); the Wan 2.1 VAE at width 8 in its own layout (ComfyUI
    reads the width from the file) for WanImageToVideo, a start image, CLIP vision features."""
    import numpy as np
    from PIL import Image

    for kind, seed in (("high", 3), ("low", 6)):
        _wan_file(comfy, I2V[kind], seed, in_channels=36)
    # ComfyUI's Wan computes its timestep embedding's frequencies as 10000^(-i/128), diffusers as exp(-i·ln 10000/128):
    # 3e-6 apart per call, which CFG 5 and UniPC carry to 3e-4 through this model's extra image attention at peak 4
    _wan_file(comfy, I2V["wan21"], 4, in_channels=36, peak=2.0, image_dim=CLIP_VISION, added_kv_proj_dim=256)
    _wan_file(comfy, I2V["5b"], 5, in_channels=48, out_channels=48)
    _wan_vae(comfy)
    g = torch.Generator().manual_seed(12)
    Image.fromarray(torch.randint(0, 256, (SIZE, SIZE, 3), generator=g, dtype=torch.uint8).numpy().astype(np.uint8)).save(
        comfy.work / "input" / "wan-start.png")
    save_file({"penultimate_hidden_states": torch.randn(1, 257, CLIP_VISION, generator=g)},
              comfy.work / "input" / "wan-clip-vision.safetensors")
    # Wan22ImageToVideoLatent's LATENT (its Wan 2.2 VAE is built at width 160): the start frame's latent first, the
    # rest zero; noise mask 0 on the start frame
    latent = torch.zeros(1, 48, 2, SIZE // 16, SIZE // 16)
    latent[:, :, :1] = torch.randn(1, 48, 1, SIZE // 16, SIZE // 16, generator=g)
    mask = torch.ones(1, 1, 2, SIZE // 16, SIZE // 16)
    mask[:, :, :1] = 0
    save_file({"samples": latent, "noise_mask": mask}, comfy.work / "input" / "wan22-5b-i2v.safetensors")
    save_file({"samples": latent}, comfy.work / "input" / "wan22-5b-i2v-unmasked.safetensors")
    save_file({"samples": torch.zeros(1, 48, 2, SIZE // 16, SIZE // 16)}, comfy.work / "input" / "wan22-5b-t2v.safetensors")
    _prompts(comfy)


def _image_to_video(prompt: dict, clip_vision: bool = False) -> dict:
    """WanImageToVideo as the templates wire it: the prompts, the VAE, the start image (and CLIP vision)."""
    prompt.update({
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan_2.1_vae.safetensors"}},
        "image": {"class_type": "LoadImage", "inputs": {"image": "wan-start.png"}},
        "i2v": {"class_type": "WanImageToVideo", "inputs": {
            "positive": ["positive", 0], "negative": ["negative", 0], "vae": ["vae", 0], "width": SIZE, "height": SIZE,
            "length": FRAMES, "batch_size": 1, "start_image": ["image", 0]}},
    })
    if clip_vision:
        prompt["clip"] = {"class_type": "XDiTTestClipVision", "inputs": {"tensors": "wan-clip-vision.safetensors"}}
        prompt["i2v"]["inputs"]["clip_vision_output"] = ["clip", 0]
    return prompt


def _wan22_i2v_template(swapped: bool, image: bool = True) -> dict:
    """Wan 2.2 14B image-to-video's sampling part: _wan22_template on WanImageToVideo's conditioning and latent,
    ModelSamplingSD3 at shift 5."""
    prompt = _image_to_video(_wan22_template(swapped))
    for name, kind in (("unet-high", "high"), ("unet-low", "low")):
        prompt[name] = _unet(I2V[kind], swapped)
        prompt[f"shift-{kind}"]["inputs"]["shift"] = 5.0
        prompt[kind]["inputs"].update(positive=["i2v", 0], negative=["i2v", 1])
    prompt["high"]["inputs"]["latent_image"] = ["i2v", 2]
    if not image:  # negative control: WanImageToVideo without its start image
        del prompt["i2v"]["inputs"]["start_image"]
    return prompt


def test_wan22_image_to_video_with_both_loaders_swapped_equals_comfyuis_own(comfy, i2v_files):
    expected = _run(comfy, _wan22_i2v_template(swapped=False))["low"]
    assert expected.abs().max().item() > 0.1
    assert (_run(comfy, _wan22_i2v_template(swapped=True))["low"] - expected).abs().max().item() <= TOLERANCE
    assert (_run(comfy, _wan22_i2v_template(swapped=True, image=False))["low"] - expected).abs().max().item() > 1e-3


def _wan22_flf2v_template(swapped: bool, end: bool = True) -> dict:
    """Wan 2.2 14B first-last-frame-to-video (its FLF2V template): the image-to-video sampling part on
    WanFirstLastFrameToVideo's conditioning and latent, the start and the end frame through the VAE."""
    prompt = _wan22_i2v_template(swapped)
    prompt["end-image"] = {"class_type": "LoadImage", "inputs": {"image": "wan-end.png"}}
    prompt["i2v"] = {"class_type": "WanFirstLastFrameToVideo", "inputs": {
        **prompt["i2v"]["inputs"], **({"end_image": ["end-image", 0]} if end else {})}}
    return prompt


def test_wan22_first_last_frame_to_video_with_both_loaders_swapped_equals_comfyuis_own(comfy, i2v_files):
    import numpy as np
    from PIL import Image

    g = torch.Generator().manual_seed(13)
    Image.fromarray(torch.randint(0, 256, (SIZE, SIZE, 3), generator=g, dtype=torch.uint8).numpy().astype(np.uint8)).save(
        comfy.work / "input" / "wan-end.png")
    expected = _run(comfy, _wan22_flf2v_template(swapped=False))["low"]
    assert expected.abs().max().item() > 0.1
    assert (_run(comfy, _wan22_flf2v_template(swapped=True))["low"] - expected).abs().max().item() <= TOLERANCE
    # negative control: the end frame shapes the video (against the start frame alone)
    assert (_run(comfy, _wan22_flf2v_template(swapped=True, end=False))["low"] - expected).abs().max().item() > 1e-3


def _wan21_i2v(swapped: bool, clip_vision: bool = True) -> dict:
    """Wan 2.1 I2V: WanImageToVideo with CLIP vision features, KSampler at cfg 5 (on CFG 2 for the loader)."""
    prompt = _image_to_video(_wan21_template(swapped), clip_vision=clip_vision)
    prompt["unet"] = _unet(I2V["wan21"], False) if not swapped else {**_loader(cfg_parallel=True), "inputs": {
        **_loader(cfg_parallel=True)["inputs"], "unet_name": I2V["wan21"]}}
    prompt["ksampler"]["inputs"].update(positive=["i2v", 0], negative=["i2v", 1], latent_image=["i2v", 2], cfg=5.0)
    return prompt


def test_wan21_image_to_video_with_clip_vision_on_cfg_2_equals_comfyuis_own(comfy, i2v_files):
    expected = _run(comfy, _wan21_i2v(swapped=False))["ksampler"]
    assert (_run(comfy, _wan21_i2v(swapped=True))["ksampler"] - expected).abs().max().item() <= TOLERANCE
    other = _run(comfy, _wan21_i2v(swapped=False, clip_vision=False))["ksampler"]
    assert (other - expected).abs().max().item() > 1e-3  # negative control: the CLIP vision features act


def _wan22_5b_template(swapped: bool, latent: str) -> dict:
    """Wan 2.2 TI2V 5B's sampling part: ModelSamplingSD3 (shift 8), KSampler uni_pc / simple at cfg 5, on
    Wan22ImageToVideoLatent's LATENT (with a start image: its noise mask keeps the first frame)."""
    prompt = _wan21_template(swapped)
    prompt["unet"] = _unet(I2V["5b"], swapped)
    prompt["latent"] = {"class_type": "XDiTTestLatent", "inputs": {"tensors": f"wan22-5b-{latent}.safetensors"}}
    prompt["ksampler"]["inputs"]["cfg"] = 5.0
    return prompt


def test_wan22_ti2v_5b_text_and_image_to_video_with_the_loader_swapped_equal_comfyuis_own(comfy, i2v_files):
    for latent in ("t2v", "i2v"):
        expected = _run(comfy, _wan22_5b_template(swapped=False, latent=latent))["ksampler"]
        assert expected.shape == (1, 48, 2, SIZE // 16, SIZE // 16) and expected.abs().max().item() > 0.1
        got = _run(comfy, _wan22_5b_template(swapped=True, latent=latent))["ksampler"]
        assert (got - expected).abs().max().item() <= TOLERANCE, latent
    # negative control: the start frame's noise level (0, from the noise mask) shapes the frames after it
    unmasked = _run(comfy, _wan22_5b_template(swapped=True, latent="i2v-unmasked"))["ksampler"]
    assert (unmasked[:, :, 1:] - expected[:, :, 1:]).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------ HunyuanVideo 1.5
HUNYUAN = {"t2v": "tiny_hunyuanvideo1.5_720p_t2v_fp16.safetensors",  # named as Comfy-Org ships them: the name
           "i2v": "tiny_hunyuanvideo1.5_720p_i2v_fp16.safetensors"}  # gives the pool its pipeline (t2v or i2v)
GLYPH, VISION = 1472, 1152  # ComfyUI's HunyuanVideo 1.5 fixes byT5's and SigLIP's widths in its code


def _hunyuan_prompt(comfy, name: str, g: torch.Generator, tokens: int, glyphs: int, **more) -> None:
    """A prompt as ComfyUI's hunyuan_video_15 encoder gives it: Qwen2.5-VL's hidden states (one prompt: no mask), the
    glyph text's byT5 states where the prompt quotes text, a pooled output its model class passes (unused)."""
    tensors = {"cond": torch.randn(1, tokens, 64, generator=g), "pooled_output": torch.randn(1, 64, generator=g), **more}
    if glyphs:
        tensors["conditioning_byt5small"] = torch.randn(1, glyphs, GLYPH, generator=g)
    save_file(tensors, comfy.work / "input" / f"{name}.safetensors")


@pytest.fixture(scope="module")
def hunyuan_files(comfy) -> None:
    """One-block HunyuanVideo 1.5 transformers (65 input channels: noise, start image, frame mask) in Tencent's layout
    (q, k, v fused) at ComfyUI's head size (128); t2v prompts of different lengths (the negative without glyph text,
    so ComfyUI calls the two apart), i2v prompts of equal shapes (one batched call, split over the CFG ranks) carrying
    the start frame as HunyuanVideo15ImageToVideo sets it (its latent, the frame mask), SigLIP vision tokens."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from original_layouts import original_layout
    from parallel.loading import tiny_models as tm

    for task, seed in (("t2v", 3), ("i2v", 4)):
        transformer = tm._peak_attention(tm._seeded(
            seed, HunyuanVideo15Transformer3DModel, in_channels=65, out_channels=32, num_attention_heads=2,
            attention_head_dim=128, num_layers=1, num_refiner_layers=2, mlp_ratio=4.0, text_embed_dim=64,
            text_embed_2_dim=GLYPH, image_embed_dim=VISION, rope_axes_dim=(16, 56, 56)), tm.QK_SCALE)
        weights = original_layout("hunyuanvideo15", transformer)
        save_file({k: v.contiguous() for k, v in weights.items()}, comfy.work / "models" / "diffusion_models" / HUNYUAN[task])
    g = torch.Generator().manual_seed(13)
    _hunyuan_prompt(comfy, "hunyuan-positive", g, 14, 9)
    _hunyuan_prompt(comfy, "hunyuan-negative", g, 5, 0)
    start = torch.zeros(1, 32, 2, SIZE // 16, SIZE // 16)
    start[:, :, :1] = torch.randn(1, 32, 1, SIZE // 16, SIZE // 16, generator=g)
    mask = torch.ones(1, 1, 2, SIZE // 16, SIZE // 16)
    mask[:, :, :1] = 0
    for name in ("hunyuan-i2v-positive", "hunyuan-i2v-negative"):
        _hunyuan_prompt(comfy, name, g, 12, 6, concat_latent_image=start, concat_mask=mask)
    save_file({"last_hidden_state": torch.randn(1, 16, VISION, generator=g)}, comfy.work / "input" / "hunyuan-vision.safetensors")
    _wan_vae(comfy)


def _hunyuan_template(swapped: bool, task: str = "t2v", cfg: float = 6.0, vision: bool = True, **layout) -> dict:
    """HunyuanVideo 1.5 720p's sampling part (its EasyCache bypassed, as the templates ship it): ModelSamplingSD3
    (shift 7), CFGGuider 6, BasicScheduler simple, KSamplerSelect euler, RandomNoise, SamplerCustomAdvanced, on
    EmptyHunyuanVideo15Latent (t2v) or HunyuanVideo15ImageToVideo's conditioning and latent (i2v: its start image's
    latent and mask come in the test conditioning, as the node sets them with the VAE, which is not built here; a
    Wan VAE stands in at its required, then unused, input)."""
    unet = _unet(HUNYUAN[task], swapped)
    if swapped and layout:
        unet["inputs"].update({"ulysses_degree": 1, **layout})
    prefix = "hunyuan-i2v" if task == "i2v" else "hunyuan"
    prompt = {
        "positive": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": f"{prefix}-positive.safetensors"}},
        "negative": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": f"{prefix}-negative.safetensors"}},
        "latent": {"class_type": "EmptyHunyuanVideo15Latent", "inputs": {"width": SIZE, "height": SIZE, "length": FRAMES,
                                                                         "batch_size": 1}},
        "unet": unet,
        "shift": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["unet", 0], "shift": 7.0}},
        "guider": {"class_type": "CFGGuider", "inputs": {"model": ["shift", 0], "positive": ["positive", 0],
                                                         "negative": ["negative", 0], "cfg": cfg}},
        "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": ["shift", 0], "scheduler": "simple", "steps": STEPS,
                                                              "denoise": 1.0}},
        "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 5}},
        "custom": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0],
            "latent_image": ["latent", 0]}},
        "save-custom": {"class_type": "SaveLatent", "inputs": {"samples": ["custom", 0], "filename_prefix": "hunyuan"}},
    }
    if task == "i2v":
        prompt["vae"] = {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan_2.1_vae.safetensors"}}
        prompt["i2v"] = {"class_type": "HunyuanVideo15ImageToVideo", "inputs": {
            "positive": ["positive", 0], "negative": ["negative", 0], "vae": ["vae", 0], "width": SIZE, "height": SIZE,
            "length": FRAMES, "batch_size": 1}}
        if vision:
            prompt["vision"] = {"class_type": "XDiTTestClipVision", "inputs": {"tensors": "hunyuan-vision.safetensors"}}
            prompt["i2v"]["inputs"]["clip_vision_output"] = ["vision", 0]
        prompt["guider"]["inputs"].update(positive=["i2v", 0], negative=["i2v", 1])
        prompt["custom"]["inputs"]["latent_image"] = ["i2v", 2]
    return prompt


def test_hunyuan_video15_text_to_video_with_the_loader_swapped_equals_comfyuis_own(comfy, hunyuan_files):
    spec = comfy.get("/object_info/XDiTPool")["XDiTPool"]["input"]["required"]["model"]  # xDiT Pool lists the files
    assert {f"file: diffusion_models/{name}" for name in HUNYUAN.values()} <= set(
        spec[1]["options"] if spec[0] == "COMBO" else spec[0])
    expected = _run(comfy, _hunyuan_template(swapped=False))["custom"]
    assert expected.shape == (1, 32, 2, SIZE // 16, SIZE // 16) and expected.abs().max().item() > 0.1
    assert (_run(comfy, _hunyuan_template(swapped=True))["custom"] - expected).abs().max().item() <= TOLERANCE
    assert (_run(comfy, _hunyuan_template(swapped=True, cfg=3.0))["custom"] - expected).abs().max().item() > 1e-3


def test_hunyuan_video15_image_to_video_on_cfg_2_equals_comfyuis_own(comfy, hunyuan_files):
    expected = _run(comfy, _hunyuan_template(swapped=False, task="i2v"))["custom"]
    got = _run(comfy, _hunyuan_template(swapped=True, task="i2v", cfg_parallel=True))["custom"]
    assert (got - expected).abs().max().item() <= TOLERANCE
    # negative control: the vision tokens act (on the pool as in ComfyUI)
    other = _run(comfy, _hunyuan_template(swapped=True, task="i2v", vision=False, cfg_parallel=True))["custom"]
    assert (other - expected).abs().max().item() > 1e-3
