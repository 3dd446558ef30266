"""SD3 / SD3.5 (MMDiT): joint attention with the text replicated after the image shard; SD3.5's extra
image-only attention (attn2) is plain USP; CFG arrives batched.

ComfyUI's SD3 conditioning is CLIP-L‖G padded to 4096 then T5 ([B, 154, 4096]) with a pooled [B, 2048].
Single files: SAI's layout (joint_blocks.*; whole checkpoints keep it under model.diffusion_model.),
converted by diffusers' own converter.
"""

from __future__ import annotations

import math

import torch

from ..loading.checkpoints.shapes import Shapes, block_indices
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline import xFuserPipelineBaseWrapper
from ..model_executor.plans import Gather, ParallelPlan, PipeFusionPlan, Split
from .base import FAMILIES, Family, SingleFile, TinyModel, Variant
from .comfy_data import ComfyData

# SAI's MMDiT sets hidden = 64 x depth, heads = depth (head size 64) unless q/k norms show the head size.
HEAD_DIM = 64


class xFuserStableDiffusion3Pipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(
        latent_formats={16: "SD3"}, model_class="SD3",
        model_call_conds={"context": "prompt_embeds", "y": "pooled_prompt_embeds"},
        expects="encode with xDiT Text Encode on this pool, or SD3's TripleCLIPLoader (CLIP-L + CLIP-G + T5: 4096 wide, pooled 2048)",
    )
    tensor_inputs = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    embedding_sizes = {
        "prompt_embeds": "joint_attention_dim",
        "negative_prompt_embeds": "joint_attention_dim",
        "pooled_prompt_embeds": "pooled_projection_dim",
        "negative_pooled_prompt_embeds": "pooled_projection_dim",
    }

    model_call_inputs = model_call_required = ("prompt_embeds", "pooled_prompt_embeds")

    def model_call_arguments(self, latents, timestep, inputs):
        return {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": inputs["prompt_embeds"],
                "pooled_projections": inputs["pooled_prompt_embeds"]}

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.module.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    hidden, in_channels, patch, _ = shape("x_embedder.proj.weight")
    qk_norm = "joint_blocks.0.x_block.attn.ln_q.weight" in shape
    dual = block_indices(shape.shapes, r"joint_blocks\.(\d+)\.x_block\.attn2\.")
    variant = "sd3.5-medium" if dual else "sd3.5-large" if qk_norm else "sd3-medium"
    head_dim = shape("joint_blocks.0.x_block.attn.ln_q.weight")[0] if qk_norm else HEAD_DIM
    caption_dim, joint_dim = shape("context_embedder.weight")
    return variant, {
        "in_channels": in_channels, "out_channels": shape("final_layer.linear.weight")[0] // patch**2,
        "patch_size": patch, "attention_head_dim": head_dim, "num_attention_heads": shape.heads(hidden, head_dim),
        "num_layers": shape.blocks(r"joint_blocks\.(\d+)\."), "caption_projection_dim": caption_dim,
        "joint_attention_dim": joint_dim, "pooled_projection_dim": shape("y_embedder.mlp.0.weight")[1],
        "pos_embed_max_size": math.isqrt(shape("pos_embed")[1]), "dual_attention_layers": dual,
        "qk_norm": "rms_norm" if qk_norm else None,
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    return convert_sd3_transformer_checkpoint_to_diffusers(state_dict)


# -- tiny built-in model --------------------------------------------------------------------------------
def build_tiny(seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from ..loading import tiny_models as tm

    (tok1, clip1), (tok2, clip2) = tm._clip(seed + 1, True), tm._clip(seed + 2, True)
    tok3, t5 = tm._t5(seed + 3)
    transformer = tm._transformer(seed, SD3Transformer2DModel, sample_size=8, patch_size=2, in_channels=16,
                                  out_channels=16, num_layers=tm.BLOCKS, joint_attention_dim=tm.T5_DIM,
                                  caption_projection_dim=tm.HEADS * tm.HEAD_DIM, pooled_projection_dim=2 * tm.CLIP_DIM,
                                  pos_embed_max_size=16)  # 16x16 patches: images up to 256x256
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tm._vae(seed + 4, 16, 1.5305, 0.0609), text_encoder=clip1, tokenizer=tok1,
        text_encoder_2=clip2, tokenizer_2=tok2, text_encoder_3=t5, tokenizer_3=tok3)


def tiny_inputs(**kwargs) -> dict:
    from ..loading import tiny_models as tm

    return tm.image_inputs(latent_channels=16, packed=False, pooled_dim=2 * tm.CLIP_DIM, default_tokens=24, **kwargs)


SD3 = FAMILIES.register(Family(
    name="sd3",
    pipelines={"StableDiffusion3Pipeline": xFuserStableDiffusion3Pipeline},
    transformer="SD3Transformer2DModel",
    plan=ParallelPlan(
        inputs={"": {"encoder_hidden_states": Split(dim=1, expected_dims=3, text=True)}},  # where it divides
        outputs={"pos_embed": Split(dim=1, expected_dims=3), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn": TextLayout.SUFFIX, "transformer_blocks.*.attn2": TextLayout.NONE},
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks",),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("encoder_hidden_states", "hidden_states"),
        ),
    ),
    single_file=SingleFile(
        marker="joint_blocks.0.x_block.attn.qkv.weight",
        title="SD3",
        variants={
            "sd3-medium": Variant("sd3", "SD3 medium", "SAI keys joint_blocks.*, no q/k norm"),
            "sd3.5-medium": Variant("sd3", "SD3.5 medium", "SAI keys joint_blocks.*, q/k norm, x_block.attn2"),
            "sd3.5-large": Variant("sd3", "SD3.5 large", "SAI keys joint_blocks.*, q/k norm, no attn2"),
        },
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={"sd3": TinyModel("StableDiffusion3Pipeline", build_tiny, tiny_inputs)},
))
