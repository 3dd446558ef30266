"""Tests for parallel/loading/tiny_models.py: the tiny offline pipelines the engine's tests compare against."""

import functools
import pathlib

import pytest
import torch

from parallel.loading import tiny_models
from parallel.model_executor.hooks import as_keyword_arguments
from parallel.loading.tiny_models import FAMILIES, build_tiny_pipeline, make_inputs, save_tiny_pipeline

from xdit_test_helpers import at_requested_size, diffusers_latents, is_modular, load_pipeline_folder

torch.set_num_threads(1)  # tiny models: threading overhead only slows them down

LATENT_SHAPE = {  # expected output latents of a 64x64 run, batch 1
    "pixart-alpha": (1, 4, 8, 8), "pixart-sigma": (1, 4, 8, 8), "sd3": (1, 16, 8, 8), "flux": (1, 16, 64),
    "flux-kontext": (1, 16, 64), "qwen-image": (1, 16, 64), "flux2-klein": (1, 32, 8, 8),
    "flux2-dev": (1, 16, 128), "z-image": (1, 16, 8, 8),  # FLUX.2 [dev] returns its latents packed
    "qwen-image-edit": (1, 1, 64), "qwen-image-edit-plus": (1, 1, 64),  # their ×32 VAE: one 2×2 token
    "krea2": (1, 16, 64), "qwen-image-2.1": (1, 16, 64),  # Qwen-Image 2.1: its VAE's ×16, one token per latent pixel
    "flux3": (1, 128, 4, 4), "flux3-distilled": (1, 128, 4, 4)}  # FLUX 3's modular blocks: patchified, normalised

each_family = pytest.mark.parametrize("family", FAMILIES)
# The Qwen-Image-Edit pipelines encode a prompt together with its reference image through Qwen2VLProcessor, which
# needs torchvision (not installable beside this torch): their tiny models take prompt embeddings only.
PROMPTED = tuple(f for f in FAMILIES if not f.startswith("qwen-image-edit"))


@functools.cache
def _pipe(family):
    return build_tiny_pipeline(family)


def _run(pipe, family, inputs, height=64, width=64, steps=4, guidance=None):
    guidance = tiny_models.MODELS[family].guidance if guidance is None else guidance
    return diffusers_latents(pipe, family, guidance_scale=guidance, num_inference_steps=steps, height=height,
                             width=width, **inputs)


def _modules(pipe):
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


@each_family
def test_make_inputs(family):
    inputs = make_inputs(family, batch=2)
    assert inputs["latents"].shape[0] == 2
    for key, value in inputs.items():
        assert torch.equal(value, make_inputs(family, batch=2)[key]), key  # deterministic
        if key == "image" and value.shape[1] == 3:  # reference pixels in [0, 1], shared by the batch
            assert 0 <= value.min() < value.max() <= 1, key
            continue
        if value.is_floating_point():
            assert torch.isfinite(value).all() and 0.5 < value.std() < 2, key
        assert not torch.equal(value[0], value[1]), f"{key}: batch samples must differ"
        if key.startswith("negative_"):
            assert not torch.equal(value, inputs[key.removeprefix("negative_")]), key
    for key in (k for k in inputs if k.endswith("attention_mask")):
        assert (inputs[key][:, -1] == 0).all() and (inputs[key][:, 0] == 1).all(), key
    assert not any(k.startswith("negative_") for k in make_inputs(family, negative=False))
    assert make_inputs(family, text_tokens=7)["prompt_embeds"].shape[1] == 7
    assert not torch.equal(make_inputs(family, seed=1)["latents"], inputs["latents"][:1])


@each_family
def test_save_load_roundtrip(family, tmp_path):
    directory = save_tiny_pipeline(family, tmp_path / family)
    assert isinstance(directory, pathlib.Path)
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    assert size < 4 * 1024 * 1024, f"saved pipeline is {size} bytes"
    assert not list(directory.rglob("*.bin")), "must be saved as safetensors"
    loaded = load_pipeline_folder(directory)
    original = _pipe(family)
    assert type(loaded) is type(original)
    for name, module in _modules(original).items():
        theirs = _modules(loaded)[name].state_dict()
        for key, value in module.state_dict().items():
            assert torch.equal(value, theirs[key]), f"{name}.{key}"
    for name in (n for n in original.components if n.startswith("tokenizer")):
        tokenizer = lambda p: getattr(getattr(p, name), "tokenizer", getattr(p, name))  # noqa: E731 - FLUX 3: a processor
        ids = lambda p: tokenizer(p)("a red cat riding a horse, 4k!").input_ids  # noqa: E731
        assert ids(loaded) == ids(original), name


@each_family
def test_four_step_run(family):
    pipe = _pipe(family)
    out = _run(pipe, family, make_inputs(family))
    assert out.shape == LATENT_SHAPE[family]
    assert torch.isfinite(out).all() and out.abs().max() < 20
    print(f"{family}: max|out| = {out.abs().max():.3f}")  # shown with pytest -s
    assert torch.equal(out, _run(pipe, family, make_inputs(family))), "same inputs must give identical output"

    rebuilt = build_tiny_pipeline(family)  # same seed -> same weights
    assert torch.equal(out, _run(rebuilt, family, make_inputs(family)))
    other = build_tiny_pipeline(family, seed=1)
    assert not torch.equal(out, _run(other, family, make_inputs(family)))


@each_family
def test_batch_and_non_square(family):
    pipe = _pipe(family)
    height, width = (128, 64) if family.startswith("qwen-image-edit") else (128, 96)  # ×32 VAE: sides of 64k
    out = _run(pipe, family, make_inputs(family, batch=2, height=height, width=width), height=height, width=width, steps=2)
    assert out.shape[0] == 2 and torch.isfinite(out).all() and out.abs().max() < 20
    assert not torch.allclose(out[0], out[1])
    # without negatives: a run without classifier-free guidance
    single = _run(pipe, family, make_inputs(family, height=height, width=width, negative=False), height=height,
                  width=width, steps=2, guidance=tiny_models.MODELS[family].unguided)
    assert torch.isfinite(single).all() and single.abs().max() < 20


@each_family
def test_attention_is_peaked(family, monkeypatch):
    """Random weights give near-uniform attention that hides sharding bugs; the builder sharpens it."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    peak, uniform = [], []

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        probs = (query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5)
        valid = torch.full(probs.shape[:-1], float(key.shape[-2]))
        if attn_mask is not None:  # PixArt cross-attention: additive -10000 bias on padded text tokens
            probs = probs + attn_mask
            valid = (attn_mask > -1).sum(-1).float().expand(valid.shape)
        peak.append(probs.softmax(-1).amax(-1).mean().item())
        uniform.append((1 / valid).mean().item())
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    _run(_pipe(family), family, make_inputs(family), steps=2)  # PixArt treats 1 step specially
    assert peak, "no attention call was seen"
    mean_peak, mean_uniform = sum(peak) / len(peak), sum(uniform) / len(uniform)
    assert mean_peak > 4 * mean_uniform and mean_peak > 0.3, (mean_peak, mean_uniform)
    assert all(p > 2 * u for p, u in zip(peak, uniform)), list(zip(peak, uniform))


@pytest.mark.parametrize("family", PROMPTED)
def test_prompt_string_end_to_end(family):
    """Real prompts go through the offline tokenizers and text encoders into the transformer."""
    pipe = _pipe(family)
    seen = {}

    def hook(module, args, kwargs):
        named = as_keyword_arguments(module.forward, args, kwargs)
        text = named.get("encoder_hidden_states", named.get("cap_feats"))  # Z-Image: a list of samples
        seen["encoder_hidden_states"] = (text[0] if isinstance(text, list) else text).shape
        if "pooled_projections" in named:
            seen["pooled_projections"] = named["pooled_projections"].shape

    extra = {"use_resolution_binning": False, "clean_caption": False} if family.startswith("pixart") else {}
    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        if is_modular(pipe):
            out = _modular_prompted(pipe, family)
        else:
            with torch.no_grad():
                negative = {} if family.startswith("flux2") else {"negative_prompt": "blurry"}  # none to give
                size = {"height": 64, "width": 64, "guidance_scale": tiny_models.MODELS[family].guidance,
                        "max_sequence_length": 32}
                out = pipe(prompt="a cat", **negative, **at_requested_size(pipe, size), num_inference_steps=2,
                           output_type="latent", generator=torch.Generator().manual_seed(0), **extra).images
    finally:
        handle.remove()
    assert out.shape == LATENT_SHAPE[family] and torch.isfinite(out).all()
    inputs = make_inputs(family)  # precomputed embeddings must have the encoders' widths
    assert seen["encoder_hidden_states"][-1] == inputs["prompt_embeds"].shape[-1]
    if "pooled_prompt_embeds" in inputs:
        assert seen["pooled_projections"][-1] == inputs["pooled_prompt_embeds"].shape[-1]


def _modular_prompted(pipe, family):
    """A modular pipeline (FLUX 3) from a prompt, as diffusers says to encode one as given: its blocks without the
    prompt upsampler, on its components, its guider at the tiny model's guidance."""
    blocks = pipe.blocks
    blocks.sub_blocks.pop("prompt_upsampler")
    run = blocks.init_pipeline()
    run.update_components(**{name: part for name, part in pipe.components.items()
                             if part is not None and name in run.component_names})
    negative = {}
    if getattr(run, "guider", None) is not None:
        run.update_components(guider=run.guider.new(guidance_scale=tiny_models.MODELS[family].guidance))
        negative = {"negative_prompt": "blurry"}
    with torch.no_grad():
        return run(prompt="a cat", **negative, height=64, width=64, num_inference_steps=2, max_sequence_length=32,
                   generator=torch.Generator().manual_seed(0), output="latents")
