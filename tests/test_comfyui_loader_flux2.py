"""Load Diffusion Model (xDiT Pool) on FLUX.2 and FLUX.1 Kontext in a real ComfyUI 0.33: the sampling part of the
official templates (FLUX.2 [klein] text-to-image and image edit, FLUX.2 [dev], FLUX.1 Kontext [dev]) runs with only
UNETLoader swapped, and gives what ComfyUI's own model gives on the same file.

The files are tiny transformers in BFL's layout at ComfyUI's fixed head size (128; FLUX.2's four rotary axes of
32, its MLP ratio 3), which ComfyUI's UNETLoader detects natively, loaded alone (no VAE file: a [klein] pool
serving model calls needs none). The prompts are CONDITIONINGs in the encoders' layout (the test-only
XDiTTestConditioning node: Qwen3 and Mistral are too big for a CPU test); the reference images are latents
(LoadLatent) through the templates' ReferenceLatent, which ComfyUI's model places after the image tokens.

ComfyUI's FLUX.2 normalises q and k with float32's epsilon where diffusers' FLUX.2 (BFL's reference) uses 1e-6. On
the zero rows ComfyUI's Flux2 pads short text with (to 512 tokens: [dev]'s Mistral conditioning), an untrained
model's q and k are tiny (from its tiny text modulation), and that epsilon shows (2e-4); a trained model's are not.
The test models' text modulation is scaled to such magnitudes (10×: the difference then is 2e-6).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from test_comfyui_loader import _loader, _run
from xdit_test_helpers import TOLERANCE

# ComfyUI's attention as on the GPUs a pool runs on (PyTorch's SDPA, its default there), not its CPU default (the
# sub-quadratic kernel, whose 1e-5 rounding CFG 5 and multistep samplers carry to 1e-3 on these peaked tiny models)
COMFY_ARGS = ("--use-pytorch-cross-attention",)

KLEIN, DEV, KONTEXT = "tiny-flux-2-klein-base.safetensors", "tiny-flux2-dev.safetensors", "tiny-flux1-kontext-dev.safetensors"
STEPS, SIZE, TEXT = 3, 64, 96  # FLUX.2's text: three hidden layers of its encoder stacked (3 × 32 here)


def _save(comfy, name: str, transformer, family: str) -> None:
    from original_layouts import original_layout

    weights = original_layout(family, transformer)
    save_file({k: v.contiguous() for k, v in weights.items()}, comfy.work / "models" / "diffusion_models" / name)


@pytest.fixture(scope="module")
def files(comfy) -> None:
    """The three transformers, and the prompts and reference latents as ComfyUI's encoders and VAE give them."""
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    from parallel.loading import tiny_models as tm

    for name, seed, dev in ((KLEIN, 6, False), (DEV, 7, True)):
        transformer = tm._peak_attention(tm._seeded(
            seed, Flux2Transformer2DModel, in_channels=128, num_layers=1, num_single_layers=1, num_attention_heads=2,
            attention_head_dim=128, joint_attention_dim=TEXT, axes_dims_rope=(32, 32, 32, 32), guidance_embeds=dev),
            tm.QK_SCALE)
        with torch.no_grad():
            transformer.double_stream_modulation_txt.linear.weight.mul_(10)  # see the module docstring
        _save(comfy, name, transformer, "flux2")
    kontext = tm._peak_attention(tm._seeded(
        8, FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=tm.T5_DIM, pooled_projection_dim=tm.CLIP_DIM,
        guidance_embeds=True, axes_dims_rope=(16, 56, 56)), tm.QK_SCALE)
    _save(comfy, KONTEXT, kontext, "flux-kontext")
    g = torch.Generator().manual_seed(11)
    inputs = comfy.work / "input"
    # [klein]'s Qwen3 encoder pads to 512 tokens (embedded padding); [dev]'s Mistral does not: its model zero-pads
    for name, tokens in (("klein-positive", 512), ("klein-negative", 512), ("dev-positive", 12)):
        save_file({"cond": torch.randn(1, tokens, TEXT, generator=g)}, inputs / f"{name}.safetensors")
    save_file({"cond": torch.randn(1, 9, tm.T5_DIM, generator=g), "pooled_output": torch.randn(1, tm.CLIP_DIM, generator=g)},
              inputs / "kontext-positive.safetensors")
    version = {"latent_format_version_0": torch.tensor([])}
    for name, shape in (("flux2-first", (1, 128, 4, 4)), ("flux2-second", (1, 128, 2, 4)), ("kontext", (1, 16, 8, 6))):
        save_file({"latent_tensor": torch.randn(*shape, generator=g), **version}, inputs / f"{name}.latent")


def _unet(name: str, swapped: bool, **layout) -> dict:
    if swapped:
        loader = _loader(**(layout or {"ulysses_degree": 2}))
        return {**loader, "inputs": {**loader["inputs"], "unet_name": name}}
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def _text(name: str) -> dict:
    return {"class_type": "XDiTTestConditioning", "inputs": {"tensors": f"{name}.safetensors"}}


def _referenced(prompt: dict, conditioning: str, latents: list[str]) -> list:
    """The templates' chain of ReferenceLatent nodes (one per image) after `conditioning`."""
    source = [conditioning, 0]
    for latent in latents:
        prompt[f"load-{latent}"] = {"class_type": "LoadLatent", "inputs": {"latent": f"{latent}.latent"}}
        node = f"{conditioning}-{latent}"
        prompt[node] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": source, "latent": [f"load-{latent}", 0]}}
        source = [node, 0]
    return source


def _flux2_template(unet: dict, guider: dict, positive: list, steps: int = STEPS) -> dict:
    """FLUX.2's sampling part: EmptyFlux2LatentImage, Flux2Scheduler, KSamplerSelect euler, RandomNoise and
    SamplerCustomAdvanced with the template's guider."""
    return {
        "unet": unet,
        "latent": {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "sigmas": {"class_type": "Flux2Scheduler", "inputs": {"steps": steps, "width": SIZE, "height": SIZE}},
        "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 5}},
        "guider": {**guider, "inputs": {**guider["inputs"], "model": ["unet", 0], "positive": positive}},
        "custom": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0],
            "latent_image": ["latent", 0]}},
        "save-custom": {"class_type": "SaveLatent", "inputs": {"samples": ["custom", 0], "filename_prefix": "flux2"}},
    }


def _klein(swapped: bool, cfg: float = 5.0, **layout) -> dict:
    """FLUX.2 [klein] base text-to-image: CFGGuider at cfg 5 with a negative prompt."""
    prompt = _flux2_template(_unet(KLEIN, swapped, **layout), {"class_type": "CFGGuider", "inputs": {
        "negative": ["negative", 0], "cfg": cfg}}, ["positive", 0])
    return {**prompt, "positive": _text("klein-positive"), "negative": _text("klein-negative")}


def _klein_edit(swapped: bool, references: tuple[str, ...] = ("flux2-first", "flux2-second")) -> dict:
    """FLUX.2 [klein] image edit: ReferenceLatent per image on the prompt and on ConditioningZeroOut's negative,
    CFGGuider at cfg 1."""
    prompt = {"positive": _text("klein-positive"),
              "zero": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["positive", 0]}}}
    positive, negative = _referenced(prompt, "positive", list(references)), _referenced(prompt, "zero", list(references))
    guider = {"class_type": "CFGGuider", "inputs": {"negative": negative, "cfg": 1.0}}
    return {**prompt, **_flux2_template(_unet(KLEIN, swapped), guider, positive)}


def _equal(swapped: dict, stock: dict, name: str = "custom") -> torch.Tensor:
    assert stock[name].abs().max().item() > 0.1
    assert (swapped[name] - stock[name]).abs().max().item() <= TOLERANCE
    return stock[name]


def test_flux2_klein_with_the_loader_swapped_equals_comfyuis_own_on_ulysses_2_and_cfg_2(comfy, files):
    stock = _run(comfy, _klein(swapped=False))
    _equal(_run(comfy, _klein(swapped=True)), stock)
    _equal(_run(comfy, _klein(swapped=True, cfg_parallel=True)), stock)
    # negative control: another guidance scale samples another image
    assert (_run(comfy, _klein(swapped=True, cfg=2.0))["custom"] - stock["custom"]).abs().max().item() > 1e-3


def test_flux2_klein_image_edit_reference_latents_equal_comfyuis_own(comfy, files):
    stock = _equal(_run(comfy, _klein_edit(swapped=True)), _run(comfy, _klein_edit(swapped=False)))
    # negative control: the references act (one of them left out samples otherwise)
    assert (_run(comfy, _klein_edit(swapped=True, references=("flux2-first",)))["custom"] - stock).abs().max() > 1e-3


def _dev(swapped: bool, guidance: float = 4.0) -> dict:
    """FLUX.2 [dev]: FluxGuidance 4 and BasicGuider."""
    prompt = _flux2_template(_unet(DEV, swapped), {"class_type": "BasicGuider", "inputs": {}}, ["guided", 0])
    prompt["guider"]["inputs"]["conditioning"] = prompt["guider"]["inputs"].pop("positive")
    return {**prompt, "positive": _text("dev-positive"),
            "guided": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["positive", 0], "guidance": guidance}}}


def test_flux2_dev_with_the_loader_swapped_equals_comfyuis_own(comfy, files):
    stock = _equal(_run(comfy, _dev(swapped=True)), _run(comfy, _dev(swapped=False)))
    assert (_run(comfy, _dev(swapped=True, guidance=1.5))["custom"] - stock).abs().max().item() > 1e-3


def _kontext(swapped: bool, reference: bool = True) -> dict:
    """FLUX.1 Kontext [dev]'s template: ReferenceLatent on the prompt, FluxGuidance 2.5, ConditioningZeroOut's
    negative, KSampler euler / simple at cfg 1."""
    prompt = {"positive": _text("kontext-positive")}
    referenced = _referenced(prompt, "positive", ["kontext"]) if reference else ["positive", 0]
    return {
        **prompt,
        "unet": _unet(KONTEXT, swapped),
        "guided": {"class_type": "FluxGuidance", "inputs": {"conditioning": referenced, "guidance": 2.5}},
        "zero": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["positive", 0]}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "ksampler": {"class_type": "KSampler", "inputs": {
            "model": ["unet", 0], "seed": 5, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["guided", 0], "negative": ["zero", 0], "latent_image": ["latent", 0], "denoise": 1.0}},
        "save-ksampler": {"class_type": "SaveLatent", "inputs": {"samples": ["ksampler", 0], "filename_prefix": "kontext"}},
    }


def test_flux1_kontext_reference_latent_with_the_loader_swapped_equals_comfyuis_own(comfy, files):
    stock = _equal(_run(comfy, _kontext(swapped=True)), _run(comfy, _kontext(swapped=False)), "ksampler")
    assert (_run(comfy, _kontext(swapped=True, reference=False))["ksampler"] - stock).abs().max().item() > 1e-3



def _cached(swapped: bool, cache: str | None) -> dict:
    """The [klein] template at 8 steps with ComfyUI's EasyCache or LazyCache between the loader and the guider (a
    high threshold, so that steps are reused)."""
    prompt = _klein(swapped)
    prompt["sigmas"]["inputs"]["steps"] = 8
    if cache:
        prompt["cache"] = {"class_type": cache, "inputs": {"model": ["unet", 0], "reuse_threshold": 3.0,
                                                           "start_percent": 0.15, "end_percent": 0.95, "verbose": False}}
        prompt["guider"]["inputs"]["model"] = ["cache", 0]
    return prompt


def test_comfyuis_easycache_and_lazycache_on_the_loaders_model_equal_them_on_comfyuis_own(comfy, files):
    """They reuse earlier outputs instead of calling the model (EasyCache around the diffusion model call, LazyCache
    around the guider's): on the pool's MODEL as on ComfyUI's own; without them the result differs."""
    plain = _run(comfy, _cached(swapped=False, cache=None))["custom"]
    for cache in ("EasyCache", "LazyCache"):
        stock = _equal(_run(comfy, _cached(swapped=True, cache=cache)), _run(comfy, _cached(swapped=False, cache=cache)))
        assert (stock - plain).abs().max().item() > 1e-3, cache  # steps were reused
