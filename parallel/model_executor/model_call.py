"""One evaluation of the wrapped transformer outside its pipeline's loop: a model call of ComfyUI's samplers.

KSampler and SamplerCustomAdvanced step in ComfyUI and ask the model for one prediction per call; a pool
answers each call with one parallel evaluation here. A model call names its inputs as the pipeline does:
`latents` [B, C, H, W] in the model's latent space (unpacked, as ComfyUI holds them), `sigma` [B] the
flow-matching noise level (or [B, T'] per latent frame, where the model takes it so: Wan 2.2 TI2V), `timestep` [B]
where the model's own is not sigma × 1000 (PixArt's discrete schedule), and the family's conditioning
(`model_call_inputs`: prompt_embeds, pooled, ...).
The family's wrapper turns them into the transformer call its pipeline's loop makes (`model_call_arguments`,
`model_call_output`), so the prediction is exactly the one the pipeline computes for the same latents and
timestep, under every layout the plan applies (Ulysses, Ring, USP, uneven tokens).

The batch (ComfyUI batches cond and uncond into one call) is split over the dp ranks, then over the cfg
ranks, wherever it divides; a batch that does not divide runs whole on those ranks (the same result, with
redundant work). PipeFusion pipelines patches across the steps of one run, which single calls do not have.
"""

from __future__ import annotations

import torch

from ..distributed import get_dp_group, get_layout, get_runtime_state
from ..layout.config import LayoutError
from ..families.comfy_data import MODEL_CALL_TENSORS
from ..pipeline_transformers import TRANSFORMERS
from ..request import check_tensor_values


def expert_of(wrapper, expert: str):
    """The pipeline's transformer a call names ("": its first; "transformer_2": Wan 2.2's low-noise expert;
    "transformer_ref": MiniMax-H3's reference partition, which its wrapper names for reference calls)."""
    name = expert or "transformer"
    if name not in TRANSFORMERS or getattr(wrapper.module, name, None) is None:
        experts = [n for n in TRANSFORMERS if getattr(wrapper.module, n, None) is not None]
        raise ValueError(f"this pool's {type(wrapper.module).__name__} has no {name}; its transformers are {experts}")
    return getattr(wrapper.module, name)


def check_model_call(wrapper, tensors: dict[str, torch.Tensor], expert: str = "") -> None:
    """Raise ValueError / LayoutError, before any rank computes, for a call this pool cannot evaluate."""
    pipeline = type(wrapper.module).__name__
    expert_of(wrapper, expert)
    if not wrapper.model_call_inputs:
        raise ValueError(f"{pipeline} takes no single model calls on this pool yet; sample it with xDiT Sampler")
    c = wrapper.parallel_config
    if c.pipefusion_degree > 1:
        raise LayoutError("PipeFusion pipelines patches across the steps of one sampling run, which single model "
                          "calls (xDiT Model) do not have; use a pool with pipefusion degree 1 (Ulysses, Ring, CFG or dp)")
    known = set(MODEL_CALL_TENSORS) | set(wrapper.model_call_inputs)
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ValueError(f"a model call of {pipeline} does not take {unknown}; it takes {sorted(known)}")
    for name in ("latents", "sigma", *wrapper.model_call_required):
        if name not in tensors:
            raise ValueError(f"a model call of {pipeline} needs {name!r}")
    check_tensor_values(tensors)
    latents, sigma = tensors["latents"], tensors["sigma"]
    batch = latents.shape[0]
    channels = expert_of(wrapper, expert).config.in_channels // (4 if wrapper.comfy.packed else 1)
    video = wrapper.comfy.temporal > 0
    if latents.ndim != (5 if video else 4) or latents.shape[1] != channels:
        layout = f"[batch, {channels}, frames, height, width]" if video else f"[batch, {channels}, height, width]"
        raise ValueError(f"latents have shape {list(latents.shape)}; {pipeline} takes {layout} in its model space")
    frames = (batch, latents.shape[2]) if video and wrapper.frame_timesteps() else None
    if sigma.shape != (batch,) and sigma.shape != frames:
        per_frame = f", or one per latent frame, [{batch}, {latents.shape[2]}]" if frames else ""
        raise ValueError(f"sigma must hold one noise level per sample, shape [{batch}]{per_frame}, not {list(sigma.shape)}")
    if ("timestep" in tensors) != wrapper.comfy.model_call_timestep:
        raise ValueError(f"a model call of {pipeline} " + ("needs its model's own timestep" if wrapper.comfy.model_call_timestep
                         else "takes no timestep: it is sigma × 1000"))
    if "timestep" in tensors and tensors["timestep"].shape != (batch,):
        raise ValueError(f"timestep must hold one per sample, shape [{batch}], not {list(tensors['timestep'].shape)}")
    for name in wrapper.model_call_inputs:
        if name in tensors and tensors[name].shape[0] != batch:
            raise ValueError(f"{name} has batch {tensors[name].shape[0]} but latents have {batch}: send one per sample")
    size = call_size(wrapper, latents)
    tokens = wrapper.sequence_tokens(size)
    if not wrapper.tokens_split(tokens):
        raise LayoutError(f"{size['height']}x{size['width']} gives {tokens} tokens, which do not split over sequence-"
                          f"parallel degree {c.sp_degree}; choose a resolution whose token count divides by {c.sp_degree}")


def call_size(wrapper, latents: torch.Tensor) -> dict:
    """A call's size as the pipeline's own checks read it: height and width in pixels, and a video's latents
    (their frames)."""
    scale = wrapper.latent_scale()
    size = {"height": latents.shape[-2] * scale, "width": latents.shape[-1] * scale}
    return {**size, "latents": latents} if latents.ndim == 5 else size


def _split(dp, batch: int) -> list[int] | None:
    """Samples per dp rank, or None where the batch runs whole on every dp rank (fewer samples than dp ranks, or
    --shard-weights alone and a batch that does not divide)."""
    if dp.world_size == 1 or batch < dp.world_size:
        return None
    return get_layout().config.batch_split(batch)


def evaluate(wrapper, tensors: dict[str, torch.Tensor], expert: str = "") -> dict[str, torch.Tensor]:
    """The family's predictions for `tensors` (checked by check_model_call) by its `expert` transformer: `prediction`,
    shaped like `latents`, and a video-with-sound model's audio prediction (`model_call_outputs`)."""
    latents = tensors["latents"]
    # The pipelines' loops pass the scheduler's timestep: sigma × its scale (num_train_timesteps for flow matching),
    # the call's own for a discrete schedule (ComfyData.model_call_timestep).
    timestep = tensors["timestep"] if "timestep" in tensors else tensors["sigma"] * wrapper.timestep_scale()
    inputs = {k: v for k, v in tensors.items() if k not in MODEL_CALL_TENSORS}
    batch = latents.shape[0]
    dp = get_dp_group()
    counts = _split(dp, batch)
    if counts is not None:
        start, count = sum(counts[: dp.rank_in_group]), counts[dp.rank_in_group]
        latents, timestep = latents[start : start + count], timestep[start : start + count]
        inputs = {k: v[start : start + count] for k, v in inputs.items()}
    size = call_size(wrapper, latents)
    get_runtime_state().set_input_parameters(height=size["height"], width=size["width"], batch_size=latents.shape[0],
                                             num_inference_steps=0, image_tokens=wrapper.sequence_tokens(size))
    arguments = wrapper.model_call_arguments(latents, timestep, inputs)
    transformer = expert_of(wrapper, wrapper.model_call_expert(expert, inputs))
    with torch.no_grad(), wrapper.model_call_context(transformer, {**inputs, "latents": latents}):
        output = transformer.evaluate(**arguments, return_dict=False)
    predictions = wrapper.model_call_outputs(output, latents, inputs)
    if counts is None:
        return predictions
    return {name: _gathered(dp, prediction, counts) for name, prediction in predictions.items()}


def _gathered(dp, prediction: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every dp rank's samples of one prediction, in batch order."""
    padded = prediction.new_zeros((max(counts), *prediction.shape[1:]))
    padded[: prediction.shape[0]] = prediction
    gathered = dp.all_gather(padded.unsqueeze(0), dim=0)
    return torch.cat([gathered[i, :n] for i, n in enumerate(counts)])

