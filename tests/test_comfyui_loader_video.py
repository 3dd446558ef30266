"""Load Diffusion Model (xDiT Pool) on Wan in a real ComfyUI 0.33: the sampling part of the official Wan 2.1
text-to-video and Wan 2.2 14B templates runs with only UNETLoader swapped, and gives what ComfyUI's own Wan gives
on the same files.

The files are tiny Wan transformers in Wan's own layout at ComfyUI's fixed head size (128) and text width (4096),
which ComfyUI's UNETLoader detects natively. The prompt is a CONDITIONING in UMT5's layout (the test-only
XDiTTestConditioning node: UMT5-XXL is too big for a CPU test), the same for both models.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from test_comfyui_loader import _loader, _run
from xdit_test_helpers import TOLERANCE

WAN21 = "tiny-wan21-t2v-comfy.safetensors"
WAN22 = {"high": "tiny_wan2.2_t2v_high_noise_14B_fp16.safetensors",  # names as Comfy-Org ships the pair
         "low": "tiny_wan2.2_t2v_low_noise_14B_fp16.safetensors"}
STEPS, SIZE, FRAMES = 4, 64, 5


def _wan_file(comfy, name: str, seed: int) -> None:
    """A two-block Wan 2.1-architecture transformer, attention made peaked, in Wan's own names."""
    from diffusers import WanTransformer3DModel

    from original_layouts import original_layout
    from parallel.loading import tiny_models

    transformer = tiny_models._peak_attention(tiny_models._seeded(
        seed, WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128,
        in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=512, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6), tiny_models.QK_SCALE)
    weights = original_layout("wan", transformer)
    save_file({k: v.contiguous() for k, v in weights.items()}, comfy.work / "models" / "diffusion_models" / name)


def _prompts(comfy) -> None:
    """UMT5's CONDITIONING for a positive and a negative prompt: [1, tokens, 4096] (ComfyUI's wan encoder trims the
    padding, so the two lengths differ)."""
    g = torch.Generator().manual_seed(11)
    for name, tokens in (("wan-positive", 12), ("wan-negative", 7)):
        save_file({"cond": torch.randn(1, tokens, 4096, generator=g)}, comfy.work / "input" / f"{name}.safetensors")


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
    crossed = _run(comfy, _wan22_template(swapped=True, experts=("low", "high")))["low"]
    assert (crossed - expected).abs().max().item() > 1e-3
