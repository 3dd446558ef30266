import torch
from diffusers import PixArtAlphaPipeline

from ..register import xFuserPipelineWrapperRegister
from .base_pipeline import xFuserPipelineBaseWrapper


@xFuserPipelineWrapperRegister.register(PixArtAlphaPipeline)
class xFuserPixArtAlphaPipeline(xFuserPipelineBaseWrapper):
    # Resolution binning would resize to the model's aspect-ratio bins; given embeddings need no prompt.
    call_defaults = {"use_resolution_binning": False, "negative_prompt": None}
    embedding_sizes = {"prompt_embeds": "caption_channels", "negative_prompt_embeds": "caption_channels"}

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = self.module.encode_prompt(prompt, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}
