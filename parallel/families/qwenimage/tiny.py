"""Qwen-Image's tiny built-in models: a one-block Qwen2.5-VL, its processor, the edit models."""

from __future__ import annotations

import torch

from ..base import pictures
from .pipelines import MASKS


# -- tiny built-in model ----------------------------------------------------------------------------------

def tiny_text_encoder(seed: int, width: int, heads: int = 2, kv_heads: int = 1):
    """Qwen2.5-VL on the byte-level Qwen tokenizer of the tiny models with Qwen2.5-VL's vision tokens, `width` wide
    (its multimodal rotary sections in Qwen2.5-VL's proportions of the head size: 16 + 24 + 24 of 64), with a
    one-block vision tower (the edit models encode each prompt with its reference images)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ...loading import tiny_models as tm

    tokenizer, ids, vision_ids = tm._vl_tokenizer()
    half = width // heads // 2
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=len(tokenizer), **ids,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [
                             half // 4, 3 * half // 8, 3 * half // 8]}),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=width,
                           fullatt_block_indexes=[0]), **ids, **vision_ids)
    return tokenizer, tm._seeded(seed, Qwen2_5_VLForConditionalGeneration, config)


def tiny_processor(tokenizer):
    """Qwen2.5-VL's processor on the tiny tokenizer, its images at most 112² pixels (16 image tokens; the real
    one's limit is 3584²), without the video half where torchvision is missing (vl_processors)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    if is_torchvision_available():
        from transformers import Qwen2VLVideoProcessor

        return Qwen2VLProcessor(images, tokenizer, Qwen2VLVideoProcessor())
    from ...loading.vl_processors import images_only

    return images_only(Qwen2VLProcessor)(images, tokenizer)


EDIT_VAE_SCALE = 32  # the tiny edit models' VAE factor (the real one's is 8)


def build_tiny(seed: int, edit: str | None = None):
    """Qwen-Image, or with `edit` the pipeline of that name (QwenImageEditPipeline, QwenImageEditPlusPipeline) on
    the same parts and Qwen2.5-VL's processor."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    from ...loading import tiny_models as tm

    transformer = tm._transformer(seed, QwenImageTransformer2DModel, patch_size=2, in_channels=64, out_channels=16,
                                  num_layers=tm.BLOCKS, joint_attention_dim=tm.T5_DIM, axes_dims_rope=(4, 6, 6))
    if edit is None:
        vae = tm._seeded(seed + 3, AutoencoderKLQwenImage, base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    else:  # five downsamplings (EDIT_VAE_SCALE): the reference the pipeline encodes at ~1024² is 256 tokens
        vae = tm._seeded(seed + 3, AutoencoderKLQwenImage, base_dim=8, z_dim=16, dim_mult=[1] * 6, num_res_blocks=1,
                         temperal_downsample=[False, True, True, False, False])
    # Qwen-Image's own scheduler configuration (resolution-dependent exponential shift).
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)
    tokenizer, text_encoder = tiny_text_encoder(seed + 1, tm.T5_DIM)
    parts = dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    if edit is None:
        return QwenImagePipeline(**parts)
    return getattr(diffusers, edit)(**parts, processor=tiny_processor(tokenizer))


def tiny_inputs(**kwargs) -> dict:
    """Packed latents and Qwen-style embeddings with their masks: the first prompt of a batch fills every
    token, each later one is shorter (padded: 3 tokens less each, 5 for negatives), as Qwen-Image's encoder
    pads a batch."""
    from ...loading import tiny_models as tm

    inputs = tm.image_inputs(latent_channels=16, packed=True, pooled_dim=None, **kwargs)
    out = {name: value for name, value in inputs.items() if not name.endswith("attention_mask")}
    for (embeds, mask), shorter in zip(MASKS.items(), (3, 5)):
        if embeds in out:
            batch, tokens = out[embeds].shape[:2]
            valid = (tokens - shorter * torch.arange(batch)).clamp(min=1)
            out[mask] = (torch.arange(tokens) < valid[:, None]).long()
    return out


def tiny_edit_inputs(references: int, **kwargs) -> dict:
    """tiny_inputs for the ×32 VAE of the edit models and `references` square reference images, 8-bit values (as
    ComfyUI's images are); the pipelines encode each at 1024² (256 reference tokens here)."""
    gen = torch.Generator().manual_seed(kwargs["seed"] + 1)
    image = torch.randint(0, 256, (references, 3, 32, 32), generator=gen) / 255
    return {**tiny_inputs(**kwargs, scale=EDIT_VAE_SCALE), "image": image}
