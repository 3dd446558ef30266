"""Tiny, offline Wan video pipelines (see tiny_models.py for the image families and the shared parts).

`wan`:   Wan 2.1 T2V style: one transformer, UMT5 text encoder, AutoencoderKLWan (16 latent channels,
         ×8 spatial and ×4 temporal compression), UniPC with flow sigmas (the real checkpoints' scheduler).
`wan22`: Wan 2.2 T2V A14B style: the same, plus a second low-noise expert `transformer_2` that takes
         over below `boundary_ratio` × 1000 timesteps.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from . import tiny_models as tm

VIDEO_FAMILIES = ("wan", "wan22")
LATENT_CHANNELS = 16
TEXT_TOKENS = 16  # make_inputs default; a text prompt encodes to 512 tokens, as in WanPipeline
NUM_FRAMES = 5  # make_inputs default: 2 latent frames
BOUNDARY_RATIO = 0.875  # Wan 2.2 T2V A14B: the high-noise expert runs while t >= 875
FLOW_SHIFT = 3.0  # Wan 2.1 480p


def latent_frames(num_frames: int) -> int:
    return (num_frames - 1) // 4 + 1


def _umt5(seed: int):
    tok = tm._t5_tokenizer()
    cfg = UMT5Config(vocab_size=len(tok), d_model=tm.T5_DIM, d_kv=8, d_ff=tm.T5_DIM, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=32,
                     feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return tok, tm._seeded(seed, UMT5EncoderModel, cfg)


def _wan_vae(seed: int):
    """3 downsamples (×8), two of them temporal (×4); latents_mean/std default to Wan 2.1's."""
    return tm._seeded(seed, AutoencoderKLWan, base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1],
                      num_res_blocks=1, temperal_downsample=[False, True, True])


def _wan_transformer(seed: int):
    return tm._transformer(seed, WanTransformer3DModel, patch_size=(1, 2, 2), in_channels=LATENT_CHANNELS,
                           out_channels=LATENT_CHANNELS, text_dim=tm.T5_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
                           cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64)


def scheduler() -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=FLOW_SHIFT,
                                   num_train_timesteps=1000)


def build_wan(family: str, seed: int) -> WanPipeline:
    tok, umt5 = _umt5(seed + 1)
    two_experts = family == "wan22"
    return WanPipeline(
        tokenizer=tok, text_encoder=umt5, vae=_wan_vae(seed + 2), scheduler=scheduler(),
        transformer=_wan_transformer(seed),
        transformer_2=_wan_transformer(seed + 3) if two_experts else None,
        boundary_ratio=BOUNDARY_RATIO if two_experts else None,
    )


def make_video_inputs(batch: int, height: int, width: int, num_frames: int, seed: int, negative: bool,
                      text_tokens: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, LATENT_CHANNELS, latent_frames(num_frames), height // 8, width // 8)
    out = {"latents": torch.randn(shape, generator=gen)}
    for prefix in ("", "negative_") if negative else ("",):
        # As UMT5 prompts arrive: real tokens, then zeros up to the padded length.
        embeds = torch.randn(batch, text_tokens or TEXT_TOKENS, tm.T5_DIM, generator=gen)
        embeds[:, (text_tokens or TEXT_TOKENS) * 3 // 4 :] = 0
        out[prefix + "prompt_embeds"] = embeds
    return out
