"""Load Diffusion Model (xDiT Pool) in a real ComfyUI 0.33: a workflow built for UNETLoader runs with only the
loader swapped, and gives what ComfyUI's own model gives on the same file.

The file is test_comfyui_model's tiny SD3 in SAI's layout, which ComfyUI's UNETLoader detects natively; the
conditioning is xDiT Text Encode's (native shape) from a pool of the same weights as a diffusers folder. The
sampling part is the official templates': KSampler (two samplers) and SamplerCustomAdvanced with CFGGuider,
LoraLoaderModelOnly between loader and sampler.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from test_comfyui_model import MODEL, SAMPLERS, SEED, checkpoint, graph, latents_of, stock  # noqa: F401 - fixtures
from xdit_test_helpers import TOLERANCE


def _loader(**layout) -> dict:
    return {"class_type": "XDiTLoadDiffusionModel", "inputs": {
        "unet_name": f"{MODEL}.safetensors", "weight_dtype": "default", "nproc": 2, "ulysses_degree": 1,
        "ring_degree": 1, "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False,
        "dp_degree": 1, "devices": "", "threads_per_rank": 1, "endpoint": "", **layout}}


def _swapped(layout: dict) -> dict:
    """test_comfyui_model's graph with xDiT Model replaced by the loader (its samplers, guider and scheduler)."""
    prompt = graph({"ulysses_degree": 2}, stock=False)
    prompt["5"] = _loader(**layout)
    return prompt


def _run(comfy, prompt) -> dict[str, torch.Tensor]:
    entry = comfy.wait(comfy.queue(prompt), 600)
    errors = [(m[1]["node_type"], m[1]["exception_message"], m[1]["traceback"][-3:])
              for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "success", errors or json.dumps(entry["status"])[-2000:]
    return latents_of(comfy, entry)


def _equal(latents, stock, names=None) -> None:
    for name in names or [sampler for sampler, _ in SAMPLERS] + ["custom"]:
        assert (latents[f"xdit-{name}"] - stock[f"stock-{name}"]).abs().max().item() <= TOLERANCE, name


def test_the_swapped_loader_on_ulysses_2_equals_comfyuis_own_model(comfy, stock):
    latents = _run(comfy, _swapped({"ulysses_degree": 2}))
    _equal(latents, stock)
    # negative control: the loader's result is not what ComfyUI gives with another sampler
    assert (latents["xdit-euler"] - stock["stock-dpmpp_2m"]).abs().max().item() > 1e-2


def test_the_swapped_loader_on_cfg_2_equals_comfyuis_own_model(comfy, stock):
    _equal(_run(comfy, _swapped({"cfg_parallel": True})), stock)


def test_the_loader_and_xdit_pool_share_one_pool_for_one_file_and_layout(comfy, stock):
    """A second prompt with the loader on the same file and layout starts nothing new."""
    before = [p["key"] for p in comfy.get("/xdit/pools")["pools"]]
    _run(comfy, _swapped({"ulysses_degree": 2}))
    after = [p["key"] for p in comfy.get("/xdit/pools")["pools"]]
    assert after == before and sum(key["model"].endswith(f"{MODEL}.safetensors") for key in after) == 2, after


def _lora(comfy, name: str, seed: int) -> str:
    """A diffusers-format SD3 LoRA on block 0's attention (ComfyUI maps it onto its fused q/k/v weights)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"):
        weights[f"transformer.transformer_blocks.0.{layer}.lora_A.weight"] = torch.randn(4, 128, generator=g) * 0.2
        weights[f"transformer.transformer_blocks.0.{layer}.lora_B.weight"] = torch.randn(128, 4, generator=g) * 0.2
    save_file(weights, comfy.work / "models" / "loras" / name)
    return name


def _with_loras(prompt: dict, model: str, sampler: str, loras: list[tuple[str, float]]) -> None:
    """LoraLoaderModelOnly nodes chained between `model` and `sampler`, as the templates chain them."""
    source = [model, 0]
    for index, (name, strength) in enumerate(loras):
        node = f"{sampler}-lora{index}"
        prompt[node] = {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": source, "lora_name": name, "strength_model": strength}}
        source = [node, 0]
    prompt[sampler]["inputs"]["model"] = source


def test_comfyuis_lora_loaders_on_the_loaders_model_equal_them_on_comfyuis_own(comfy, stock):
    """Strength 1 and 0.5, two stacked, then switched to another: each equals the same LoRA nodes on ComfyUI's
    own model; the LoRA changes the result (against no LoRA); the pool loads each file once."""
    first, second = _lora(comfy, "xdit_loader_a.safetensors", 21), _lora(comfy, "xdit_loader_b.safetensors", 22)
    keep = ("1", "2", "3", "4", "5", "6", "xdit-euler", "stock-euler", "save-xdit-euler", "save-stock-euler")
    for loras in ([(first, 1.0)], [(first, 0.5)], [(first, 1.0), (second, 0.5)], [(second, 1.0)]):
        prompt = {k: v for k, v in graph({"ulysses_degree": 2}, stock=True).items() if k in keep}
        prompt["5"] = _loader(ulysses_degree=2)
        for model, sampler in (("5", "xdit-euler"), ("6", "stock-euler")):
            _with_loras(prompt, model, sampler, loras)
        latents = _run(comfy, prompt)
        assert (latents["xdit-euler"] - latents["stock-euler"]).abs().max().item() <= TOLERANCE, loras
        assert (latents["xdit-euler"] - stock["stock-euler"]).abs().max().item() > 1e-3, loras  # the LoRA acted
    pool = next(p for p in comfy.get("/xdit/pools")["pools"] if p["key"]["model"].endswith(f"{MODEL}.safetensors")
                and p["key"]["parallel"]["ulysses_degree"] == 2)
    assert pool["status"]["loads"]["lora"] == 2  # each file once, whatever its strengths and stacks


def test_a_model_merge_on_the_loaders_model_is_one_error_of_the_merge_node(comfy, stock):
    prompt = _swapped({"ulysses_degree": 2})
    prompt["merge"] = {"class_type": "ModelMergeSimple", "inputs": {"model1": ["5", 0], "model2": ["6", 0], "ratio": 0.5}}
    prompt["6"] = {"class_type": "UNETLoader", "inputs": {"unet_name": f"{MODEL}.safetensors", "weight_dtype": "default"}}
    prompt["xdit-euler"]["inputs"]["model"] = ["merge", 0]
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "error"
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_type"] == "ModelMergeSimple", errors
    assert "a model merge scales the model's own weights, which live on the pool" in errors[0]["exception_message"]


def _template_rest(model: str, source: str) -> dict:
    """The rest of what templates put between loader and latent, on `model`: ModelSamplingSD3; a positive of two
    prompts over halves of the steps (ConditioningSetTimestepRange, ConditioningCombine: ComfyUI calls the model
    per cond); img2img on that result at denoise 0.6; DualCFGGuider over two prompts and the negative."""
    shifted = f"{source}-shift"
    ksampler = {"seed": SEED, "steps": 4, "cfg": 4.5, "sampler_name": "euler", "scheduler": "simple",
                "negative": ["3", 0], "model": [shifted, 0]}
    return {
        shifted: {"class_type": "ModelSamplingSD3", "inputs": {"model": [model, 0], "shift": 3.0}},
        f"{source}-ranged": {"class_type": "KSampler", "inputs": {
            **ksampler, "positive": ["combined", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        f"{source}-img2img": {"class_type": "KSampler", "inputs": {
            **ksampler, "positive": ["2", 0], "latent_image": [f"{source}-ranged", 0], "denoise": 0.6}},
        f"{source}-dual-guider": {"class_type": "DualCFGGuider", "inputs": {
            "model": [shifted, 0], "cond1": ["2", 0], "cond2": ["other", 0], "negative": ["3", 0], "cfg_conds": 4.0,
            "cfg_cond2_negative": 2.0, "style": "regular"}},
        f"{source}-dual": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["7", 0], "guider": [f"{source}-dual-guider", 0], "sampler": ["8", 0], "sigmas": ["sigmas", 0],
            "latent_image": ["4", 0]}},
        **{f"save-{source}-{kind}": _save_latent(f"{source}-{kind}") for kind in ("ranged", "img2img", "dual")},
    }


def _save_latent(node: str) -> dict:
    return {"class_type": "SaveLatent", "inputs": {"samples": [node, 0], "filename_prefix": node}}


@pytest.mark.parametrize("layout", [{"ulysses_degree": 2}, {"cfg_parallel": True}], ids=["ulysses2", "cfg2"])
def test_timestep_ranges_several_conds_img2img_and_dual_cfg_on_the_loader_equal_comfyuis_own(comfy, stock, layout):
    base = graph({"ulysses_degree": 2}, stock=True)
    prompt = {k: base[k] for k in ("1", "2", "3", "4", "6", "7", "8")}
    prompt.update({
        "5": _loader(**layout),
        "other": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": "a lighthouse at dusk"}},
        "early": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["2", 0], "start": 0.0,
                                                                            "end": 0.5}},
        "late": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["other", 0], "start": 0.5,
                                                                           "end": 1.0}},
        "combined": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["early", 0],
                                                                     "conditioning_2": ["late", 0]}},
        "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": ["stock-shift", 0], "scheduler": "simple",
                                                              "steps": 4, "denoise": 1.0}},
        **_template_rest("5", "xdit"), **_template_rest("6", "stock")})
    latents = _run(comfy, prompt)
    for kind in ("ranged", "img2img", "dual"):
        assert (latents[f"xdit-{kind}"] - latents[f"stock-{kind}"]).abs().max().item() <= TOLERANCE, kind
        assert latents[f"stock-{kind}"].abs().max().item() > 0.1, kind
    # negative control: the second half's prompt reaches the result (against the first prompt alone, same sampler)
    assert (latents["xdit-ranged"] - latents["xdit-img2img"]).abs().max().item() > 1e-2


# -------------------------------------------------------------------------------------------- FLUX.1 [dev]
FLUX = "tiny-flux-dev-comfy"
FLUX_STEPS, FLUX_GUIDANCE = 4, 3.5


def _flux_files(comfy) -> str:
    """A FLUX.1 [dev] of ComfyUI's own head size (128; ComfyUI reads the rest from the file): a diffusers folder
    with the tiny text encoders (for xDiT Text Encode) and BFL's single file (for both loaders)."""
    from diffusers import FluxTransformer2DModel

    from original_layouts import original_layout
    from parallel.loading import tiny_models

    pipe = tiny_models.build_tiny_pipeline("flux", seed=6)
    transformer = tiny_models._peak_attention(tiny_models._seeded(
        6, FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=tiny_models.T5_DIM,
        pooled_projection_dim=tiny_models.CLIP_DIM, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        tiny_models.QK_SCALE)
    pipe = type(pipe)(**{**pipe.components, "transformer": transformer})
    pipe.save_pretrained(comfy.work / "models" / "diffusers" / FLUX, safe_serialization=True)
    weights = original_layout("flux", transformer)
    save_file({k: v.contiguous() for k, v in weights.items()}, comfy.work / "models" / "diffusion_models" / f"{FLUX}.safetensors")
    return FLUX


def _flux_template(model: dict, size: int = 64) -> dict:
    """The sampling part of ComfyUI's FLUX.1 [dev] template: the prompt through FluxGuidance, ModelSamplingFlux,
    KSampler at cfg 1, and SamplerCustomAdvanced with BasicGuider and Flux's own scheduler."""
    return {
        "pool": {"class_type": "XDiTPool", "inputs": {**graph({}, stock=False)["1"]["inputs"], "model": FLUX,
                                                       "nproc": 1, "ulysses_degree": 1}},
        "text": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["pool", 0], "text": "a lighthouse at dusk"}},
        "guided": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["text", 0], "guidance": FLUX_GUIDANCE}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "unet": model,
        "shift": {"class_type": "ModelSamplingFlux", "inputs": {"model": ["unet", 0], "max_shift": 1.15, "base_shift": 0.5,
                                                                "width": size, "height": size}},
        "ksampler": {"class_type": "KSampler", "inputs": {
            "model": ["shift", 0], "seed": 5, "steps": FLUX_STEPS, "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["guided", 0], "negative": ["guided", 0], "latent_image": ["latent", 0],
            "denoise": 1.0}},
        "save-ksampler": {"class_type": "SaveLatent", "inputs": {"samples": ["ksampler", 0], "filename_prefix": "ks"}},
        "guider": {"class_type": "BasicGuider", "inputs": {"model": ["shift", 0], "conditioning": ["guided", 0]}},
        "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": ["shift", 0], "scheduler": "simple",
                                                              "steps": FLUX_STEPS, "denoise": 1.0}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 5}},
        "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "custom": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0],
            "latent_image": ["latent", 0]}},
        "save-custom": {"class_type": "SaveLatent", "inputs": {"samples": ["custom", 0], "filename_prefix": "custom"}},
    }


def test_flux_dev_with_the_loader_swapped_equals_comfyuis_own_flux(comfy):
    _flux_files(comfy)
    stock = _run(comfy, _flux_template({"class_type": "UNETLoader", "inputs": {
        "unet_name": f"{FLUX}.safetensors", "weight_dtype": "default"}}))
    swapped = _run(comfy, _flux_template({**_loader(ulysses_degree=2), "inputs": {
        **_loader(ulysses_degree=2)["inputs"], "unet_name": f"{FLUX}.safetensors"}}))
    for name in ("ksampler", "custom"):
        assert (swapped[name] - stock[name]).abs().max().item() <= TOLERANCE, name
        assert stock[name].abs().max().item() > 0.1
    assert (swapped["ksampler"] - stock["custom"]).abs().max().item() <= TOLERANCE  # the two samplers agree here
    # negative control: without FluxGuidance's value the distilled model samples otherwise
    unguided = _flux_template(_loader(ulysses_degree=2) | {"inputs": {**_loader(ulysses_degree=2)["inputs"],
                                                                        "unet_name": f"{FLUX}.safetensors"}})
    unguided["guided"]["inputs"]["guidance"] = 1.0
    assert (_run(comfy, unguided)["ksampler"] - stock["ksampler"]).abs().max().item() > 1e-3
