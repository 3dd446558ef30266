"""Qwen-Image: an MMDiT over packed 2×2 latent tokens with Qwen2.5-VL text, true CFG as two calls.

The image tokens are split at the transformer's input and their rotary table (the first of the two
tables `pos_embed` returns; the text's second one stays whole) with them; the text is replicated in
front of every image shard in the joint attention. The text mask (`prompt_embeds_mask`) marks padding
only where prompts of different lengths share a batch; sequence-parallel attention takes no mask, so
trailing padding common to the whole batch is trimmed away before the call (exact: padded keys are
masked out and the text's rotary positions start at 0 either way), an all-valid mask is dropped, and
prompts that still differ in length are refused under Ulysses, Ring and PipeFusion with one line.

Single files (Comfy-Org's `qwen_image_*.safetensors`, also fp8 and GGUF) keep diffusers' own names, under
ComfyUI's `model.diffusion_model.` prefix where it is whole-checkpoint; the rotary axes have no weights and
follow the head size in Qwen-Image's proportions (16 + 56 + 56 of 128).

Its attention layers are diffusers' shared `Attention` class with a processor that calls
`dispatch_attention_fn`, so the family declares the processor (`attention_layers`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..call_parameters import CallParameter
from ..checkpoints.shapes import Shapes
from ..config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipelines import xFuserPipelineBaseWrapper
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, PipeFusionPlan, Split, TokenRows
from .base import FAMILIES, ComfyData, Family, SingleFile, TinyModel, Variant, pack_2x2, unpack_2x2

MASKS = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}


class xFuserQwenImagePipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(
        latent_formats={16: "Wan21"}, packed=True, cfg_call="true_cfg_scale",
        expects="encode with xDiT Text Encode on this pool, or Qwen-Image's CLIPLoader (Qwen2.5-VL 7B, 3584 wide)",
        empty_latent="EmptySD3LatentImage (16 channels)", model_class="QwenImage",
        model_call_conds={"context": "prompt_embeds"},
    )
    tensor_inputs = tuple(MASKS.values())
    latent_patch = 2
    embedding_sizes = {"prompt_embeds": "joint_attention_dim", "negative_prompt_embeds": "joint_attention_dim"}
    call_parameters = {
        "true_cfg_scale": CallParameter(float, "classifier-free guidance with the negative embeddings (1: off)", 0.0, 100.0),
    }

    model_call_inputs = model_call_required = ("prompt_embeds",)

    def model_call_arguments(self, latents, timestep, inputs):
        """QwenImagePipeline's loop: 2×2-packed tokens, timestep / 1000, the text without a mask (all valid)."""
        batch, _, height, width = latents.shape
        return {"hidden_states": pack_2x2(latents), "timestep": timestep / 1000,
                "encoder_hidden_states": inputs["prompt_embeds"], "encoder_hidden_states_mask": None,
                "img_shapes": [[(1, height // 2, width // 2)]] * batch}

    def model_call_output(self, output, latents):
        return unpack_2x2(output, latents.shape[2] * 8, latents.shape[3] * 8)

    def flow_sigmas(self, total: int) -> np.ndarray:
        return np.linspace(1.0, 1 / total, total)  # QwenImagePipeline's own default

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        return (batch, self.image_tokens(height, width), self.module.transformer.config.in_channels)

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        has_negative = kwargs.get("negative_prompt_embeds") is not None or kwargs.get("negative_prompt") is not None
        return kwargs.get("true_cfg_scale", 4.0) > 1.0 and has_negative

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return ("CFG parallel on Qwen-Image needs true_cfg_scale above 1 (got "
                f"{kwargs.get('true_cfg_scale', 4.0)}) and negative prompt embeddings; add both or turn CFG parallel off.")

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        kwargs, batch, tokens = super().prepare(kwargs, check_layout)
        if not self.module.transformer.config.guidance_embeds:  # no distilled guidance: diffusers ignores it, noisily
            kwargs.pop("guidance_scale", None)
        for embeds, mask in MASKS.items():
            if kwargs.get(mask) is not None and kwargs.get(embeds) is not None:
                kwargs[embeds], kwargs[mask] = self._without_padding(kwargs[embeds], kwargs[mask], mask)
        return kwargs, batch, tokens

    def _without_padding(self, embeds: torch.Tensor, mask: torch.Tensor, name: str):
        """Trim the batch's common trailing padding; drop a mask with none left (see the module docstring)."""
        valid = mask.bool()
        if valid.shape != embeds.shape[:2]:
            raise ValueError(f"{name} {list(mask.shape)} must be [batch, tokens] of its embeddings {list(embeds.shape)}")
        used = valid.any(dim=0).nonzero()
        length = int(used.max()) + 1 if len(used) else 1
        embeds, valid = embeds[:, :length], valid[:, :length]
        if valid.all():
            return embeds, None
        c = self.parallel_config
        if c.sp_degree > 1 or c.pipefusion_degree > 1:
            raise LayoutError(f"{name} pads the shorter prompts of this batch; Ulysses, Ring and PipeFusion attention "
                              "take no mask: send one prompt per job, or prompts of one token length")
        return embeds, valid.to(mask.dtype)

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask = self.module.encode_prompt(prompt, device=self.module.transformer.device)
        return {"prompt_embeds": embeds} if mask is None else {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


# -- single-file checkpoints: diffusers' own names -----------------------------------------------------------
def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    hidden, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    spatial = head_dim * 7 // 16 // 2 * 2
    if "transformer_blocks.0.img_mod.1.weight" not in shape or "time_text_embed.addition_t_embedding.weight" in shape:
        raise shape.error("a Qwen-Image transformer of a variant this pack does not support (only Qwen-Image text-to-image)")
    return "qwen-image", {
        "in_channels": in_channels, "out_channels": shape("proj_out.weight")[0] // 4, "attention_head_dim": head_dim,
        "num_attention_heads": shape.heads(hidden, head_dim), "num_layers": shape.blocks(r"transformer_blocks\.(\d+)\."),
        "joint_attention_dim": shape("txt_in.weight")[1], "axes_dims_rope": [head_dim - 2 * spatial, spatial, spatial],
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    return state_dict  # already diffusers' names


# -- tiny built-in model ----------------------------------------------------------------------------------
def tiny_text_encoder(seed: int, width: int, heads: int = 2, kv_heads: int = 1):
    """Qwen2.5-VL on the byte-level Qwen tokenizer of the tiny models, `width` wide (its multimodal rotary
    sections in Qwen2.5-VL's proportions of the head size: 16 + 24 + 24 of 64)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .. import tiny_models as tm

    tokenizer = tm._qwen_tokenizer()
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    half = width // heads // 2
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=len(tokenizer), **ids,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [
                             half // 4, 3 * half // 8, 3 * half // 8]}),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=width,
                           fullatt_block_indexes=[0]), **ids)
    return tokenizer, tm._seeded(seed, Qwen2_5_VLForConditionalGeneration, config)


def build_tiny(seed: int):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    from .. import tiny_models as tm

    transformer = tm._transformer(seed, QwenImageTransformer2DModel, patch_size=2, in_channels=64, out_channels=16,
                                  num_layers=tm.BLOCKS, joint_attention_dim=tm.T5_DIM, axes_dims_rope=(4, 6, 6))
    vae = tm._seeded(seed + 3, AutoencoderKLQwenImage, base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    # Qwen-Image's own scheduler configuration (resolution-dependent exponential shift).
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)
    tokenizer, text_encoder = tiny_text_encoder(seed + 1, tm.T5_DIM)
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


def tiny_inputs(**kwargs) -> dict:
    """Packed latents and Qwen-style embeddings with their masks: the first prompt of a batch fills every
    token, each later one is shorter (padded: 3 tokens less each, 5 for negatives), as Qwen-Image's encoder
    pads a batch."""
    from .. import tiny_models as tm

    inputs = tm.image_inputs(latent_channels=16, packed=True, pooled_dim=None, **kwargs)
    out = {name: value for name, value in inputs.items() if not name.endswith("attention_mask")}
    for (embeds, mask), shorter in zip(MASKS.items(), (3, 5)):
        if embeds in out:
            batch, tokens = out[embeds].shape[:2]
            valid = (tokens - shorter * torch.arange(batch)).clamp(min=1)
            out[mask] = (torch.arange(tokens) < valid[:, None]).long()
    return out


QWEN_IMAGE = FAMILIES.register(Family(
    name="qwen-image",
    pipelines={"QwenImagePipeline": xFuserQwenImagePipeline},
    transformer="QwenImageTransformer2DModel",
    plan=ParallelPlan(
        inputs={"": {"hidden_states": Split(dim=1, expected_dims=3)}},
        outputs={"pos_embed": Split(dim=0, items=(0,), expected_dims=2), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn": TextLayout.PREFIX},
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks",),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("encoder_hidden_states", "hidden_states"),
            token_inputs={"image_rotary_emb": TokenRows(dim=0, items=(0,))},  # the image's table; the text's whole
        ),
    ),
    single_file=SingleFile(
        marker="txt_norm.weight",
        title="Qwen-Image",
        variants={"qwen-image": Variant("qwen-image", "Qwen-Image", "diffusers' keys img_in.*, txt_norm.*, transformer_blocks.*")},
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={"qwen-image": TinyModel("QwenImagePipeline", build_tiny, tiny_inputs, guidance=1.0,
                                  true_cfg={"true_cfg_scale": 4.0})},
    attention_layers={"QwenDoubleStreamAttnProcessor2_0": "diffusers.models.transformers.transformer_qwenimage"},
))
