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

Qwen-Image-Edit (`QwenImageEditPipeline`) and Edit Plus (`QwenImageEditPlusPipeline`, several references) run the
same transformer on the noisy tokens followed by each reference image's tokens (`img_shapes` lists them; the
rotary table covers them all): the plan splits that whole sequence, so the reference tokens are sharded with the
noisy ones, and the pipeline keeps the noisy part of the gathered output; PipeFusion's patches cut that whole
sequence too (the base's check: the total divides into patches). References come as pixels (encoded by the
pipeline at ~1024²) or as latents (ComfyUI's ReferenceLatent), which the pipeline's sizing and VAE encode are
answered with.

Its attention layers are diffusers' shared `Attention` class with a processor that calls
`dispatch_attention_fn`, so the family declares the processor (`attention_layers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import numpy as np
import torch

from ..call_parameters import CallParameter
from ..checkpoints.shapes import Shapes
from ..config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipelines import xFuserPipelineBaseWrapper
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, PatchFlow, PipeFusionPlan, Split, TokenRows
from .base import FAMILIES, ComfyData, Family, SingleFile, TinyModel, Variant, pack_2x2, pictures, replaced, unpack_2x2

MASKS = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}


class xFuserQwenImagePipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(
        latent_formats={16: "Wan21"}, packed=True, cfg_call="true_cfg_scale",
        expects="encode with xDiT Text Encode on this pool, or Qwen-Image's CLIPLoader (Qwen2.5-VL 7B, 3584 wide)",
        empty_latent="EmptySD3LatentImage (16 channels)", model_class="QwenImage",
        model_call_conds={"context": "prompt_embeds"}, text_masks={"prompt_embeds": "prompt_embeds_mask"},
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

    def guidance_combine(self, kwargs: dict[str, Any]):
        """QwenImagePipeline's true CFG: the combination rescaled to the norm of the cond prediction, per token."""
        scale = kwargs.get("true_cfg_scale", 4.0)

        def combine(cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
            combined = uncond + scale * (cond - uncond)
            return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

        return combine

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


class xFuserQwenImageEditPipeline(xFuserQwenImagePipeline):
    """Qwen-Image-Edit: `image`, the reference image, either its pixels [1, 3, H, W] in [0, 1] or its latents in
    model space [1, 16, h, w] (ComfyUI's ReferenceLatent; h and w even). The pipelines take PIL images only and
    encode each reference at about 1024² pixels of its aspect ratio (`calculate_dimensions`), whatever the output's
    size; pixels go in as the 8-bit pictures they are, latents at their own size (the pipeline's sizing and VAE
    encode answered with them). The output is the requested height × width."""

    comfy = dataclasses.replace(
        xFuserQwenImagePipeline.comfy, reference_latents="image", reference_required=True,
        expects="encode with xDiT Text Encode on this pool, or ComfyUI's TextEncodeQwenImageEdit (Qwen2.5-VL 7B, "
                "3584 wide), and give the reference image with ReferenceLatent or TextEncodeQwenImageEdit's vae and image")
    tensor_inputs = xFuserQwenImagePipeline.tensor_inputs + ("image",)
    shared_inputs = ("image",)  # every prompt edits every reference
    model_call_inputs = model_call_required = ()  # single model calls would need the reference tokens too: none yet
    REFERENCE_AREA = 1024 * 1024  # the pipelines' VAE_IMAGE_SIZE

    def _several(self) -> bool:
        return self.comfy.references != 1  # Plus

    def _latent_references(self, image: torch.Tensor) -> bool:
        return image.shape[1] == self.module.vae.config.z_dim

    def reference_tokens(self, image: torch.Tensor | None) -> int:
        """Tokens the references add: each at the size the pipeline encodes it, in 2×2 latent patches."""
        if not isinstance(image, torch.Tensor) or image.ndim != 4:
            return 0  # none, or not images: check_inputs says so
        if self._latent_references(image):
            return image.shape[0] * (image.shape[2] // self.latent_patch) * (image.shape[3] // self.latent_patch)
        width, height = self._sizing()(self.REFERENCE_AREA, image.shape[3] / image.shape[2])[:2]
        scale = self.module.vae_scale_factor * self.latent_patch
        return image.shape[0] * (height // scale) * (width // scale)

    def _sizing(self):
        return inspect.getmodule(type(self.module)).calculate_dimensions  # the pipeline's own

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        image, name, several = kwargs.get("image"), type(self.module).__name__, self._several()
        count = "N" if several else "1"
        channels = self.module.vae.config.z_dim
        takes = f"[{count}, 3, H, W] pixels in [0, 1] or [{count}, {channels}, h, w] latents"
        if image is None:
            raise ValueError(f"{name} edits reference images: send `image`, {takes}")
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[1] not in (3, channels) or (
                not several and image.shape[0] != 1):
            raise ValueError(f"image has shape {list(getattr(image, 'shape', []))}; {name} takes reference images, "
                             f"{takes}" + ("" if several else " (several: QwenImageEditPlusPipeline)"))
        if self._latent_references(image) and (image.shape[2] % self.latent_patch or image.shape[3] % self.latent_patch):
            raise ValueError(f"reference latents of {image.shape[2]}x{image.shape[3]} do not pack into 2x2 tokens; "
                             "crop or resize the reference image to a multiple of 16 pixels")
        super().check_inputs(kwargs, batch)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        dp = self.parallel_config.dp_degree
        if self._several() and -(-batch // dp) > 1:
            raise LayoutError(f"QwenImageEditPlusPipeline samples one prompt per call and this batch of {batch} gives "
                              f"{-(-batch // dp)} to a rank: use a data-parallel degree of {batch}, or one prompt per job")
        return super().check_layout(kwargs, batch)

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """The prompt alone, in Qwen-Image's text template: what ComfyUI's TextEncodeQwenImageEdit encodes without an
        image (the reference then comes as latents, ReferenceLatent's way)."""
        from diffusers import QwenImagePipeline

        parts = {name: getattr(self.module, name) for name in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}
        embeds, mask = QwenImagePipeline(**parts).encode_prompt(prompt, device=self.module.transformer.device)
        return {"prompt_embeds": embeds} if mask is None else {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def encode_text_with_images(self, prompt: str, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """The prompt encoded with its reference images as the pipeline's `__call__` encodes them (Qwen2.5-VL sees
        each at the size the pipeline gives it: Edit ~1024², Plus ~384²), and as `image` the references' latents in
        model space, [N, 16, h, w], encoded by the pipeline's VAE at the size it encodes them (~1024²) — what ComfyUI's
        TextEncodeQwenImageEdit(Plus) gives with its vae and image(s)."""
        module, pipeline = inspect.getmodule(type(self.module)), self.module
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[1] != 3 or not (
                self._several() or image.shape[0] == 1):
            raise ValueError(f"image has shape {list(getattr(image, 'shape', []))}; {type(pipeline).__name__} encodes "
                             f"text with {'N' if self._several() else 'one'} reference image(s), [N, 3, H, W] in [0, 1]")
        seen, encoded = [], []  # what the text encoder sees; what the VAE encodes
        for picture in pictures(image):
            ratio = picture.width / picture.height
            width, height = self._sizing()(self.REFERENCE_AREA, ratio)[:2]
            if self._several():
                seen_width, seen_height = self._sizing()(module.CONDITION_IMAGE_SIZE, ratio)
                seen.append(pipeline.image_processor.resize(picture, seen_height, seen_width))
            else:  # Edit resizes first, then both encoders take the resized picture
                picture = pipeline.image_processor.resize(picture, height, width)
                seen.append(picture)
            encoded.append(pipeline.image_processor.preprocess(picture, height, width).unsqueeze(2))
        device = pipeline.transformer.device
        embeds, mask = pipeline.encode_prompt(prompt, image=seen if self._several() else seen[0], device=device)
        latents = torch.cat([pipeline._encode_vae_image(pixels.to(device, embeds.dtype), generator=None)[:, :, 0]
                             for pixels in encoded])
        return {"prompt_embeds": embeds, **({} if mask is None else {"prompt_embeds_mask": mask}), "image": latents}

    def call_context(self, kwargs: dict[str, Any]):
        image, several = kwargs["image"], self._several()
        if not self._latent_references(image):
            images = pictures(image)
            kwargs["image"] = images if several else images[0]
            return contextlib.nullcontext()
        # Latents: stand-in pictures of their size, which the pipeline sizes, resizes and "encodes" to them.
        scale = self.module.vae_scale_factor
        height, width = image.shape[2] * scale, image.shape[3] * scale
        stand_ins = pictures(image.new_zeros(image.shape[0], 3, height, width))
        kwargs["image"] = stand_ins if several else stand_ins[0]
        module, sizing = inspect.getmodule(type(self.module)), self._sizing()

        def reference_size(area, ratio):  # the VAE's size answered; the text encoder's (Plus: 384²) its own
            size = sizing(area, ratio)
            return (width, height, *size[2:]) if area == self.REFERENCE_AREA else size

        latents = iter(image.unsqueeze(2).split(1))  # [1, C, 1, h, w] each, in the order the pipeline encodes
        stack = contextlib.ExitStack()
        stack.enter_context(replaced(module, "calculate_dimensions", reference_size))
        stack.enter_context(replaced(self.module, "_encode_vae_image", lambda image, generator: next(latents).to(image)))
        return stack


class xFuserQwenImageEditPlusPipeline(xFuserQwenImageEditPipeline):
    """Qwen-Image-Edit Plus: the same with one or several references, [N, 3, H, W] or [N, 16, h, w] (one size for all),
    every prompt editing them all."""

    comfy = dataclasses.replace(xFuserQwenImageEditPipeline.comfy, references=0)


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
VISION_TOKENS = ("vision_start", "vision_end", "image_pad", "video_pad")  # Qwen2.5-VL's <|…|> tokens around pictures


def tiny_text_encoder(seed: int, width: int, heads: int = 2, kv_heads: int = 1):
    """Qwen2.5-VL on the byte-level Qwen tokenizer of the tiny models with Qwen2.5-VL's vision tokens, `width` wide
    (its multimodal rotary sections in Qwen2.5-VL's proportions of the head size: 16 + 24 + 24 of 64), with a
    one-block vision tower (the edit models encode each prompt with its reference images)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .. import tiny_models as tm

    tokenizer = tm._qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<|{name}|>" for name in VISION_TOKENS]},
                                 replace_extra_special_tokens=False)
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    vision_ids = {f"{name.removesuffix('_pad')}_token_id": tokenizer.convert_tokens_to_ids(f"<|{name}|>")
                  for name in VISION_TOKENS}
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
    from ..vl_processors import images_only

    return images_only(Qwen2VLProcessor)(images, tokenizer)


EDIT_VAE_SCALE = 32  # the tiny edit models' VAE factor (the real one's is 8)


def build_tiny(seed: int, edit: str | None = None):
    """Qwen-Image, or with `edit` the pipeline of that name (QwenImageEditPipeline, QwenImageEditPlusPipeline) on
    the same parts and Qwen2.5-VL's processor."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    from .. import tiny_models as tm

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
    from .. import tiny_models as tm

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


QWEN_IMAGE = FAMILIES.register(Family(
    name="qwen-image",
    pipelines={"QwenImagePipeline": xFuserQwenImagePipeline, "QwenImageEditPipeline": xFuserQwenImageEditPipeline,
               "QwenImageEditPlusPipeline": xFuserQwenImageEditPlusPipeline},
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
            flow=PatchFlow(embedder="img_in", output=(("norm_out", ("temb",)), ("proj_out", ()))),
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
                                  true_cfg={"true_cfg_scale": 4.0}),
          "qwen-image-edit": TinyModel("QwenImageEditPipeline", lambda seed: build_tiny(seed, "QwenImageEditPipeline"),
                                       lambda **kwargs: tiny_edit_inputs(1, **kwargs), guidance=1.0,
                                       true_cfg={"true_cfg_scale": 4.0}),
          "qwen-image-edit-plus": TinyModel("QwenImageEditPlusPipeline",
                                            lambda seed: build_tiny(seed, "QwenImageEditPlusPipeline"),
                                            lambda **kwargs: tiny_edit_inputs(2, **kwargs), guidance=1.0,
                                            true_cfg={"true_cfg_scale": 4.0})},
    attention_layers={"QwenDoubleStreamAttnProcessor2_0": "diffusers.models.transformers.transformer_qwenimage"},
))
