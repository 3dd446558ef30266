"""The built-in tiny LTX-2 (`xdit-tiny-ltx2`): LTX-2.3's layout at a tiny size (split rotary tables, gated attention,
per-modality text projections and prompt modulation, perturbed attention for spatio-temporal guidance), two blocks,
a ×32 / ×8 video VAE with 128 latent channels as the real one, an audio VAE of 4 channels × 4 mel bins and a
vocoder, and a two-layer Gemma 3 text model with its tokenizer (jobs may send Gemma's hidden states instead). Both VAEs have latent statistics far from 0 and 1, so a
rescaling left out shows."""

from __future__ import annotations

import torch

LATENT, AUDIO_LATENT, MEL_BINS = 128, 4, 16  # video latent channels; audio latent channels, mel bins (4 per latent bin)
AUDIO_WIDTH = AUDIO_LATENT * MEL_BINS // 4  # audio tokens' width: channels × latent mel bins
CAPTION, LAYERS = 32, 3  # the text encoder's width and its hidden states stacked per token (Gemma: 3840, 49)
TEXT_WIDTH = CAPTION * LAYERS
VIDEO_WIDTH, AUDIO_HEADS = 64, 2  # video 4 heads × 16 (tiny_models); audio 2 heads × 16
FRAME_RATE = 25.0  # ComfyUI's LTXVEmptyLatentAudio default
# LTX-2's q/k RMS norms (affine, across heads) already make logits O(√d): ×2 on q and k gives each query a top weight
# of ~0.6 among 45 keys; the shared ×4 (tiny_models.QK_SCALE) makes attention near-argmax, whose ties flip with float
# rounding (splitting the CFG batch alone then moves the result by 1e-4).
PEAK = 2.0


def build_tiny(seed: int, pipeline: str = "LTX2Pipeline"):
    import diffusers
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    from ...loading import tiny_models as tm

    audio_width = AUDIO_HEADS * tm.HEAD_DIM
    # The condition pipelines encode their pictures: their encoder compresses ×32 / ×8 as the decoder expands (the
    # other tiny models' encoder, never run, compresses ×16 / ×4 and is kept so their files stay as they are).
    encodes = pipeline in ("LTX2ConditionPipeline", "LTX2InContextPipeline")
    encoder = {"downsample_type": ("spatiotemporal",) * 4} if encodes else {}
    transformer = tm._seeded(
        seed, LTX2VideoTransformer3DModel, num_attention_heads=tm.HEADS, attention_head_dim=tm.HEAD_DIM, in_channels=LATENT, out_channels=LATENT, cross_attention_dim=VIDEO_WIDTH,
        audio_in_channels=AUDIO_WIDTH, audio_out_channels=AUDIO_WIDTH, audio_num_attention_heads=AUDIO_HEADS,
        audio_attention_head_dim=tm.HEAD_DIM, audio_cross_attention_dim=audio_width, num_layers=2,
        caption_channels=CAPTION, rope_type="split", gated_attn=True, cross_attn_mod=True, audio_gated_attn=True,
        audio_cross_attn_mod=True, perturbed_attn=True, use_prompt_embeddings=False)
    tm._peak_attention(transformer, PEAK)
    vae = tm._seeded(seed + 3, AutoencoderKLLTX2Video, latent_channels=LATENT, block_out_channels=(8, 8, 8, 8),
                     decoder_block_out_channels=(8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                     decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
                     upsample_factor=(1, 1, 1), **encoder)
    audio_vae = tm._seeded(seed + 4, AutoencoderKLLTX2Audio, base_channels=AUDIO_WIDTH, output_channels=2,
                           ch_mult=(1, 2, 4), num_res_blocks=1, in_channels=2, latent_channels=AUDIO_LATENT,
                           mel_bins=MEL_BINS, resolution=64)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 5)
        for model, width in ((vae, LATENT), (audio_vae, AUDIO_WIDTH)):
            model.latents_mean.copy_(torch.randn(width, generator=gen) * 0.5)
            model.latents_std.copy_(torch.rand(width, generator=gen) + 0.5)
    vocoder = tm._seeded(seed + 6, LTX2Vocoder, in_channels=2 * MEL_BINS, hidden_channels=16, out_channels=2,
                         upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2], resnet_kernel_sizes=[3],
                         resnet_dilations=[[1, 3]], output_sampling_rate=16000)
    connectors = tm._seeded(
        seed + 7, LTX2TextConnectors, caption_channels=CAPTION, text_proj_in_factor=LAYERS,
        video_connector_num_attention_heads=tm.HEADS, video_connector_attention_head_dim=tm.HEAD_DIM,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=AUDIO_HEADS, audio_connector_attention_head_dim=tm.HEAD_DIM,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None, rope_type="split",
        per_modality_projections=True, video_hidden_dim=VIDEO_WIDTH, audio_hidden_dim=audio_width,
        video_gated_attn=True, audio_gated_attn=True)
    tokenizer, text_encoder = tm._gemma3(seed + 8, CAPTION, LAYERS - 1)  # embeddings + 2 layers: 3 stacked states
    return getattr(diffusers, pipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)


def audio_frames(num_frames: int, frame_rate: float = FRAME_RATE) -> int:
    """Audio latent frames of a video, as LTX2Pipeline counts them (16 kHz, hop 160, ×4: 25 a second)."""
    return round(num_frames / frame_rate * 16000 / 160 / 4)


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Video latents [B, 128, T', H/32, W/32] and audio latents [B, 4, L, 4] in their VAEs' own spaces, Gemma-style
    text [B, T, 96] left-padded as Gemma's tokenizer pads (each sample, and the negative, a different length)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or 13
    frames = (num_frames - 1) // 8 + 1
    out = {"latents": torch.randn(batch, LATENT, frames, height // 32, width // 32, generator=gen),
           "audio_latents": torch.randn(batch, AUDIO_LATENT, audio_frames(num_frames), MEL_BINS // 4, generator=gen)}
    for offset, prefix in enumerate(("", "negative_") if negative else ("",)):
        padding = 3 + 2 * offset + torch.arange(batch)
        out[prefix + "prompt_embeds"] = torch.randn(batch, tokens, TEXT_WIDTH, generator=gen)
        out[prefix + "prompt_attention_mask"] = (torch.arange(tokens) >= padding[:, None]).long()
    return out
