"""HunyuanVideo 1.5 text- and image-to-video (`HunyuanVideo15Pipeline`, `HunyuanVideo15ImageToVideoPipeline`): 5-D
latents [B, 32, T', H/16, W/16], one token per latent pixel of each latent frame, Qwen2.5-VL text (an LLM hidden
layer) and byT5 glyph text, CFG in the pipeline's guider.

The transformer joins three text streams (LLM tokens, byT5 glyph tokens, and 729 vision tokens that text-to-video
zeroes and masks) and orders each sample's valid tokens first, padding last; its joint attention then runs
[video; text] under a query-and-key mask. The plan splits the patch-embedded video tokens and their rotary table
(cos, sin) where they are made, gathers at proj_out, and trims the text padding before every block (TextPadding:
exact, the padding is masked as keys and never read), so the mask left is all true and USP runs without one. The
text is replicated after the video shard (suffix). Token counts rarely divide by the degree: the split is uneven.

CFG: the guider calls the transformer once per branch, in cache_context("pred_cond") and ("pred_uncond"); its
guidance scale is the guider's, set from the call's `guidance_scale` for that call (1: one branch).
The pipeline takes no step callback: progress, previews and cancel come from the scheduler's steps.

Image-to-video concatenates the start image's VAE latents (first latent frame) and a frame mask to the noise, and
its SigLIP vision tokens fill the 729 vision slots, valid this time: the same plan serves both.

PipeFusion: the blocks form a pipeline like SD3's (video and text carried, the text a patch of its own); a
patch is whole token rows of the (frames × rows × columns) sequence, and the rotary table is sliced with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from ..call_parameters import CallParameter
from ..layout.config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline.img2img import linear_sigmas
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, PipeFusionPlan, Split, TextPadding, TokenRows
from .base import FAMILIES, Family, TinyModel, pictures, replaced
from .comfy_data import ComfyData, DeclaredLatentFormat
from .hunyuanvideo15_file import SINGLE_FILE
from .wan import xFuserWanPipeline
from .wan.pipelines import vae_encodes_as

DEFAULT_FRAMES = 121  # HunyuanVideo15Pipeline.__call__'s default num_frames
MASKS = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask",
         "prompt_embeds_2": "prompt_embeds_mask_2", "negative_prompt_embeds_2": "negative_prompt_embeds_mask_2"}


# ComfyUI keeps HunyuanVideo 1.5 latents as its VAE makes them; the pipeline's are scaled by the VAE's scaling_factor
# (it divides by it before decoding). ComfyUI 0.3.64 has no such format: declared here, without preview factors.
COMFY_HUNYUAN_VIDEO_15 = DeclaredLatentFormat(
    channels=32, spatial=16, dimensions=3, scale_factor=1.03682,
    source="HunyuanVideo-1.5's VAE (diffusers' AutoencoderKLHunyuanVideo15 config: scaling_factor 1.03682, ×16, 32 "
           "channels); the pipeline's decode divides by it",
)


class xFuserHunyuanVideo15Pipeline(xFuserWanPipeline):
    """Wan's video shapes (latent frames from the latents or num_frames, 4k + 1), with this model's patches, text
    streams and guider."""

    default_sigmas = staticmethod(linear_sigmas)

    comfy = ComfyData(
        latent_formats={32: "HunyuanVideo15"}, temporal=4,
        declared_formats={"HunyuanVideo15": COMFY_HUNYUAN_VIDEO_15},
        expects="encode with xDiT Text Encode on this pool (its Qwen2.5-VL and byT5 encoders), or on ComfyUI 0.33 with "
                "its CLIPLoader type hunyuan_video_15 (Qwen2.5-VL 7B, 3584 wide; byT5 glyph text 1472 wide)",
        empty_latent="EmptyHunyuanVideo15Latent (ComfyUI 0.33), or xDiT Empty Latent on a ComfyUI without it: 32 "
                     "channels at 1/16 size",
        text_masks=MASKS, conditioning_keys={"conditioning_byt5small": "prompt_embeds_2"},
        optional_texts=("prompt_embeds_2",), model_class="HunyuanVideo15",
        # ComfyUI's model passes its pooled output (y) and a guidance value, which this model does not use
        model_call_conds={"context": "prompt_embeds", "attention_mask": "prompt_embeds_mask", "txt_byt5": "prompt_embeds_2",
                          "clip_fea": "image_embeds", "y": "", "guidance": ""},
    )
    tensor_inputs = tuple(MASKS.values()) + ("prompt_embeds_2", "negative_prompt_embeds_2")
    embedding_sizes = {"prompt_embeds": "text_embed_dim", "negative_prompt_embeds": "text_embed_dim",
                       "prompt_embeds_2": "text_embed_2_dim", "negative_prompt_embeds_2": "text_embed_2_dim"}
    call_parameters = {
        "num_frames": CallParameter(int, "video frames, 4k+1 (default: as many as the latents hold)", 1, 10_000),
    }

    model_call_inputs = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "image_embeds")
    model_call_required = ("prompt_embeds",)

    def model_call_arguments(self, latents, timestep, inputs):
        """The pipelines' transformer call: the latents with ComfyUI's condition and mask channels (65), the LLM text
        (all valid without a mask), the glyph text (one masked token without one, as ComfyUI leaves it out), the
        vision tokens (zeros without them, which the transformer masks, as ComfyUI leaves them out)."""
        config, embeds = self._config(), inputs["prompt_embeds"]
        batch, mask = len(embeds), inputs.get("prompt_embeds_mask")
        glyph, image = inputs.get("prompt_embeds_2"), inputs.get("image_embeds")
        return {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": embeds,
                "encoder_attention_mask": embeds.new_ones(embeds.shape[:2]) if mask is None else mask,
                "encoder_hidden_states_2": embeds.new_zeros(batch, 1, config.text_embed_2_dim) if glyph is None else glyph,
                "encoder_attention_mask_2": embeds.new_zeros(batch, 1) if glyph is None else glyph.new_ones(glyph.shape[:2]),
                "image_embeds": embeds.new_zeros(batch, 1, config.image_embed_dim) if image is None else image}

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask, embeds_2, mask_2 = self.module.encode_prompt(prompt, device=self.module.transformer.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": embeds_2,
                "prompt_embeds_mask_2": mask_2}

    # -- shapes: one token per latent pixel (patch 1 × 1 × 1 in the released models) ----------------------
    def _patches(self) -> tuple[int, int]:
        config = self.module.transformer.config
        return config.patch_size_t, config.patch_size

    def image_tokens(self, height: int, width: int) -> int:
        patch = self._patches()[1]
        return self.grid_tokens(height, width, self.module.vae_scale_factor_spatial, patch, patch)

    def token_rows(self, kwargs: dict[str, Any]) -> int:
        patch_t, patch = self._patches()
        return self.latent_frames(kwargs) // patch_t * (kwargs["height"] // (self.module.vae_scale_factor_spatial * patch))

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        return self.latent_frames(kwargs) // self._patches()[0] * self.image_tokens(kwargs["height"], kwargs["width"])

    def latent_frames(self, kwargs: dict[str, Any]) -> int:
        if kwargs.get("num_frames") is None and not isinstance(kwargs.get("latents"), torch.Tensor):
            kwargs = {**kwargs, "num_frames": DEFAULT_FRAMES}
        return super().latent_frames(kwargs)

    def expected_latents_shape(self, batch: int, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        scale = self.module.vae_scale_factor_spatial
        return (batch, self.module.transformer.config.out_channels, frames, height // scale, width // scale)

    # -- guidance: the guider's ------------------------------------------------------------------------
    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        return self._guidance(kwargs) > 1.0

    def _guidance(self, kwargs: dict[str, Any]) -> float:
        return float(kwargs.get("guidance_scale", self.module.guider.guidance_scale))

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return (f"CFG parallel on HunyuanVideo 1.5 needs guidance_scale above 1 (got {self._guidance(kwargs)}) and "
                "negative prompt embeddings; add both or turn CFG parallel off.")

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        if self.uses_cfg(kwargs) and kwargs.get("negative_prompt_embeds") is None and kwargs.get("prompt_embeds") is not None:
            raise ValueError(f"guidance_scale {self._guidance(kwargs)} guides with a negative prompt: send "
                             "negative_prompt_embeds (and their masks), or set guidance_scale to 1")
        for embeds, mask in MASKS.items():
            if kwargs.get(embeds) is not None and kwargs.get(mask) is None:
                raise ValueError(f"{embeds} needs {mask} ([batch, tokens], 1 for each valid token)")
        super().check_inputs(kwargs, batch)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        c = self.parallel_config
        if c.sp_degree > 1 or c.pipefusion_degree > 1:
            for prefix in ("", "negative_"):
                lengths = self._text_lengths(kwargs, prefix)
                parts = torch.arange(batch).split(c.batch_split(batch) or [batch])  # each data-parallel rank's samples
                if lengths is not None and any(len({lengths[i] for i in part.tolist()}) > 1 for part in parts):
                    raise LayoutError("the samples of this batch have texts of different lengths, which HunyuanVideo 1.5 "
                                      "masks; sequence-parallel and PipeFusion attention take no mask: send one prompt "
                                      "per job, or prompts of one token length")
        return super().check_layout(kwargs, batch)

    @staticmethod
    def _text_lengths(kwargs: dict[str, Any], prefix: str) -> list[int] | None:
        """Each sample's valid text tokens (LLM and glyph; text-to-video's vision tokens are all masked)."""
        masks = [kwargs.get(f"{prefix}{name}") for name in ("prompt_embeds_mask", "prompt_embeds_mask_2")]
        if any(not isinstance(mask, torch.Tensor) for mask in masks):
            return None
        return (masks[0].bool().sum(1) + masks[1].bool().sum(1)).tolist()

    @contextlib.contextmanager
    def call_context(self, kwargs: dict[str, Any]):
        """The call's guidance_scale, which the pipeline does not take, set on its guider for the call."""
        guider = self.module.guider
        before = guider.guidance_scale
        guider.guidance_scale = self._guidance(kwargs)
        kwargs.pop("guidance_scale", None)
        try:
            yield
        finally:
            guider.guidance_scale = before


class xFuserHunyuanVideo15ImageToVideoPipeline(xFuserHunyuanVideo15Pipeline):
    """Image-to-video: `image`, the start frame, [1, 3, H, W] in [0, 1] (the pipeline repeats it over the batch).

    The pipeline takes one PIL image and sizes the video from it (the bucket nearest its aspect ratio around the
    transformer's target_size); here the video is the requested height × width, and the pipeline's own crop-resize
    fits the image to it. The image goes in as the 8-bit picture it is (ComfyUI's images come from 8-bit files):
    an image whose own bucket is height × width gives exactly what diffusers gives for it.

    Or the start frame as ComfyUI's HunyuanVideo15ImageToVideo hands it over: `image_latents`, its VAE's encoding of
    the start image in the VAE's own space, [B, 32, T', h, w] with the frames after the first zero (the pipeline's
    VAE encode answers with the first frame; the pipeline scales it and masks the frames as its own), and
    `image_embeds`, the start image's SigLIP vision tokens [1, tokens, width] (ComfyUI's CLIPVisionEncode); without
    them the vision tokens are zeros, which the transformer masks, as ComfyUI's own model leaves them out.
    """

    tensor_inputs = xFuserHunyuanVideo15Pipeline.tensor_inputs + ("image", "image_latents", "image_embeds")
    comfy = dataclasses.replace(xFuserHunyuanVideo15Pipeline.comfy, concat_latents="image_latents",
                                image_to_video_node="HunyuanVideo15ImageToVideo", clip_vision="image_embeds",
                                clip_vision_state="last_hidden_state", clip_vision_required=False)

    def input_widths(self) -> dict[str, int]:
        return {**super().input_widths(), "image_embeds": int(self.module.transformer.config.image_embed_dim)}

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        image, given, embeds = kwargs.get("image"), kwargs.get("image_latents"), kwargs.get("image_embeds")
        if image is None and given is None:
            raise ValueError("HunyuanVideo15ImageToVideoPipeline needs `image`, the first frame to animate: "
                             "[1, 3, H, W] in [0, 1], or `image_latents`, its VAE encoding")
        if image is not None and (not isinstance(image, torch.Tensor) or image.ndim != 4 or tuple(image.shape[:2]) != (1, 3)):
            raise ValueError(f"image has shape {list(getattr(image, 'shape', []))}; HunyuanVideo 1.5 image-to-video "
                             "takes one RGB start frame, [1, 3, H, W] in [0, 1]")
        if given is not None:
            scale = self.module.vae_scale_factor_spatial
            expected = (self.module.vae.config.latent_channels, self.latent_frames(kwargs),
                        kwargs["height"] // scale, kwargs["width"] // scale)
            if given.ndim != 5 or tuple(given.shape[1:]) != expected or given.shape[0] not in (1, batch):
                raise ValueError(f"image_latents have shape {list(given.shape)} but this video needs {[batch, *expected]} "
                                 "(the VAE encoding of the start image, the frames after it zero)")
            if not (given[:1] == given).all() or given[:, :, 1:].any():
                raise ValueError("image_latents must encode one start image (the first latent frame), the same for "
                                 "every sample, the frames after it zero")
        width = int(self.module.transformer.config.image_embed_dim)
        if embeds is not None and (embeds.ndim != 3 or embeds.shape[0] != 1 or embeds.shape[-1] != width):
            raise ValueError(f"image_embeds have shape {list(embeds.shape)}; HunyuanVideo 1.5 takes one image's SigLIP "
                             f"vision tokens, [1, tokens, {width}]")
        super().check_inputs(kwargs, batch)

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        if kwargs.get("image_latents") is not None and kwargs.get("image") is None:  # stands in for the encoded image
            kwargs = {**kwargs, "image": torch.zeros(1, 3, kwargs["height"], kwargs["width"])}
        return super().prepare(kwargs, check_layout)

    def call_context(self, kwargs: dict[str, Any]):
        height, width = kwargs.pop("height"), kwargs.pop("width")  # the pipeline sizes the video from its image
        given, embeds = kwargs.pop("image_latents", None), kwargs.pop("image_embeds", None)
        kwargs["image"] = pictures(kwargs["image"])[0]
        stack = contextlib.ExitStack()
        stack.enter_context(replaced(self.module.video_processor, "calculate_default_height_width",
                                      lambda **_: (height, width)))
        if given is not None:
            stack.enter_context(vae_encodes_as(self.module.vae, given[:1, :, :1]))
            if embeds is None:  # no vision features: zeros, which the transformer masks
                embeds = torch.zeros(1, 1, int(self.module.transformer.config.image_embed_dim))
        if embeds is not None:
            stack.enter_context(replaced(self.module, "_get_image_embeds", lambda **_: embeds))
        stack.enter_context(super().call_context(kwargs))
        return stack


# -- tiny built-in model ----------------------------------------------------------------------------------
TEXT_WIDTH, GLYPH_WIDTH, VISION_WIDTH, LATENT = 32, 16, 16, 32


def build_tiny(seed: int, image_to_video: bool = False):
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import (ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, SiglipImageProcessor,
                              SiglipVisionConfig, SiglipVisionModel, T5Config, T5EncoderModel)

    from ..loading import tiny_models as tm

    transformer = tm._transformer(seed, HunyuanVideo15Transformer3DModel, in_channels=2 * LATENT + 1, out_channels=LATENT,
                                  num_layers=tm.BLOCKS, num_refiner_layers=1, mlp_ratio=2.0,
                                  text_embed_dim=TEXT_WIDTH, text_embed_2_dim=GLYPH_WIDTH, image_embed_dim=VISION_WIDTH,
                                  rope_axes_dim=(4, 6, 6), target_size=64, task_type="i2v" if image_to_video else "t2v")
    # image-to-video also encodes: the widths grow as the real VAE's (1/16 of them) to its 2 × 32 output channels
    widths = (8, 16, 32, 2 * LATENT, 2 * LATENT) if image_to_video else (8, 8, 8, 8, 8)
    vae = tm._seeded(seed + 3, AutoencoderKLHunyuanVideo15, latent_channels=LATENT, block_out_channels=widths,
                     layers_per_block=1)
    tokenizer = tm._qwen_tokenizer()
    tokenizer.chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    half = TEXT_WIDTH // 2 // 2
    text_encoder = tm._seeded(seed + 1, Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig(
        hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8]}))
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = tm._seeded(seed + 2, T5EncoderModel, T5Config(
        vocab_size=len(tokenizer_2), d_model=GLYPH_WIDTH, d_kv=8, d_ff=GLYPH_WIDTH, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    components = dict(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                      scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2,
                      tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=6.0))
    if not image_to_video:
        return HunyuanVideo15Pipeline(**components)
    # SigLIP as the real model's (16 vision tokens of a 32×32 view here, 729 of 384×384 there)
    image_encoder = tm._seeded(seed + 4, SiglipVisionModel, SiglipVisionConfig(
        hidden_size=VISION_WIDTH, intermediate_size=2 * VISION_WIDTH, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8))
    feature_extractor = SiglipImageProcessor(size={"height": 32, "width": 32})
    return HunyuanVideo15ImageToVideoPipeline(**components, image_encoder=image_encoder,
                                              feature_extractor=feature_extractor)


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Latents [B, 32, T', H/16, W/16] and both text streams with their masks, padded at the end as the pipeline's
    encoders pad them: the LLM text valid for all but a few tokens, the glyph text for a few (the negative's for
    none, as a prompt without quoted text gets), each sample of a batch a different length."""
    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or 20
    frames = (num_frames - 1) // 4 + 1
    out = {"latents": torch.randn(batch, LATENT, frames, height // 16, width // 16, generator=gen)}
    for offset, prefix in enumerate(("", "negative_") if negative else ("",)):
        valid = tokens - 3 - 2 * offset - torch.arange(batch)
        out[prefix + "prompt_embeds"] = torch.randn(batch, tokens, TEXT_WIDTH, generator=gen)
        out[prefix + "prompt_embeds_mask"] = (torch.arange(tokens) < valid[:, None]).long()
        glyphs = torch.full((batch,), 0 if offset else 5) + 3 * torch.arange(batch)
        out[prefix + "prompt_embeds_2"] = torch.randn(batch, 12, GLYPH_WIDTH, generator=gen)
        out[prefix + "prompt_embeds_mask_2"] = (torch.arange(12) < glyphs[:, None]).long()
    return out


def tiny_image_to_video_inputs(**kwargs) -> dict:
    """tiny_inputs and the start frame, [1, 3, H, W] in [0, 1], 8-bit values (as ComfyUI's images are)."""
    gen = torch.Generator().manual_seed(kwargs["seed"] + 1)
    image = torch.randint(0, 256, (1, 3, kwargs["height"], kwargs["width"]), generator=gen) / 255
    return {**tiny_inputs(**kwargs), "image": image}


HUNYUAN_VIDEO_15 = FAMILIES.register(Family(
    name="hunyuanvideo15",
    pipelines={"HunyuanVideo15Pipeline": xFuserHunyuanVideo15Pipeline,
               "HunyuanVideo15ImageToVideoPipeline": xFuserHunyuanVideo15ImageToVideoPipeline},
    transformer="HunyuanVideo15Transformer3DModel",
    plan=ParallelPlan(
        outputs={"x_embedder": Split(dim=1, expected_dims=3), "rope": Split(dim=0, items=(0, 1), expected_dims=2),
                 "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn": TextLayout.SUFFIX},
        text_padding={"transformer_blocks.*": TextPadding(text="encoder_hidden_states", mask="attention_mask")},
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("pred_cond", "pred_uncond"),
        uneven_tokens=True,
        output_channels="out_channels",  # it takes the latents, a condition and a mask (65 channels), returns 32
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks",),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("hidden_states", "encoder_hidden_states"),
            token_inputs={"freqs_cis": TokenRows(dim=0)},  # (cos, sin), [video tokens, head dim] each
        ),
    ),
    single_file=SINGLE_FILE,
    tiny={"hunyuanvideo15": TinyModel("HunyuanVideo15Pipeline", build_tiny, tiny_inputs, guidance=6.0),
          "hunyuanvideo15-i2v": TinyModel("HunyuanVideo15ImageToVideoPipeline",
                                          lambda seed: build_tiny(seed, image_to_video=True),
                                          tiny_image_to_video_inputs, guidance=6.0)},
    attention_layers={"HunyuanVideo15AttnProcessor2_0": "diffusers.models.transformers.transformer_hunyuan_video15"},
))
