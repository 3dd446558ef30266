"""PixArt-α and PixArt-Σ: one transformer class (PixArtTransformer2DModel) and one call.

Image tokens split after the patch embedding, self-attention runs USP, cross-attention to the T5
caption stays local; CFG arrives batched. ComfyUI keeps PixArt-α latents in SD1.5's format and
PixArt-Σ latents in SDXL's, and passes T5 attention masks in the conditioning.
"""

from __future__ import annotations

import torch

from ..model_executor.attention import TextLayout
from ..model_executor.pipelines import xFuserPipelineBaseWrapper
from ..model_executor.plans import Gather, ParallelPlan, PipeFusionPlan, Split
from .base import FAMILIES, ComfyData, Family

EXPECTS = "encode with xDiT Text Encode on this pool, or PixArt's T5-XXL encoder"


class xFuserPixArtAlphaPipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(latent_formats={4: "SD15"}, expects=EXPECTS)
    tensor_inputs = ("prompt_attention_mask", "negative_prompt_attention_mask")
    # Resolution binning would resize to the model's aspect-ratio bins; given embeddings need no prompt.
    call_defaults = {"use_resolution_binning": False, "negative_prompt": None}
    embedding_sizes = {"prompt_embeds": "caption_channels", "negative_prompt_embeds": "caption_channels"}

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = self.module.encode_prompt(prompt, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}


class xFuserPixArtSigmaPipeline(xFuserPixArtAlphaPipeline):
    """Same transformer class and call as PixArt-α; SDXL's latent format."""

    comfy = ComfyData(latent_formats={4: "SDXL"}, expects=EXPECTS)


PIXART = FAMILIES.register(Family(
    name="pixart",
    pipelines={"PixArtAlphaPipeline": xFuserPixArtAlphaPipeline, "PixArtSigmaPipeline": xFuserPixArtSigmaPipeline},
    transformer="PixArtTransformer2DModel",
    plan=ParallelPlan(
        outputs={"pos_embed": Split(dim=1), "proj_out": Gather(dim=1)},
        attention={"transformer_blocks.*.attn1": TextLayout.NONE},
        pipefusion=PipeFusionPlan(blocks=("transformer_blocks",)),
    ),
))
