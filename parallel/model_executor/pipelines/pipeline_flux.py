from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline

from ...call_parameters import CallParameter
from ..register import xFuserPipelineWrapperRegister
from .base_pipeline import xFuserPipelineBaseWrapper


@xFuserPipelineWrapperRegister.register(FluxPipeline)
class xFuserFluxPipeline(xFuserPipelineBaseWrapper):
    latent_patch = 2  # the pipeline packs 2×2 latent pixels into one token
    embedding_sizes = {
        "prompt_embeds": "joint_attention_dim",
        "negative_prompt_embeds": "joint_attention_dim",
        "pooled_prompt_embeds": "pooled_projection_dim",
        "negative_pooled_prompt_embeds": "pooled_projection_dim",
    }
    call_parameters = {
        "true_cfg_scale": CallParameter(float, "real classifier-free guidance with negative embeddings (1: off)", 0.0, 100.0),
    }

    def flow_sigmas(self, total: int) -> np.ndarray:
        return np.linspace(1.0, 1 / total, total)  # FluxPipeline's own default

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        return (batch, self.image_tokens(height, width), self.module.transformer.config.in_channels)

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        """Flux's guidance_scale is distilled guidance; real CFG is true_cfg_scale with a negative prompt."""
        has_negative = kwargs.get("negative_prompt_embeds") is not None or kwargs.get("negative_prompt") is not None
        return kwargs.get("true_cfg_scale", 1.0) > 1.0 and has_negative

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return (
            "CFG parallel on Flux needs true classifier-free guidance: true_cfg_scale above 1 "
            f"(got {kwargs.get('true_cfg_scale', 1.0)}) and negative prompt embeddings; guidance_scale is "
            "Flux's distilled guidance and needs no second branch. Add both or turn CFG parallel off."
        )

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.module.encode_prompt(prompt, None)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
