"""A prompt as contract E's inputs (IN): the pipeline's own text encoders and its own initial noise.

Rank 0 of a pool computes them for `python -m workers sample --prompt`, and `python -m parallel.make_inputs`
writes them to a file; both equal what the diffusers pipeline computes inside
`__call__(prompt=…, negative_prompt=…, generator=torch.Generator().manual_seed(seed))`.
"""

from __future__ import annotations

import inspect
import torch

NEGATIVE = {
    "prompt_embeds": "negative_prompt_embeds",
    "pooled_prompt_embeds": "negative_pooled_prompt_embeds",
    "prompt_attention_mask": "negative_prompt_attention_mask",
}


def initial_latents(wrapper, seed: int, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The noise the pipeline's `prepare_latents` draws for one image from a CPU generator seeded with `seed`."""
    pipeline = wrapper.module
    parameters = inspect.signature(pipeline.prepare_latents).parameters
    if "num_frames" in parameters or "image" in parameters:
        raise ValueError(f"{type(pipeline).__name__} is a video pipeline: --prompt makes image inputs only; "
                         "write its IN file with 5-D latents (see the README's input shapes)")
    # Flux packs 2×2 latent pixels into one token: its transformer takes 4× the latent channels.
    channels = pipeline.transformer.config.in_channels // (wrapper.latent_patch or 1) ** 2
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = pipeline.prepare_latents(batch_size=1, num_channels_latents=channels, height=height, width=width,
                                       dtype=dtype, device=torch.device("cpu"), generator=generator)
    return latents[0] if isinstance(latents, tuple) else latents


def prompt_inputs(wrapper, prompt: str, negative_prompt: str, seed: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """`wrapper`: the engine's pipeline wrapper, whose `encode_text` is the pipeline's own `encode_prompt`."""
    with torch.no_grad():
        tensors = dict(wrapper.encode_text(prompt))
        tensors.update({NEGATIVE[name]: value for name, value in wrapper.encode_text(negative_prompt).items()})
    tensors["latents"] = initial_latents(wrapper, seed, height, width, tensors["prompt_embeds"].dtype)
    return {name: value.cpu().contiguous() for name, value in tensors.items()}
