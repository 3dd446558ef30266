"""Qwen-Image's pipeline wrappers: text masks, true CFG, the edit models' reference images."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import torch

from ...call_parameters import CallParameter
from ...layout.config import LayoutError
from ...model_executor.pipeline import xFuserPipelineBaseWrapper
from ...model_executor.pipeline.img2img import linear_sigmas
from ..base import pack_2x2, pictures, references, replaced, unpack_2x2
from ..comfy_data import ComfyData


MASKS = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}
# ComfyUI's ways of placing reference tokens that diffusers' transformer has: the n-th reference at frame index n
# (its img_shapes), and Qwen-Image-Edit 2511's, which also modulates them at timestep 0 (its zero_cond_t)
REFERENCE_METHODS = ("index", "index_timestep_zero")


class xFuserQwenImagePipeline(xFuserPipelineBaseWrapper):
    default_sigmas = staticmethod(linear_sigmas)
    comfy = ComfyData(
        latent_formats={16: "Wan21"}, packed=True, cfg_call="true_cfg_scale",
        expects="encode with xDiT Text Encode on this pool, or Qwen-Image's CLIPLoader (Qwen2.5-VL 7B, 3584 wide)",
        empty_latent="EmptySD3LatentImage (16 channels)", model_class="QwenImage",
        model_call_conds={"context": "prompt_embeds", "ref_latents": "reference_latents",
                          "ref_latents_method": "reference_method"},
        reference_methods=REFERENCE_METHODS, text_masks={"prompt_embeds": "prompt_embeds_mask"},
    )
    tensor_inputs = tuple(MASKS.values())
    latent_patch = 2
    embedding_sizes = {"prompt_embeds": "joint_attention_dim", "negative_prompt_embeds": "joint_attention_dim"}
    call_parameters = {
        "true_cfg_scale": CallParameter(float, "classifier-free guidance with the negative embeddings (1: off)", 0.0, 100.0),
    }
    guidance, guidance_needs_negative = ("true_cfg_scale", 4.0), True

    model_call_inputs = ("prompt_embeds", "reference_latents", "reference_sizes", "reference_method")
    model_call_required = ("prompt_embeds",)

    def model_call_arguments(self, latents, timestep, inputs):
        """QwenImagePipeline's loop: 2×2-packed tokens, timestep / 1000, the text without a mask (all valid); the
        edit pipelines' reference tokens after the noisy ones, each listed in img_shapes (its frame index)."""
        batch, _, height, width = latents.shape
        parts = references(inputs)
        _reference_method(inputs)
        for part in parts:
            _check_reference(part, height, width)
        shapes = [(1, h // 2, w // 2) for h, w in [(height, width)] + [part.shape[2:] for part in parts]]
        return {"hidden_states": torch.cat([pack_2x2(latents), *map(pack_2x2, parts)], dim=1),
                "timestep": timestep / 1000, "encoder_hidden_states": inputs["prompt_embeds"],
                "encoder_hidden_states_mask": None, "img_shapes": [shapes] * batch}

    def model_call_context(self, transformer, inputs):
        """ComfyUI's `index_timestep_zero` (the 2511 file's default): diffusers' zero_cond_t, on for this call."""
        zero = _reference_method(inputs) == "index_timestep_zero"
        module = transformer.module
        stack = contextlib.ExitStack()
        for owner in (module, *module.transformer_blocks):
            stack.enter_context(replaced(owner, "zero_cond_t", zero))
        return stack

    def model_call_output(self, output, latents):
        """The noisy tokens back to [B, 16, h, w] (the references' are dropped, as the pipelines drop them)."""
        height, width = latents.shape[2:]
        return unpack_2x2(output[:, : (height // 2) * (width // 2)], height * 8, width * 8)

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        return (batch, self.image_tokens(height, width), self.module.transformer.config.in_channels)

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

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        if self.module.transformer.config.zero_cond_t and self.parallel_config.pipefusion_degree > 1:
            raise LayoutError("Qwen-Image-Edit 2511 (zero_cond_t) modulates each token by its own row of modulate_index, "
                              "which PipeFusion's patches do not slice yet; use Ulysses, Ring, CFG or data parallel")
        return super().check_layout(kwargs, batch)

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


def _reference_method(inputs: dict[str, torch.Tensor]) -> str:
    """The call's reference method: `reference_method` [B] holds its index in REFERENCE_METHODS (one per call)."""
    method = inputs.get("reference_method")
    if method is None:
        return REFERENCE_METHODS[0]
    values = set(method.reshape(-1).tolist())
    if len(values) != 1 or not values <= set(range(len(REFERENCE_METHODS))):
        raise ValueError(f"reference_method holds {sorted(values)}: one index into {list(REFERENCE_METHODS)} per call")
    return REFERENCE_METHODS[int(values.pop())]


def _check_reference(part: torch.Tensor, height: int, width: int) -> None:
    """Refuse a reference whose rotary positions ComfyUI and diffusers place apart: an odd count of tokens on a side
    (ComfyUI centres it one row lower), or a side longer than the noisy latent's (diffusers then starts the text
    after the reference, ComfyUI after the noisy latent)."""
    h, w = part.shape[2:]
    if h % 4 or w % 4 or max(h, w) // 4 > max(height, width) // 4:
        raise ValueError(f"a reference latent of {h}x{w} (latent pixels) with a {height}x{width} latent: xDiT takes "
                         "references whose sides are multiples of 32 pixels and no longer than the image's longer side; "
                         "scale the reference image so (ImageScale / ImageScaleToTotalPixels)")


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
        most = max(self.parallel_config.batch_split(batch) or [batch])  # the samples of the busiest rank
        if self._several() and most > 1:
            raise LayoutError(f"QwenImageEditPlusPipeline samples one prompt per call and this batch of {batch} gives "
                              f"{most} to a rank: use a data-parallel degree of {batch}, or one prompt per job")
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
