"""The pipeline wrapper's checks of a call against the model and the layout, before any rank computes.

A family overrides what its pipeline counts differently (tokens of video frames and reference images, rows a
PipeFusion patch cuts, heads, the latents' shape); `check_layout` turns every input that cannot run on this
layout into one LayoutError that names the numbers and the fix.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ...layout.config import LayoutError
from ...request import STEP_CACHE


def embedding_width(config, entry: str | tuple[str, ...]) -> int:
    """An embedding's width from the transformer config: one entry, or the product of several (Krea 2's stacked
    text layers: num_text_layers × text_hidden_dim, flattened as ComfyUI carries them)."""
    return int(math.prod(config[name] for name in ((entry,) if isinstance(entry, str) else entry)))


class LayoutChecks:
    """Mixed into the pipeline wrapper (wrapper.py), which gives it `module` and `parallel_config`.

    guidance:                the call argument whose value above 1 turns classifier-free guidance on, and its
                             default in the pipeline's `__call__` (Flux, Qwen-Image: true_cfg_scale).
    guidance_needs_negative: guidance runs only with a negative prompt (true CFG).
    """

    guidance: ClassVar[tuple[str, float]] = ("guidance_scale", 1.0)
    guidance_needs_negative: ClassVar[bool] = False

    def attention_heads(self) -> int:
        return self.module.transformer.config.num_attention_heads

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        """Whether this call runs classifier-free guidance (two branches): the family's `guidance` argument above 1,
        and with `guidance_needs_negative`, a negative prompt given."""
        name, default = self.guidance
        negative = kwargs.get("negative_prompt_embeds") is not None or kwargs.get("negative_prompt") is not None
        return kwargs.get(name, default) > 1.0 and (negative or not self.guidance_needs_negative)

    def image_tokens(self, height: int, width: int) -> int:
        patch = self.latent_patch or self.module.transformer.config.patch_size
        return self.grid_tokens(height, width, self.module.vae_scale_factor, patch, patch)

    @staticmethod
    def grid_tokens(height: int, width: int, scale: int, patch_h: int, patch_w: int) -> int:
        """Tokens of a height × width image at VAE factor `scale` in patch_h × patch_w patches; a side that
        does not divide is a LayoutError that says how to round it."""
        for name, size, patch in (("height", height, patch_h), ("width", width, patch_w)):
            if size % (scale * patch):
                raise LayoutError(
                    f"{name} {size} is not a multiple of {scale * patch} (VAE factor {scale} × patch {patch}); "
                    f"round it to a multiple of {scale * patch}."
                )
        return (height // (scale * patch_h)) * (width // (scale * patch_w))

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        """Tokens the sequence-parallel split sees: the image's and its reference images' (video pipelines count
        every latent frame)."""
        return self.image_tokens(kwargs["height"], kwargs["width"]) + self.reference_tokens(kwargs.get("image"))

    def reference_tokens(self, image: Any) -> int:
        """Tokens reference images add after the image's in the sequence (edit models); 0 for the others."""
        return 0

    def token_rows(self, kwargs: dict[str, Any]) -> int:
        """Rows of image tokens (video: of every latent frame): PipeFusion patches cut whole rows."""
        patch = self.latent_patch or self.module.transformer.config.patch_size
        return kwargs["height"] // (self.module.vae_scale_factor * patch)

    def tokens_split(self, tokens: int) -> bool:
        """Whether `tokens` split over the sequence-parallel degree: evenly, or unevenly if the plan pads."""
        sp = self.parallel_config.sp_degree
        return tokens % sp == 0 or (self.module.transformer.plan.uneven_tokens and tokens >= sp)

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        scale = self.module.vae_scale_factor
        return (batch, self.module.transformer.config.in_channels, height // scale, width // scale)

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        """Shapes of the given tensors against the model, so a mismatch fails before any rank computes."""
        latents = kwargs.get("latents")
        expected = self.expected_latents_shape(batch, kwargs["height"], kwargs["width"])
        if isinstance(latents, torch.Tensor) and tuple(latents.shape) != expected:
            raise ValueError(
                f"latents have shape {list(latents.shape)} but {type(self.module).__name__} at "
                f"{kwargs['height']}x{kwargs['width']} needs {list(expected)}; send latents of that shape."
            )
        config = self.module.transformer.config
        for name, entry in self.embedding_sizes.items():
            tensor = kwargs.get(name)
            if not isinstance(tensor, torch.Tensor):
                continue
            width = tensor.flatten(2).shape[-1] if tensor.ndim > 3 else tensor.shape[-1]  # stacked layers: all of them
            if tensor.shape[0] != batch or width != embedding_width(config, entry):
                raise ValueError(
                    f"{name} has shape {list(tensor.shape)}, but this model needs batch {batch} and width "
                    f"{embedding_width(config, entry)} ({entry}); encode the prompt with this model's own text encoders."
                )

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        """Raise LayoutError, before any compute, if this input cannot run on this layout."""
        c = self.parallel_config
        heads = self.attention_heads()
        if heads % c.ulysses_degree:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise LayoutError(
                f"the model has {heads} attention heads, which do not split over ulysses degree {c.ulysses_degree}; "
                f"use a ulysses degree in {divisors} and put the rest into --ring-degree."
            )
        tokens = self.sequence_tokens(kwargs)
        self.check_inputs(kwargs, batch)
        if not self.tokens_split(tokens):
            raise LayoutError(
                f"{kwargs['height']}x{kwargs['width']} gives {tokens} image tokens, which do not split over "
                f"sequence-parallel degree {c.sp_degree} (ring {c.ring_degree} × ulysses {c.ulysses_degree}); "
                f"choose a resolution whose token count divides by {c.sp_degree} or lower the degrees."
            )
        if c.pipefusion_degree > 1:
            rows = self.token_rows(kwargs)
            if rows % (c.patches * c.sp_degree):
                raise LayoutError(
                    f"{kwargs['height']}x{kwargs['width']} has {rows} token rows, which do not split into "
                    f"{c.patches} PipeFusion patches × sequence-parallel degree {c.sp_degree}; choose a height whose "
                    f"token rows divide by {c.patches * c.sp_degree}, or change --num-patches."
                )
            references = self.reference_tokens(kwargs.get("image"))
            if references and tokens % (c.patches * c.sp_degree):  # the patches cut [noisy; reference] tokens
                raise LayoutError(
                    f"{tokens} tokens ({references} of them the reference images') do not split into {c.patches} "
                    f"PipeFusion patches × sequence-parallel degree {c.sp_degree}; choose a reference size whose tokens "
                    f"make the total divide by {c.patches * c.sp_degree}, or change --num-patches."
                )
        if kwargs.get(STEP_CACHE) is not None:
            from ..step_cache import check_cache

            check_cache(kwargs[STEP_CACHE], c.pipefusion_degree, self.module.transformer.module)
        if c.cfg_degree > 1 and not self.uses_cfg(kwargs):
            raise LayoutError(self.cfg_parallel_hint(kwargs))
        if batch < c.dp_degree and not c.dp_when_divisible:
            raise LayoutError(
                f"data parallel degree {c.dp_degree} needs at least {c.dp_degree} samples, but the batch is {batch}; "
                f"lower --dp-degree or send {c.dp_degree} or more samples."
            )
        return tokens

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return (
            f"CFG parallel needs classifier-free guidance, but guidance_scale is {kwargs.get('guidance_scale', 1.0)}; "
            "set a guidance scale above 1 or turn CFG parallel off."
        )
