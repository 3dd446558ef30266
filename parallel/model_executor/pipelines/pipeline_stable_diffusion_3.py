import torch
from diffusers import StableDiffusion3Pipeline

from ..register import xFuserPipelineWrapperRegister
from .base_pipeline import xFuserPipelineBaseWrapper


@xFuserPipelineWrapperRegister.register(StableDiffusion3Pipeline)
class xFuserStableDiffusion3Pipeline(xFuserPipelineBaseWrapper):
    embedding_sizes = {
        "prompt_embeds": "joint_attention_dim",
        "negative_prompt_embeds": "joint_attention_dim",
        "pooled_prompt_embeds": "pooled_projection_dim",
        "negative_pooled_prompt_embeds": "pooled_projection_dim",
    }

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.module.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
