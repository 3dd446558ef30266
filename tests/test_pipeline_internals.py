"""What a family states about the inside of its diffusers pipeline's `__call__`, held against that `__call__`.

Three things have no diffusers function to call, so the families state them: the schedule img2img starts from
(`flow_sigmas` and `shift_arguments`), the guidance combination PipeFusion's flowing patches apply per token
(`guidance_combine`), and the transformer call a single model call makes (`model_call_arguments`). Each is
checked here against the tiny pipeline's own `__call__` (schedule at two step counts, predictions on random
outputs, the transformer's keyword arguments), for every registered family that states it, so a diffusers
release that changes its pipeline fails here first. Each has a negative control that must miss.
"""

from __future__ import annotations

import copy
import functools
import inspect
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from parallel.families import FAMILIES
from parallel.families.base import unpack_2x2
from parallel.layout.config import LayoutError, ParallelConfig
from parallel.loading import tiny_models
from parallel.model_executor import wrap_pipeline
from parallel.model_executor.hooks import as_keyword_arguments
from parallel.model_executor.pipeline.img2img import linear_sigmas
from xdit_test_helpers import is_modular, one_rank


class Stop(Exception):
    """Ends the pipeline's call once what the test reads has happened."""


def _takes_sigmas(family: str) -> bool:
    pipeline = tiny_models.build_tiny_pipeline(family)
    if is_modular(pipeline):  # what its blocks take (FLUX 3's set-timesteps block takes sigmas)
        names = {param.name for param in pipeline.blocks.inputs}
    else:
        names = set(inspect.signature(pipeline.__call__).parameters)
    return "sigmas" in names and isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler)


SIGMA_FAMILIES = [f for f in tiny_models.FAMILIES + tiny_models.VIDEO_FAMILIES if _takes_sigmas(f)]


def _call(wrapper, family: str, steps: int, negative: bool = True, **extra):
    """The pipeline's own `__call__` on the tiny inputs, given them as our wrapper gives them on one rank (edit
    models' reference images as the pictures the pipeline takes), until Stop."""
    inputs = tiny_models.make_inputs(family, height=64, width=64, negative=negative)
    try:
        wrapper(**inputs, num_inference_steps=steps, height=64, width=64, output_type="latent", **extra)
    except Stop:
        pass


@pytest.fixture(scope="module")
def rank():
    with one_rank(ParallelConfig()):
        yield


@pytest.mark.parametrize("family", SIGMA_FAMILIES)
def test_the_img2img_schedule_is_the_pipelines_own(rank, family):
    """The schedule the pipeline's `__call__` gives its scheduler equals the one our sigmas and shift make."""
    assert {"flux", "qwen-image", "z-image", "flux2-klein", "sd3", "flux3", "flux3-distilled"} <= set(SIGMA_FAMILIES)
    for steps in (3, 7):
        wrapper = wrap_pipeline(tiny_models.build_tiny_pipeline(family))
        scheduler = wrapper.module.scheduler.module
        fresh, pristine = copy.deepcopy(scheduler), copy.deepcopy(scheduler)
        set_timesteps = scheduler.set_timesteps

        @functools.wraps(set_timesteps)  # its signature, which the pipeline reads
        def recorded(*args, **kwargs):
            set_timesteps(*args, **kwargs)
            raise Stop

        scheduler.set_timesteps = recorded
        _call(wrapper, family, steps)
        own = scheduler.sigmas.clone()
        fresh.set_timesteps(sigmas=wrapper.flow_sigmas(steps).tolist(), **wrapper.shift_arguments(64, 64, steps))
        assert torch.allclose(fresh.sigmas, own, atol=1e-6), (family, steps, fresh.sigmas, own)

        # negative control: the other convention (the scheduler's own range, or the linear one)
        other = (linear_sigmas(steps) if wrapper.default_sigmas is None
                 else np.linspace(pristine.sigma_max, pristine.sigma_min, steps))
        wrong = copy.deepcopy(fresh)
        wrong.set_timesteps(sigmas=other.tolist(), **wrapper.shift_arguments(64, 64, steps))
        assert not torch.allclose(wrong.sigmas, own, atol=1e-3)
        wrapper.unwrap()


@contextmanager
def stub_transformer(wrapper, outputs: list[torch.Tensor], calls: list[dict]):
    """The transformer answers each call with the next of `outputs` and records its keyword arguments."""
    transformer, image_input = wrapper.module.transformer.module, wrapper.module.transformer.plan.image_input
    own = transformer.forward

    def forward(*args, **kwargs):
        calls.append(as_keyword_arguments(own, args, kwargs))
        image = calls[-1][image_input]
        output = outputs[min(len(calls), len(outputs)) - 1]
        if isinstance(image, list):  # Z-Image: one latent per sample
            return ([torch.zeros_like(sample) for sample in image] if output is None else list(output.to(image[0].dtype)),)
        if output is None:  # zeros of its input, in the transformer's output channels (PixArt's learned sigma: 2×)
            channels = getattr(transformer.config, "out_channels", None) if image.ndim == 4 else None
            output = image.new_zeros(image.shape[0], channels or image.shape[1], *image.shape[2:])
        return (output.to(image.dtype),)

    transformer.forward = forward
    try:
        yield
    finally:
        del transformer.forward


GUIDED = {"flux": {"true_cfg_scale": 3.0}, "qwen-image": {"true_cfg_scale": 3.0}}


@pytest.mark.parametrize("family", sorted(GUIDED))
def test_the_guidance_combination_is_the_pipelines_own(rank, family):
    """One step of the pipeline's true CFG on two known predictions equals our `guidance_combine` of them."""
    wrapper = wrap_pipeline(tiny_models.build_tiny_pipeline(family))
    inputs = tiny_models.make_inputs(family, height=64, width=64)
    shape = inputs["latents"].shape
    cond, uncond = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    calls: list[dict] = []
    scheduler = wrapper.module.scheduler.module

    @functools.wraps(scheduler.step)
    def record_step(model_output, *args, **kwargs):
        calls.append({"model_output": model_output.clone()})
        raise Stop

    scheduler.step = record_step
    with stub_transformer(wrapper, [cond, uncond], calls):
        _call(wrapper, family, 2, **GUIDED[family])
    assert len(calls) == 3, "cond, uncond, then the scheduler's step"
    combine = wrapper.guidance_combine({**inputs, **GUIDED[family]})
    own = calls[2]["model_output"]
    assert torch.allclose(combine(cond, uncond), own, atol=1e-6)
    assert not torch.allclose(combine(uncond, cond), own, atol=1e-3)  # negative control: the branches swapped
    wrapper.unwrap()


def _model_calls(family: str) -> bool:
    """Families a model call serves as their pipeline's loop calls the transformer (edit models' reference images
    are the loader-swap issue's; MiniMax-H3's and LTX-2's calls of two streams are held to ComfyUI's own model's in
    test_comfyui_loader_minimax_h3.py and test_comfyui_model_ltx2.py)."""
    wrapper = FAMILIES.pipeline_wrapper(tiny_models.build_tiny_pipeline(family))
    return bool(wrapper.model_call_inputs) and not wrapper.comfy.reference_latents and not wrapper.comfy.audio_stream


MODEL_CALLS = [f for f in tiny_models.FAMILIES if _model_calls(f)]


def _stacked(value):
    """A list of per-sample tensors (Z-Image's latents and texts) as one batched tensor; anything else as it is."""
    return torch.stack(value) if isinstance(value, list) and value and isinstance(value[0], torch.Tensor) else value


@pytest.mark.parametrize("family", MODEL_CALLS)
def test_a_model_calls_arguments_are_the_pipelines_own(rank, family):
    """The transformer call of a model call (latents unpacked, the scheduler's timestep) equals the one the
    pipeline's loop makes at its first step."""
    assert {"flux", "flux2-klein", "flux2-dev", "qwen-image", "sd3", "z-image", "pixart-alpha", "pixart-sigma"} <= set(MODEL_CALLS)
    wrapper = wrap_pipeline(tiny_models.build_tiny_pipeline(family))
    pipeline = wrapper.module
    inputs = tiny_models.make_inputs(family, height=64, width=64, negative=False)
    calls: list[dict] = []
    no_cfg = {"sd3": 1.0, "z-image": 0.0, "pixart-alpha": 1.0, "pixart-sigma": 1.0}
    guidance = {"guidance_scale": no_cfg[family]} if family in no_cfg else {}
    with stub_transformer(wrapper, [None], calls):
        _call(wrapper, family, 2, negative=False, **guidance)
    own = {name: _stacked(value) for name, value in calls[0].items()}
    latents = own[wrapper.module.transformer.plan.image_input]
    if latents.ndim == 5:  # Z-Image's [C, 1, H, W] samples
        latents = latents[:, :, 0]
    elif wrapper.comfy.packed:
        latents = unpack_2x2(latents, 64, 64, pipeline.vae_scale_factor)
    elif wrapper.comfy.tokens:  # FLUX.2: one token per latent pixel of its 1/16 LATENT
        side = 64 // wrapper.latent_scale()
        latents = latents.transpose(1, 2).unflatten(2, (side, side))
    timestep = pipeline.scheduler.timesteps[:1].expand(latents.shape[0])
    conditioning = {name: inputs[name] for name in wrapper.model_call_inputs if name in inputs}
    if "guidance" in wrapper.model_call_inputs and own.get("guidance") is not None:
        conditioning["guidance"] = own["guidance"]
    ours = {name: _stacked(value) for name, value in wrapper.model_call_arguments(latents, timestep, conditioning).items()}
    tensors = {name for name, value in own.items() if isinstance(value, torch.Tensor)}
    assert tensors <= set(ours), f"the pipeline passes {sorted(tensors - set(ours))} that a model call does not"
    for name in tensors:
        assert torch.allclose(ours[name].float(), own[name].float(), atol=1e-6), name
    late = wrapper.model_call_arguments(latents, timestep * 0.99, conditioning)  # negative control: another timestep
    time = "t" if "t" in own else "timestep"
    assert not torch.allclose(late[time].float(), own[time].float(), atol=1e-6)
    wrapper.unwrap()


def test_qwen_image_refuses_what_diffusers_would_place_otherwise_than_comfyui(rank):
    """A model call's reference with an odd count of tokens on a side, or a longer side than the image's, or an unknown
    reference method, is one error before compute; a 2511 transformer (zero_cond_t) under PipeFusion is one layout
    error. Negative control: a reference diffusers places as ComfyUI does is taken."""
    wrapper = wrap_pipeline(tiny_models.build_tiny_pipeline("qwen-image"))
    latents, embeds = torch.randn(1, 16, 8, 8), torch.randn(1, 5, 16)

    def call(reference, method=0.0):
        inputs = {"prompt_embeds": embeds, "reference_latents": reference.flatten(2),
                  "reference_sizes": torch.tensor([[list(reference.shape[2:])]], dtype=torch.float32),
                  "reference_method": torch.tensor([method])}
        return wrapper.model_call_arguments(latents, torch.tensor([500.0]), inputs)

    assert call(torch.randn(1, 16, 4, 8))["img_shapes"] == [[(1, 4, 4), (1, 2, 4)]]
    for size in ((6, 8), (8, 12)):
        with pytest.raises(ValueError, match=f"a reference latent of {size[0]}x{size[1]}"):
            call(torch.randn(1, 16, *size))
    with pytest.raises(ValueError, match=r"reference_method holds \[2.0\]"):
        call(torch.randn(1, 16, 4, 8), method=2.0)
    wrapper.module.transformer.module.register_to_config(zero_cond_t=True)
    wrapper.parallel_config = ParallelConfig(pipefusion_degree=2)
    with pytest.raises(LayoutError, match="zero_cond_t"):
        wrapper.check_layout({}, 1)
    wrapper.unwrap()
