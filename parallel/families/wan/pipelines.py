"""Wan's pipeline wrappers: its video shapes and checks, image-to-video's start image."""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any

import torch

from ...call_parameters import CallParameter
from ...layout.config import LayoutError
from ...model_executor.pipeline import xFuserPipelineBaseWrapper
from ..base import replaced
from ..comfy_data import ComfyData


DEFAULT_FRAMES = 81  # WanPipeline.__call__'s default num_frames
PROMPT_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length: what a text prompt is padded to


class xFuserWanPipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(
        latent_formats={16: "Wan21", 48: "Wan22"}, temporal=4,
        expects="encode with xDiT Text Encode on this pool, or Wan's UMT5-XXL CLIP loader (4096 wide, 512 tokens)",
        empty_latent="EmptyHunyuanLatentVideo (Wan 2.1 / 2.2 A14B) or a Wan latent node",
        model_class="WAN21_T2V", model_call_conds={"context": "prompt_embeds"},
    )
    embedding_sizes = {"prompt_embeds": "text_dim", "negative_prompt_embeds": "text_dim"}
    model_call_inputs = model_call_required = ("prompt_embeds",)
    call_parameters = {
        "num_frames": CallParameter(int, "video frames, 4k+1 (default: as many as the latents hold)", 1, 10_000),
        "guidance_scale_2": CallParameter(float, "Wan 2.2 A14B: guidance of the low-noise expert (default: guidance_scale)",
                                          0.0, 100.0),
    }

    def _config(self):
        transformer = self.module.transformer if self.module.transformer is not None else self.module.transformer_2
        return transformer.config

    def model_call_arguments(self, latents, timestep, inputs):
        """WanPipeline's loop: the 5-D latents as they are (image-to-video's: noise, frame mask and start image joined,
        as ComfyUI's WanImageToVideo joins them), the scheduler's timestep per sample, the text, Wan 2.1 I2V's CLIP
        vision features; Wan 2.2 TI2V takes one timestep per token, each latent frame's for its tokens (its start
        frame's 0 in image-to-video, as ComfyUI's Wan22ImageToVideoLatent noise mask makes it)."""
        arguments = {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": inputs["prompt_embeds"]}
        if inputs.get("image_embeds") is not None:
            if inputs["prompt_embeds"].shape[1] != PROMPT_TOKENS:  # diffusers' Wan 2.1 I2V cuts image from text there
                raise ValueError(f"Wan 2.1 I2V takes its text as {PROMPT_TOKENS} tokens (UMT5's padded length, as "
                                 f"ComfyUI's wan text encoder gives it), not {inputs['prompt_embeds'].shape[1]}: encode "
                                 "the prompt with the wan CLIP loader, without concatenating conditionings")
            arguments["encoder_hidden_states_image"] = inputs["image_embeds"]
        if self.frame_timesteps():
            patch_t, patch_h, patch_w = self._config().patch_size
            frames = latents.shape[2] // patch_t
            steps = timestep[:, None].expand(-1, frames) if timestep.ndim == 1 else timestep
            arguments["timestep"] = steps.repeat_interleave((latents.shape[3] // patch_h) * (latents.shape[4] // patch_w), dim=1)
        return arguments

    def frame_timesteps(self) -> bool:
        return bool(self.module.config.get("expand_timesteps"))

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """As `WanPipeline(prompt=...)` encodes it: UMT5, padded with zeros to 512 tokens."""
        embeds, _ = self.module.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=PROMPT_TOKENS)
        return {"prompt_embeds": embeds}

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        """Given latents define the frames: image-to-video builds its condition for num_frames frames."""
        latents = kwargs.get("latents")
        if kwargs.get("num_frames") is None and isinstance(latents, torch.Tensor) and latents.ndim == 5:
            kwargs = {**kwargs, "num_frames": (latents.shape[2] - 1) * self.module.vae_scale_factor_temporal + 1}
        return super().prepare(kwargs, check_layout)

    # -- shapes -------------------------------------------------------------------------------------
    def latent_frames(self, kwargs: dict[str, Any]) -> int:
        """T' of the latents: from `latents` if given (the pipeline then ignores num_frames), else from
        num_frames rounded as the pipeline rounds it (to 4k + 1)."""
        temporal = self.module.vae_scale_factor_temporal
        frames = kwargs.get("num_frames")
        if frames is not None:
            if frames % temporal != 1:
                frames = frames // temporal * temporal + 1
            frames = (max(frames, 1) - 1) // temporal + 1
        latents = kwargs.get("latents")
        if isinstance(latents, torch.Tensor) and latents.ndim == 5:
            if frames is not None and latents.shape[2] != frames:
                raise ValueError(
                    f"latents have {latents.shape[2]} latent frames but num_frames {kwargs['num_frames']} needs {frames}; "
                    f"pass num_frames {(latents.shape[2] - 1) * temporal + 1} or leave it out"
                )
            return latents.shape[2]
        return frames if frames is not None else (DEFAULT_FRAMES - 1) // temporal + 1

    def image_tokens(self, height: int, width: int) -> int:
        """Tokens of one latent frame."""
        _, patch_h, patch_w = self._config().patch_size
        return self.grid_tokens(height, width, self.module.vae_scale_factor_spatial, patch_h, patch_w)

    def token_rows(self, kwargs: dict[str, Any]) -> int:
        _, patch_h, _ = self._config().patch_size
        frames = self.latent_frames(kwargs) // self._config().patch_size[0]
        return frames * (kwargs["height"] // (self.module.vae_scale_factor_spatial * patch_h))

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        return self.latent_frames(kwargs) // self._config().patch_size[0] * self.image_tokens(kwargs["height"], kwargs["width"])

    def expected_latents_shape(self, batch: int, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        scale = self.module.vae_scale_factor_spatial
        return (batch, self._config().out_channels, frames, height // scale, width // scale)

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        latents = kwargs.get("latents")
        expected = self.expected_latents_shape(batch, kwargs["height"], kwargs["width"], self.latent_frames(kwargs))
        if isinstance(latents, torch.Tensor) and tuple(latents.shape) != expected:
            raise ValueError(
                f"latents have shape {list(latents.shape)} but {type(self.module).__name__} at "
                f"{kwargs['height']}x{kwargs['width']} needs [batch, channels, latent frames, height/8, width/8] = "
                f"{list(expected)}; send latents of that shape."
            )
        super().check_inputs({k: v for k, v in kwargs.items() if k != "latents"}, batch)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        c = self.parallel_config
        tokens = self.sequence_tokens(kwargs)
        if tokens < c.sp_degree:
            raise LayoutError(
                f"{self.latent_frames(kwargs)} latent frames at {kwargs['height']}x{kwargs['width']} give {tokens} video "
                f"tokens, fewer than the sequence-parallel degree {c.sp_degree} (ring {c.ring_degree} × ulysses "
                f"{c.ulysses_degree}); lower the degrees or sample a larger video."
            )
        return super().check_layout(kwargs, batch)


class xFuserWanImageToVideoPipeline(xFuserWanPipeline):
    """Wan image-to-video: the transformer also takes the first frame's VAE latents and a frame mask
    (36 input channels for 16 output channels); every rank encodes the image with its own VAE, or takes
    that encoding as given (`image_latents`: ComfyUI's WanImageToVideo encodes [start image, gray frames]
    with ComfyUI's VAE), which the pipeline then normalises and masks as its own. Wan 2.1 I2V also
    cross-attends to the start image's CLIP vision features: its image encoder computes them, or they are
    given (`image_embeds`, [1, 257, 1280]: ComfyUI's CLIPVisionEncode), as a single-file pool needs."""

    tensor_inputs = ("image", "image_latents", "image_embeds")
    comfy = dataclasses.replace(xFuserWanPipeline.comfy, concat_latents="image_latents", clip_vision="image_embeds",
                                model_class="WAN21_I2V",
                                model_call_conds={**xFuserWanPipeline.comfy.model_call_conds, "clip_fea": "image_embeds"})
    model_call_inputs = ("prompt_embeds", "image_embeds")  # image_embeds: Wan 2.1 I2V's CLIP vision (ComfyUI's clip_fea)

    def input_widths(self) -> dict[str, int]:
        image_dim = self.module.transformer.config.image_dim  # Wan 2.1 I2V only
        return {**super().input_widths(), **({"image_embeds": int(image_dim)} if image_dim else {})}

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        given, embeds = kwargs.get("image_latents"), kwargs.get("image_embeds")
        if kwargs.get("image") is None and given is None:
            raise ValueError(f"{type(self.module).__name__} needs `image`, the first frame to animate, or `image_latents`, "
                             "its VAE encoding with the frames after it")
        image_dim, encoder = self.module.transformer.config.image_dim, getattr(self.module, "image_encoder", None)
        if image_dim is None and embeds is not None:
            raise ValueError("`image_embeds` (CLIP vision features) go to Wan 2.1 I2V only; this model does not take them")
        if image_dim is not None and embeds is None and (given is not None or encoder is None):
            raise ValueError(f"this {type(self.module).__name__} (Wan 2.1 I2V) cross-attends to the start image's CLIP "
                             "vision features: send `image_embeds` (ComfyUI's CLIPVisionEncode of the start image)"
                             + ("" if encoder is None else ", or `image` alone"))
        if embeds is not None and (embeds.ndim != 3 or embeds.shape[0] != 1 or embeds.shape[-1] != image_dim):
            raise ValueError(f"image_embeds have shape {list(embeds.shape)}; Wan 2.1 I2V takes one image's CLIP vision "
                             f"hidden states, [1, tokens, {image_dim}]")
        if given is not None:
            scale = self.module.vae_scale_factor_spatial
            expected = (batch, self.module.vae.config.z_dim, self.latent_frames(kwargs),
                        kwargs["height"] // scale, kwargs["width"] // scale)
            if tuple(given.shape) != expected:
                raise ValueError(f"image_latents have shape {list(given.shape)} but this video needs {list(expected)} "
                                 "(the VAE encoding of the start image and the frames after it)")
        super().check_inputs(kwargs, batch)

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        if kwargs.get("image_latents") is not None and kwargs.get("image") is None:  # stands in for the encoded image
            latents = kwargs["image_latents"]
            kwargs = {**kwargs, "image": latents.new_zeros(latents.shape[0], 3, kwargs["height"], kwargs["width"])}
        return super().prepare(kwargs, check_layout)

    def call_context(self, kwargs: dict[str, Any]):
        """The pipeline's VAE encode of the condition video answers with the given encoding, and its CLIP
        vision encode of the start image with the given features."""
        given, embeds = kwargs.pop("image_latents", None), kwargs.pop("image_embeds", None)
        stack = contextlib.ExitStack()
        if given is not None:
            stack.enter_context(vae_encodes_as(self.module.vae, given))
        if embeds is not None:
            stack.enter_context(replaced(self.module, "encode_image", lambda *args, **kwargs: embeds))
        return stack


def vae_encodes_as(vae, latents: torch.Tensor):
    """The VAE's encode answers with `latents` (on their own device: the pipeline moves them on)."""
    def encode(video, *args, **kwargs):
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: latents.to(dtype=video.dtype)))

    return replaced(vae, "encode", encode)
