"""The built-in tiny MiniMax-H3 (`xdit-tiny-minimax-h3`): the released layout (24 video latent channels at ×16 / ×4
in the pipeline's 17n+5 frame grid, 32 audio latent channels at 40 a second, stereo as two channel-major blocks of
rows, one packed sequence [text | audio | video]) at a tiny width, two blocks, one text refiner block; a second
transformer of other weights, `transformer_ref`, for reference-to-video; tiny VAEs of diffusers' own classes at the
released geometry (video: 24 channels at ×16 / ×4 in 17-frame chunks, a one-block ViT decoder; audio: 32 channels at
800 samples a latent, 32 kHz, a three-stage BigVGAN decoder — its vocoder); no text encoder (jobs send the text
encoder's hidden states and their modality tags). Both VAEs have latent statistics far from 0 and 1, so a
denormalisation left out shows; they decode the tiny video in under a second. Its blocks refuse videos under 5 s, so
the smallest case is 124 frames: 37 latent frames, at 64×64 4 rows each (148), 207 audio latents × 2 channels (414),
and the text: one packed sequence of ~585 rows that no sequence-parallel degree above 1 divides evenly for most text
lengths."""

from __future__ import annotations

import torch

LATENT, AUDIO_LATENT = 24, 32  # video and audio latent channels, as released (ComfyUI's MiniMaxH3AV latents)
TEXT_WIDTH, TEXT_TOKENS = 32, 23  # the text encoder's width (Qwen3-VL's hidden_states[50]: 5120) and a default length
FRAMES = 124  # the shortest video the pipeline generates: 5 s at 24 fps, snapped to 17n+5
# The q/k RMS norms are affine: their weights ×2 (tiny_models._peak_attention) make every attention peaked over the
# ~585 rows; ×4 (QK_SCALE) makes it near-argmax, whose ties flip with float rounding.
PEAK = 2.0


def build_tiny(seed: int):
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler,
                           MiniMaxH3Transformer3DModel)
    from diffusers.modular_pipelines import MiniMaxH3ModularPipeline

    from ...loading import tiny_models as tm

    def transformer(weights_seed: int):
        model = tm._seeded(
            weights_seed, MiniMaxH3Transformer3DModel, num_attention_heads=tm.HEADS, attention_head_dim=tm.HEAD_DIM,
            hidden_size=64, num_layers=2, num_refiner_layers=1, ffn_dim=128, in_channels=LATENT,
            audio_in_channels=AUDIO_LATENT, text_dim=TEXT_WIDTH, freq_dim=32, time_embed_hidden_dim=64,
            time_embed_dim=32, rope_freq_dim=2)
        return tm._peak_attention(model, PEAK)

    gen = torch.Generator().manual_seed(seed + 5)
    statistics = {"latents_mean": (torch.randn(LATENT, generator=gen) * 0.5).tolist(),
                  "latents_std": (torch.rand(LATENT, generator=gen) + 0.5).tolist()}
    vae = tm._seeded(seed + 3, AutoencoderKLMiniMaxH3, latent_channels=LATENT, block_out_channels=(8, 8, 8, 8),
                     layers_per_block=1, spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1),
                     norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
                     decoder_num_register_tokens=2, decoder_ffn_mult=2, **statistics)
    audio_statistics = {"latents_mean": (torch.randn(AUDIO_LATENT, generator=gen) * 0.5).tolist(),
                        "latents_std": (torch.rand(AUDIO_LATENT, generator=gen) + 0.5).tolist()}
    audio_vae = tm._seeded(seed + 4, AutoencoderKLMiniMaxH3Audio, encoder_dim=2, latent_dim=AUDIO_LATENT,
                           latent_channels=AUDIO_LATENT, num_attention_heads=2, decoder_dim=16, decoder_rates=(8, 10, 10),
                           decoder_kernel_sizes=(16, 20, 20), resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
                           **audio_statistics)
    pipeline = MiniMaxH3ModularPipeline()
    # ref2va runs its own checkpoint partition, `transformer_ref` (same architecture, other weights: a job that ran the
    # t2va weights would miss)
    pipeline.update_components(transformer=transformer(seed), transformer_ref=transformer(seed + 1),
                               scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
                               vae=vae, audio_vae=audio_vae)
    return pipeline


def video_latent_frames(num_frames: int) -> int:
    """Latent frames of a video of `num_frames` (17n+5) frames: 5n+2, as the pipeline counts them."""
    return (num_frames - 5) // 17 * 5 + 2


def audio_latents(num_frames: int) -> int:
    """Audio latents a second of video at 24 fps holds 40 of, rounded as the pipeline rounds them."""
    return int(round(num_frames / 24 * 40))


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Video noise [B, 24, T', H/16, W/16], audio noise [B, 2, 32, L] (each sample's stereo channels as the pipeline
    takes them, one batch item each), the text encoder's hidden states [B, T, 32] and their modality tags [T] (1:
    text; the batch shares one packed layout). The model is guidance-distilled: no negative prompt."""
    gen = torch.Generator().manual_seed(seed)
    frames = num_frames if num_frames >= FRAMES else FRAMES
    tokens = text_tokens or TEXT_TOKENS
    return {"latents": torch.randn(batch, LATENT, video_latent_frames(frames), height // 16, width // 16, generator=gen),
            "audio_latents": torch.randn(batch, 2, AUDIO_LATENT, audio_latents(frames), generator=gen),
            "prompt_embeds": torch.randn(batch, tokens, TEXT_WIDTH, generator=gen),
            "text_token_tags": torch.ones(tokens, dtype=torch.long)}
