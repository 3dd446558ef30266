"""Tiny, offline, deterministic diffusers pipelines for testing the parallel engine.

Every component is built in code from seeded random weights (no model hub access), small enough that a
pipeline saves to well under 2 MB and a 4-step 64x64 run takes a fraction of a second on CPU, yet
structurally the same as the real PixArt-alpha/Sigma, SD3 and Flux.1-dev pipelines, so multi-rank results
can be compared with the single-process pipeline.
"""

from __future__ import annotations

import pathlib
import string

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    PixArtAlphaPipeline,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

FAMILIES = ("pixart-alpha", "pixart-sigma", "sd3", "flux")  # flux = Flux.1-dev style (guidance_embeds=True)
# Wan 2.1 T2V, Wan 2.2 T2V A14B (two experts), Wan 2.2 TI2V 5B (48 channels): built in tiny_wan.py
VIDEO_FAMILIES = ("wan", "wan22", "wan22-5b")
IMAGE_TO_VIDEO_FAMILIES = ("wan22-i2v",)  # Wan 2.2 I2V A14B: WanImageToVideoPipeline, takes an `image`

HEADS, HEAD_DIM = 4, 16  # every transformer: 4 heads of 16 -> inner dim 64
BLOCKS = 4  # transformer blocks (Flux: 2 double + 2 single), so PipeFusion can use 4 stages
T5_DIM = 32  # T5 d_model = PixArt caption_channels = SD3/Flux joint_attention_dim
CLIP_DIM = 16  # CLIP hidden and projection size; SD3 pooled = 2 * CLIP_DIM, Flux pooled = CLIP_DIM
POOLED_DIM = {"sd3": 2 * CLIP_DIM, "flux": CLIP_DIM}
LATENT_CHANNELS = {"pixart-alpha": 4, "pixart-sigma": 4, "sd3": 16, "flux": 16}
TEXT_TOKENS = {"pixart-alpha": 16, "pixart-sigma": 16, "sd3": 24, "flux": 16}  # make_inputs default
# Random weights give almost uniform attention, which hides sharding/ring bugs; this factor on q and k
# multiplies the logits by QK_SCALE**2 so every attention is peaked.
QK_SCALE = 4.0

PIPELINE_CALL_DEFAULTS: dict[str, dict] = {
    # Resolution binning would resize 64x64 to a trained aspect bucket; negative_prompt must be None when
    # negative_prompt_embeds are passed (the pipeline's default is "").
    "pixart-alpha": {"use_resolution_binning": False, "negative_prompt": None},
    "pixart-sigma": {"use_resolution_binning": False, "negative_prompt": None},
    "sd3": {},
    # Flux.1-dev is guidance-distilled: negatives are only used when the caller sets true_cfg_scale > 1.
    "flux": {},
    "wan": {},
    "wan22": {},
    "wan22-5b": {},
    "wan22-i2v": {},
}


def _seeded(seed: int, factory, *args, **kwargs):
    """Build a module under its own seed without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(*args, **kwargs).eval()


# ----------------------------------------------------------------------------------------- tokenizers
_WORDS = "a an the of and with in on cat dog photo painting red blue green forest city sky astronaut horse".split()
_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation


def _t5_tokenizer() -> T5Tokenizer:
    """Unigram vocab built in memory: whole words win over single characters, any ASCII text encodes."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in _WORDS]
    vocab += [(p + c, -8.0) for p in ("\u2581", "") for c in _CHARS]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def _clip_tokenizer() -> CLIPTokenizer:
    """Character-level byte-BPE vocab (printable ASCII, lowercased by CLIP's normalizer) plus word merges."""
    chars = string.ascii_lowercase + string.digits + string.punctuation
    tokens = ["<|startoftext|>", "<|endoftext|>"] + list(chars) + [c + "</w>" for c in chars]
    merges = []
    for word in _WORDS:  # merge left to right: "c"+"a" -> "ca", "ca"+"t</w>" -> "cat</w>"
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        for piece in pieces[1:]:
            merges.append((pieces[0], piece))
            pieces[0] += piece
            tokens.append(pieces[0])
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=list(dict.fromkeys(merges)), model_max_length=77)


# ------------------------------------------------------------------------------------- text encoders
def _t5(seed: int):
    tok = _t5_tokenizer()
    cfg = T5Config(vocab_size=len(tok), d_model=T5_DIM, d_kv=8, d_ff=T5_DIM, num_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return tok, _seeded(seed, T5EncoderModel, cfg)


def _clip(seed: int, with_projection: bool):
    tok = _clip_tokenizer()
    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=CLIP_DIM, intermediate_size=2 * CLIP_DIM,
                         projection_dim=CLIP_DIM, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                         hidden_act="gelu")
    return tok, _seeded(seed, CLIPTextModelWithProjection if with_projection else CLIPTextModel, cfg)


# ---------------------------------------------------------------------------------------------- VAE
def _vae(seed: int, latent_channels: int, scaling_factor: float, shift_factor: float | None = None):
    """4 block levels -> vae_scale_factor 8; SD3/Flux VAEs (shift_factor set) have no quant convs."""
    quant = shift_factor is None
    return _seeded(seed, AutoencoderKL, in_channels=3, out_channels=3, block_out_channels=(8, 8, 8, 8),
                   down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                   layers_per_block=1, norm_num_groups=4, latent_channels=latent_channels, sample_size=64,
                   scaling_factor=scaling_factor, shift_factor=shift_factor,
                   use_quant_conv=quant, use_post_quant_conv=quant)


# ---------------------------------------------------------------------------------------- transformers
_QK_PAIRS = (("to_q", "norm_q"), ("to_k", "norm_k"), ("add_q_proj", "norm_added_q"), ("add_k_proj", "norm_added_k"))


@torch.no_grad()
def _peak_attention(transformer: torch.nn.Module, factor: float):
    """Scale every attention's q and k by `factor` (logits by factor**2) so attention is peaked.

    Where an affine q/k RMSNorm follows the projection (Flux), the norm would undo a scaled projection,
    so its weight is scaled instead.
    """
    for module in transformer.modules():
        for proj, norm in _QK_PAIRS:
            target = getattr(module, norm, None)
            if getattr(target, "weight", None) is None:
                target = getattr(module, proj, None)
            if target is not None:
                for param in target.parameters(recurse=False):
                    param.mul_(factor)
    return transformer


def _transformer(seed: int, cls, **config):
    model = _seeded(seed, cls, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, **config)
    return _peak_attention(model, QK_SCALE)


def _build_pixart(family: str, seed: int) -> DiffusionPipeline:
    tok, t5 = _t5(seed + 1)
    # out_channels = 2 * in_channels: learned sigma, as in the real checkpoints (the pipeline drops it).
    transformer = _transformer(seed, PixArtTransformer2DModel, in_channels=4, out_channels=8, num_layers=BLOCKS,
                               sample_size=8, patch_size=2, cross_attention_dim=HEADS * HEAD_DIM,
                               caption_channels=T5_DIM, norm_num_groups=4, use_additional_conditions=False)
    alpha = family == "pixart-alpha"
    vae = _vae(seed + 2, 4, 0.18215 if alpha else 0.13025)
    # An untrained epsilon-prediction PixArt blows latents up ~100-200x; v-prediction keeps them O(1).
    scheduler = DPMSolverMultistepScheduler(prediction_type="v_prediction")
    cls = PixArtAlphaPipeline if alpha else PixArtSigmaPipeline
    return cls(tokenizer=tok, text_encoder=t5, vae=vae, transformer=transformer, scheduler=scheduler)


def _build_sd3(seed: int) -> DiffusionPipeline:
    (tok1, clip1), (tok2, clip2) = _clip(seed + 1, True), _clip(seed + 2, True)
    tok3, t5 = _t5(seed + 3)
    transformer = _transformer(seed, SD3Transformer2DModel, sample_size=8, patch_size=2, in_channels=16,
                               out_channels=16, num_layers=BLOCKS, joint_attention_dim=T5_DIM,
                               caption_projection_dim=HEADS * HEAD_DIM, pooled_projection_dim=POOLED_DIM["sd3"],
                               pos_embed_max_size=16)  # 16x16 patches: images up to 256x256
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(seed + 4, 16, 1.5305, 0.0609), text_encoder=clip1, tokenizer=tok1,
        text_encoder_2=clip2, tokenizer_2=tok2, text_encoder_3=t5, tokenizer_3=tok3)


def _build_flux(seed: int) -> DiffusionPipeline:
    tok, clip = _clip(seed + 1, False)
    tok2, t5 = _t5(seed + 2)
    transformer = _transformer(seed, FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=BLOCKS // 2,
                               num_single_layers=BLOCKS // 2, joint_attention_dim=T5_DIM,
                               pooled_projection_dim=POOLED_DIM["flux"], guidance_embeds=True,
                               axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    return FluxPipeline(scheduler=scheduler, vae=_vae(seed + 3, 16, 0.3611, 0.1159), text_encoder=clip,
                        tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok2, transformer=transformer)


# ---------------------------------------------------------------------------------------------- API
def build_tiny_pipeline(family: str, *, seed: int = 0) -> DiffusionPipeline:
    """The full fp32 diffusers pipeline of `family`, with random weights fixed by `seed`."""
    known = FAMILIES + VIDEO_FAMILIES + IMAGE_TO_VIDEO_FAMILIES
    if family not in known:
        raise ValueError(f"unknown family {family!r}; expected one of {known}")
    if family in VIDEO_FAMILIES + IMAGE_TO_VIDEO_FAMILIES:
        from .tiny_wan import build_wan

        pipe = build_wan(family, seed)
    elif family == "sd3":
        pipe = _build_sd3(seed)
    elif family == "flux":
        pipe = _build_flux(seed)
    else:
        pipe = _build_pixart(family, seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_pipeline(family: str, directory, *, seed: int = 0) -> pathlib.Path:
    """Build and save_pretrained (safetensors) so loaders can be tested with from_pretrained."""
    directory = pathlib.Path(directory)
    build_tiny_pipeline(family, seed=seed).save_pretrained(directory, safe_serialization=True)
    return directory


def make_inputs(family: str, *, batch: int = 1, height: int = 64, width: int = 64, seed: int = 0,
                negative: bool = True, text_tokens: int | None = None, num_frames: int = 5) -> dict[str, torch.Tensor]:
    """Tensor kwargs of the pipeline's __call__ as if the prompts had been encoded (no text encoders run).

    `latents` has the shape prepare_latents accepts as-is (Flux: packed 2x2 patches). PixArt masks end in
    zeros, with a different valid length per sample and for the negative, so wrong masking shows up.
    negative=False is for runs without classifier-free guidance (guidance_scale <= 1; Flux: true_cfg_scale 1):
    with guidance the pipeline would encode an empty negative prompt at its own token count.
    Video families (Wan) take `num_frames` and get 5-D latents [B, C, (num_frames - 1) // 4 + 1, H/8, W/8]
    (wan22-5b: 48 channels, H/16 × W/16); image-to-video also gets `image`.
    """
    if family in VIDEO_FAMILIES + IMAGE_TO_VIDEO_FAMILIES:
        from .tiny_wan import make_video_inputs

        return make_video_inputs(family, batch, height, width, num_frames, seed, negative, text_tokens)
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or TEXT_TOKENS[family]
    h, w = height // 8, width // 8
    if family == "flux":
        latent_shape = (batch, (h // 2) * (w // 2), 4 * LATENT_CHANNELS[family])
    else:
        latent_shape = (batch, LATENT_CHANNELS[family], h, w)
    out = {"latents": torch.randn(latent_shape, generator=gen)}
    for offset, prefix in enumerate(("", "negative_") if negative else ("",)):
        out[prefix + "prompt_embeds"] = torch.randn(batch, tokens, T5_DIM, generator=gen)
        if family in POOLED_DIM:
            out[prefix + "pooled_prompt_embeds"] = torch.randn(batch, POOLED_DIM[family], generator=gen)
        else:  # valid lengths in [tokens/4, tokens-1], distinct per sample and between positive and negative
            span = max(1, tokens - 1 - tokens // 4)
            valid = (tokens - 2 - (torch.arange(batch) + 3 * offset) % span).clamp(min=1)
            out[prefix + "prompt_attention_mask"] = (torch.arange(tokens) < valid[:, None]).long()
    return out
