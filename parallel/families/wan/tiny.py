"""Wan's tiny built-in models (random weights, offline tokenizers) for tests and the demo."""

from __future__ import annotations

import torch

from ..base import TinyModel


# -- tiny built-in models --------------------------------------------------------------------------------
# `wan`:      Wan 2.1 T2V style: one transformer, UMT5 text encoder, AutoencoderKLWan (16 latent channels,
#             ×8 spatial and ×4 temporal compression), UniPC with flow sigmas (the real checkpoints' scheduler).
# `wan22`:    Wan 2.2 T2V A14B style: the same, plus a second low-noise expert `transformer_2` that takes
#             over below `boundary_ratio` × 1000 timesteps.
# `wan22-5b`: Wan 2.2 TI2V 5B style: one transformer on 48 latent channels from a ×16 VAE, with one
#             timestep per token (`expand_timesteps`).
# `wan22-i2v`: Wan 2.2 I2V A14B style (WanImageToVideoPipeline): two experts whose input is the noise,
#             a frame mask and the VAE-encoded first frame (16 + 4 + 16 = 36 channels); no CLIP image encoder.
TINY_CHANNELS, TINY_CHANNELS_5B = 16, 48
BOUNDARY_RATIO = 0.875  # Wan 2.2 T2V A14B: the high-noise expert runs while t >= 875
I2V_BOUNDARY_RATIO = 0.9  # Wan 2.2 I2V A14B
FLOW_SHIFT = 3.0  # Wan 2.1 480p
# ComfyUI's Wan22 latent format (comfy/latent_formats.py), as the real Wan 2.2 VAE config has it.
WAN22_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]


def tiny_umt5(seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    from ...loading import tiny_models as tm

    tok = tm._t5_tokenizer()
    cfg = UMT5Config(vocab_size=len(tok), d_model=tm.T5_DIM, d_kv=8, d_ff=tm.T5_DIM, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=32,
                     feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return tok, tm._seeded(seed, UMT5EncoderModel, cfg)


def tiny_vae(seed: int, wan22: bool = False):
    """Wan 2.1: 3 downsamples (×8), two of them temporal (×4); latents_mean/std default to Wan 2.1's.
    Wan 2.2's residual VAE: 2×2 pixel patches, then ×8 → ×16 spatial, ×4 temporal, 48 channels."""
    from diffusers import AutoencoderKLWan

    from ...loading import tiny_models as tm

    if not wan22:
        return tm._seeded(seed, AutoencoderKLWan, base_dim=8, z_dim=TINY_CHANNELS, dim_mult=[1, 1, 1, 1],
                          num_res_blocks=1, temperal_downsample=[False, True, True])
    return tm._seeded(seed, AutoencoderKLWan, base_dim=8, decoder_base_dim=8, z_dim=TINY_CHANNELS_5B,
                      dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                      is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                      latents_mean=WAN22_MEAN, latents_std=WAN22_STD)


def _tiny_transformer(seed: int, in_channels: int = TINY_CHANNELS, out_channels: int = TINY_CHANNELS):
    from diffusers import WanTransformer3DModel

    from ...loading import tiny_models as tm

    return tm._transformer(seed, WanTransformer3DModel, patch_size=(1, 2, 2), in_channels=in_channels,
                           out_channels=out_channels, text_dim=tm.T5_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
                           cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64)


def tiny_scheduler():
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=FLOW_SHIFT,
                                   num_train_timesteps=1000)


def _tiny(model: str) -> TinyModel:
    def build(seed: int):
        from diffusers import WanImageToVideoPipeline, WanPipeline

        tok, umt5 = tiny_umt5(seed + 1)
        if model == "wan22-5b":
            return WanPipeline(tokenizer=tok, text_encoder=umt5, vae=tiny_vae(seed + 2, wan22=True),
                               scheduler=tiny_scheduler(), expand_timesteps=True,
                               transformer=_tiny_transformer(seed, TINY_CHANNELS_5B, TINY_CHANNELS_5B))
        if model == "wan22-i2v":
            condition = TINY_CHANNELS + 4 + TINY_CHANNELS  # noise, first-frame mask (4 frames per latent), image
            return WanImageToVideoPipeline(
                tokenizer=tok, text_encoder=umt5, vae=tiny_vae(seed + 2), scheduler=tiny_scheduler(),
                transformer=_tiny_transformer(seed, condition), transformer_2=_tiny_transformer(seed + 3, condition),
                boundary_ratio=I2V_BOUNDARY_RATIO,
            )
        two_experts = model == "wan22"
        return WanPipeline(
            tokenizer=tok, text_encoder=umt5, vae=tiny_vae(seed + 2), scheduler=tiny_scheduler(),
            transformer=_tiny_transformer(seed),
            transformer_2=_tiny_transformer(seed + 3) if two_experts else None,
            boundary_ratio=BOUNDARY_RATIO if two_experts else None,
        )

    def inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
               num_frames: int) -> dict[str, torch.Tensor]:
        """Image-to-video also gets `image`: one first frame [1, 3, H, W] in [0, 1] (the pipeline repeats it
        over the batch; one image per sample is not what WanImageToVideoPipeline supports)."""
        from ...loading import tiny_models as tm

        gen = torch.Generator().manual_seed(seed)
        channels, scale = (TINY_CHANNELS_5B, 16) if model == "wan22-5b" else (TINY_CHANNELS, 8)
        shape = (batch, channels, (num_frames - 1) // 4 + 1, height // scale, width // scale)
        out = {"latents": torch.randn(shape, generator=gen)}
        if model == "wan22-i2v":
            out["image"] = torch.rand(1, 3, height, width, generator=gen)
        tokens = text_tokens or tm.TEXT_TOKENS
        for prefix in ("", "negative_") if negative else ("",):
            # As UMT5 prompts arrive: real tokens, then zeros up to the padded length.
            embeds = torch.randn(batch, tokens, tm.T5_DIM, generator=gen)
            embeds[:, tokens * 3 // 4 :] = 0
            out[prefix + "prompt_embeds"] = embeds
        return out

    return TinyModel("WanImageToVideoPipeline" if model == "wan22-i2v" else "WanPipeline", build, inputs)
