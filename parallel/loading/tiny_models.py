"""Tiny, offline, deterministic diffusers pipelines for testing the parallel engine.

Every component is built in code from seeded random weights (no model hub access), small enough that a
pipeline saves to well under 2 MB and a 4-step 64x64 run takes a fraction of a second on CPU, yet
structurally the same as the real pipelines, so multi-rank results can be compared with the
single-process pipeline. Each family assembles its tiny models from the parts here and declares them
(`Family.tiny`, parallel/families/); this module builds them by name.
"""

from __future__ import annotations

import pathlib
import string

import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    GemmaTokenizer,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from ..families import FAMILIES as _REGISTRY

HEADS, HEAD_DIM = 4, 16  # every transformer: 4 heads of 16 -> inner dim 64
BLOCKS = 4  # transformer blocks (Flux: 2 double + 2 single), so PipeFusion can use 4 stages
T5_DIM = 32  # T5 d_model = PixArt caption_channels = SD3/Flux joint_attention_dim
CLIP_DIM = 16  # CLIP hidden and projection size; SD3 pooled = 2 * CLIP_DIM, Flux pooled = CLIP_DIM
TEXT_TOKENS = 16  # make_inputs default
# Random weights give almost uniform attention, which hides sharding/ring bugs; this factor on q and k
# multiplies the logits by QK_SCALE**2 so every attention is peaked.
QK_SCALE = 4.0

# The tiny models every family declares, by name; what their pipelines need when given embeddings.
MODELS = {name: model for family in _REGISTRY for name, model in family.tiny.items()}
_WRAPPERS = {name: _REGISTRY.pipeline_wrapper(model.pipeline) for name, model in MODELS.items()}
PIPELINE_CALL_DEFAULTS: dict[str, dict] = {name: dict(wrapper.call_defaults) for name, wrapper in _WRAPPERS.items()}
IMAGE_TO_VIDEO_FAMILIES = tuple(name for name, wrapper in _WRAPPERS.items()
                                if wrapper.comfy.temporal and "image" in wrapper.tensor_inputs)
VIDEO_FAMILIES = tuple(name for name, wrapper in _WRAPPERS.items()
                       if wrapper.comfy.temporal and name not in IMAGE_TO_VIDEO_FAMILIES)
FAMILIES = tuple(name for name, wrapper in _WRAPPERS.items() if not wrapper.comfy.temporal)  # image models


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


def _byte_level_alphabet() -> list[str]:
    """The 256 characters byte-level BPE (GPT-2, Qwen) maps bytes to: printable ones as themselves."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    codes = dict(zip(printable, printable)) | {b: 256 + n for n, b in enumerate(others)}
    return [chr(codes[b]) for b in range(256)]


def _qwen_tokenizer() -> Qwen2Tokenizer:
    """Qwen's byte-level tokenizer with no merges (every byte a token) and its chat tokens (Qwen2.5-VL, Qwen3)."""
    return Qwen2Tokenizer(vocab={c: i for i, c in enumerate(_byte_level_alphabet())}, merges=[], unk_token=None,
                          bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"])


def _gemma_tokenizer() -> GemmaTokenizer:
    """Gemma's BPE with no merges: every printable ASCII character a token, and its pad / eos / bos tokens."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", *_CHARS])}
    return GemmaTokenizer(vocab=vocab, merges=[])


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


def _gemma3(seed: int, width: int, layers: int):
    """Gemma 3 (LTX-2's text encoder: the pipeline stacks its embeddings and every layer's hidden states, `layers` + 1
    of them, `width` wide) on the tiny Gemma tokenizer: heads of 16, one key/value head, and a one-layer vision tower
    of 16-pixel patches that the text path never runs."""
    tokenizer = _gemma_tokenizer()
    picture = {name: len(tokenizer) + n for n, name in enumerate(("boi_token_index", "eoi_token_index", "image_token_index"))}
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer) + len(picture), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=width // 16, num_key_value_heads=1, head_dim=16,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        mm_tokens_per_image=1, **picture)
    return tokenizer, _seeded(seed, Gemma3ForConditionalGeneration, config)


VL_TOKENS = ("vision_start", "vision_end", "image_pad", "video_pad")  # Qwen-VL's <|…|> tokens around pictures


def _vl_tokenizer() -> tuple[Qwen2Tokenizer, dict, dict]:
    """The byte-level Qwen tokenizer with Qwen-VL's vision tokens, its special token ids as a Qwen-VL config takes them,
    and the vision tokens' ids (`vision_start_token_id`, ...)."""
    tokenizer = _qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<|{name}|>" for name in VL_TOKENS]},
                                 replace_extra_special_tokens=False)
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    vision_ids = {f"{name.removesuffix('_pad')}_token_id": tokenizer.convert_tokens_to_ids(f"<|{name}|>")
                  for name in VL_TOKENS}
    return tokenizer, ids, vision_ids


def _qwen3_vl(seed: int, width: int, cls: str, layers: int = 2):
    """Qwen3-VL (`cls`: Qwen3VLModel for Krea 2, Qwen3VLForConditionalGeneration for Qwen-Image 2.1) on the byte-level
    Qwen tokenizer with Qwen3-VL's vision tokens, `width` wide, `layers` text layers (heads of 8, its multimodal
    rotary sections in proportion), and a one-block vision tower of 16-pixel patches."""
    import transformers
    from transformers import Qwen3VLConfig

    tokenizer, ids, vision_ids = _vl_tokenizer()
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=width // 8,
                         num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer), **ids,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=width,
                           deepstack_visual_indexes=[0], num_position_embeddings=64, patch_size=16),
        **vision_ids)
    return tokenizer, _seeded(seed, getattr(transformers, cls), config)


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


# ---------------------------------------------------------------------------------------------- API
def build_tiny_pipeline(family: str, *, seed: int = 0) -> DiffusionPipeline:
    """The full fp32 diffusers pipeline of tiny model `family`, with random weights fixed by `seed`."""
    pipe = _model(family).build(seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_pipeline(family: str, directory, *, seed: int = 0) -> pathlib.Path:
    """Build and save_pretrained (safetensors) so loaders can be tested with from_pretrained."""
    directory = pathlib.Path(directory)
    pipeline = build_tiny_pipeline(family, seed=seed)
    modular = {"overwrite_modular_index": True} if hasattr(pipeline, "load_components") else {}  # a ModularPipeline
    pipeline.save_pretrained(str(directory), safe_serialization=True, **modular)
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
    return _model(family).inputs(batch=batch, height=height, width=width, seed=seed, negative=negative,
                                 text_tokens=text_tokens, num_frames=num_frames)


def _model(family: str):
    if family not in MODELS:
        raise ValueError(f"unknown family {family!r}; expected one of {tuple(MODELS)}")
    return MODELS[family]


def image_inputs(*, latent_channels: int, packed: bool, pooled_dim: int | None, default_tokens: int = TEXT_TOKENS,
                 batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                 num_frames: int, scale: int = 8) -> dict[str, torch.Tensor]:
    """make_inputs for an image family (VAE factor `scale`): pooled embeddings if it has `pooled_dim`, else T5
    attention masks."""
    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or default_tokens
    h, w = height // scale, width // scale
    if packed:
        latent_shape = (batch, (h // 2) * (w // 2), 4 * latent_channels)
    else:
        latent_shape = (batch, latent_channels, h, w)
    out = {"latents": torch.randn(latent_shape, generator=gen)}
    for offset, prefix in enumerate(("", "negative_") if negative else ("",)):
        out[prefix + "prompt_embeds"] = torch.randn(batch, tokens, T5_DIM, generator=gen)
        if pooled_dim is not None:
            out[prefix + "pooled_prompt_embeds"] = torch.randn(batch, pooled_dim, generator=gen)
        else:  # valid lengths in [tokens/4, tokens-1], distinct per sample and between positive and negative
            span = max(1, tokens - 1 - tokens // 4)
            valid = (tokens - 2 - (torch.arange(batch) + 3 * offset) % span).clamp(min=1)
            out[prefix + "prompt_attention_mask"] = (torch.arange(tokens) < valid[:, None]).long()
    return out
