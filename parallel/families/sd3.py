"""SD3 / SD3.5 (MMDiT): joint attention with the text replicated after the image shard; SD3.5's extra
image-only attention (attn2) is plain USP; CFG arrives batched.

ComfyUI's SD3 conditioning is CLIP-L‖G padded to 4096 then T5 ([B, 154, 4096]) with a pooled [B, 2048].
"""

from __future__ import annotations

import torch

from ..model_executor.attention import TextLayout
from ..model_executor.pipelines import xFuserPipelineBaseWrapper
from ..model_executor.plans import Gather, ParallelPlan, PipeFusionPlan, Split
from .base import FAMILIES, ComfyData, Family


class xFuserStableDiffusion3Pipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(
        latent_formats={16: "SD3"},
        expects="encode with xDiT Text Encode on this pool, or SD3's TripleCLIPLoader (CLIP-L + CLIP-G + T5: 4096 wide, pooled 2048)",
    )
    tensor_inputs = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    embedding_sizes = {
        "prompt_embeds": "joint_attention_dim",
        "negative_prompt_embeds": "joint_attention_dim",
        "pooled_prompt_embeds": "pooled_projection_dim",
        "negative_pooled_prompt_embeds": "pooled_projection_dim",
    }

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.module.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


SD3 = FAMILIES.register(Family(
    name="sd3",
    pipelines={"StableDiffusion3Pipeline": xFuserStableDiffusion3Pipeline},
    transformer="SD3Transformer2DModel",
    plan=ParallelPlan(
        outputs={"pos_embed": Split(dim=1), "proj_out": Gather(dim=1)},
        attention={"transformer_blocks.*.attn": TextLayout.SUFFIX, "transformer_blocks.*.attn2": TextLayout.NONE},
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks",),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("encoder_hidden_states", "hidden_states"),
        ),
    ),
))
