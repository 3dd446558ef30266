"""Conversion between ComfyUI's data and a diffusers pipeline's inputs and outputs, from the data its
family declares (`ComfyData`, parallel/families/): no family is named here.

ComfyUI keeps VAE-space latents and applies the model's latent format (`comfy/latent_formats.py`)
inside its samplers; diffusers pipelines take model-space latents. So the sampler converts with that
latent format's own process_in / process_out (and packs 2×2 where the family says so), uses ComfyUI's
own noise for the seed, and turns a native CONDITIONING into the pipeline's tensor inputs.
"""

from __future__ import annotations

import torch

from ..parallel.families import FAMILIES, ComfyData
from ..parallel.families.base import pack_2x2, unpack_2x2
from . import comfy_compat


XDIT_TEXT = "xdit_text."  # conditioning extras from xDiT Text Encode that are pipeline inputs by the rest of the name


class ConditioningError(ValueError):
    """A conditioning that does not fit the pool's model; the text says which encoder it needs."""


class FamilyAdapter:
    """ComfyUI ↔ one diffusers pipeline class."""

    def __init__(self, pipeline: str, data: ComfyData, tensor_inputs: tuple[str, ...], latent_scale: int,
                 call_parameters: tuple[str, ...] = (), shared_inputs: tuple[str, ...] = ()):
        self.name, self.data, self.tensor_inputs, self.call_parameters = pipeline, data, tensor_inputs, call_parameters
        self.latent_scale = latent_scale  # pixels per latent pixel: the pool's own VAE says (its `latent_scale` status)
        self.shared_inputs = shared_inputs  # inputs every sample of the batch shares (not repeated per sample)

    # -- latents ------------------------------------------------------------------------------------
    def format_name(self, channels: int) -> str:
        """The comfy.latent_formats class of a latent with `channels` channels."""
        if not self.data.latent_formats:
            raise ConditioningError(f"{self.name}: {self.data.expects}")
        if channels not in self.data.latent_formats:
            raise ConditioningError(
                f"a {self.name} latent has {channels} channels; expected {' or '.join(map(str, self.data.latent_formats))}"
            )
        return self.data.latent_formats[channels]

    def latent_format(self, channels: int):
        """ComfyUI's latent format object (process_in/out, preview factors) for `channels` channels: ComfyUI's own
        class, or where this ComfyUI has none, one made from the family's declaration (comfy_compat)."""
        name = self.format_name(channels)
        made = comfy_compat.latent_format(name, self.data.declared_formats.get(name), self.name)
        if made is None:
            raise ConditioningError(f"this ComfyUI has no {name} latent format for {self.name}; update ComfyUI")
        return made

    def comfy_latent(self, samples: torch.Tensor) -> torch.Tensor:
        """A LATENT's samples as this pipeline's family takes them: an image model whose latent format is a
        video one (Qwen-Image's Wan21: ComfyUI keeps its latents [B, C, 1, H, W]) gets its one frame as 4-D."""
        if not self.data.temporal and samples.ndim == 5 and samples.shape[2] == 1:
            return samples[:, :, 0]
        return samples

    def _one_frame(self, channels: int) -> bool:
        return not self.data.temporal and self.latent_format(channels).latent_dimensions == 3

    def job_size(self, samples: torch.Tensor) -> dict[str, int]:
        """The job's pixel size (and frames, for video) of a ComfyUI latent."""
        video = self.data.temporal > 0
        if samples.ndim != (5 if video else 4):
            layout = "[batch, channels, frames, height, width]" if video else "[batch, channels, height, width]"
            raise ConditioningError(
                f"{self.name} samples {'videos' if video else 'images'}: the latent must be {5 if video else 4}-D "
                f"{layout}, got {list(samples.shape)}; use {self.data.empty_latent}"
            )
        self.format_name(samples.shape[1])
        scale = self.latent_scale
        size = {"height": samples.shape[-2] * scale, "width": samples.shape[-1] * scale}
        if video and not self.data.derives_frames:
            size["num_frames"] = (samples.shape[2] - 1) * self.data.temporal + 1
        return size

    def to_model(self, latents: torch.Tensor) -> torch.Tensor:
        return self.noise_to_model(self._model_space(latents))

    def _model_space(self, latents: torch.Tensor) -> torch.Tensor:
        """Image latents [B, C, h, w] (or one frame, [B, C, 1, h, w]) from ComfyUI's VAE space to the model's."""
        latents = self.comfy_latent(latents)
        if self._one_frame(latents.shape[1]):
            return self.latent_format(latents.shape[1]).process_in(latents[:, :, None])[:, :, 0]
        return self.latent_format(latents.shape[1]).process_in(latents)

    def noise_to_model(self, noise: torch.Tensor) -> torch.Tensor:
        if self.data.tokens == "call":  # [B, C, h, w] → one token per latent pixel, [B, h·w, C]
            return noise.flatten(2).transpose(1, 2)
        return pack_2x2(noise) if self.data.packed else noise

    def _from_loop(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The pipeline's loop latents (its results with `model_latents`, its previews) image-shaped."""
        if self.data.packed:
            return unpack_2x2(latents, height, width, self.latent_scale)
        if self.data.tokens and latents.ndim == 3:  # tokens [B, (T')·h·w, C] → [B, C, (T',) h, w]
            scale = self.latent_scale
            frames = (-1,) if self.data.temporal else ()
            return latents.transpose(1, 2).reshape(latents.shape[0], latents.shape[2], *frames, height // scale,
                                                   width // scale)
        return latents

    def to_comfy(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        latents = self._from_loop(latents, height, width)
        if self._one_frame(latents.shape[1]):  # as ComfyUI's own sampling returns it
            latents = latents[:, :, None]
        return self.latent_format(latents.shape[1]).process_out(latents)

    def comfy_references(self, latents: torch.Tensor) -> list[torch.Tensor]:
        """Model-space reference latents [N, C, h, w] (the pool VAE's encoding) as ReferenceLatent keeps them: one
        VAE-space latent per reference, shaped as ComfyUI's VAEEncode gives them (one frame of a video format)."""
        if self._one_frame(latents.shape[1]):
            latents = latents[:, :, None]
        return list(self.latent_format(latents.shape[1]).process_out(latents).split(1))

    def preview_latents(self, preview: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Model-space latents of the first sample as an image latent [1, C, H, W] for ComfyUI's previewer
        (a video's middle latent frame)."""
        preview = self._from_loop(preview, height, width)
        return preview[:, :, preview.shape[2] // 2] if preview.ndim == 5 else preview

    # -- video with sound ---------------------------------------------------------------------------------
    def streams(self, samples) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A LATENT's samples as (video, audio): ComfyUI's AV latent (LTXVConcatAVLatent's NestedTensor of both) for a
        model that samples sound with its video (`audio_stream`), a plain latent (audio None) for the others."""
        streams = comfy_compat.latent_streams(samples)
        if len(streams) > 1 and not self.data.audio_stream:
            raise ConditioningError(f"{self.name} samples no audio: give it the video latent alone (LTXVSeparateAVLatent "
                                    "splits an audio–video latent)")
        if not self.data.audio_stream:
            return samples, None
        if len(streams) != 2:
            raise ConditioningError(f"{self.name} samples video with sound from one latent holding both: use "
                                    f"{self.data.empty_latent}")
        return streams

    def audio_to_model(self, audio: torch.Tensor) -> torch.Tensor:
        """ComfyUI's audio stream in the pipeline's layout (`audio_axes`)."""
        return audio.permute(*self.data.audio_axes) if self.data.audio_axes else audio

    def av_latent(self, video: torch.Tensor, outputs: dict[str, torch.Tensor]):
        """The sampled video (ComfyUI's space) with the pool's audio output as ComfyUI's AV latent."""
        audio = outputs[self.data.audio_stream[1]].float()
        if self.data.audio_axes:
            audio = audio.permute(*sorted(range(audio.ndim), key=self.data.audio_axes.__getitem__))
        return comfy_compat.nested_latent(video, audio.contiguous())

    def conditioning_calls(self, positive) -> dict:
        """The call parameters the positive conditioning sets (LTXVConditioning's frame_rate), ComfyUI's value where
        it sets none."""
        _, extras = self._single(positive, "positive")
        return {name: type(default)(extras.get(key, default))
                for key, (name, default) in self.data.conditioning_calls.items()}

    # -- conditioning -------------------------------------------------------------------------------
    def pipeline_inputs(self, positive, negative, batch: int, widths: dict[str, int]) -> tuple[dict, float | None]:
        """prompt_embeds & co. for `batch` samples, and the conditioning's distilled guidance if any."""
        tensors, guidance = {}, None
        for prefix, conditioning in (("", positive), ("negative_", negative)):
            if conditioning is None:
                continue
            cond, extras = self._single(conditioning, prefix or "positive")
            tensors.update(self._texts(prefix, cond, extras, batch, widths))
            if f"{prefix}pooled_prompt_embeds" in widths:
                pooled = extras.get("pooled_output")
                if pooled is None:
                    raise ConditioningError(f"the {prefix or 'positive '}conditioning has no pooled output; {self.data.expects}")
                self._check_width(f"{prefix}pooled_prompt_embeds", pooled.shape[-1], widths)
                tensors[f"{prefix}pooled_prompt_embeds"] = _repeat(pooled, batch)
            if not prefix and self.data.guidance_in_conditioning and "guidance" in extras:
                guidance = float(extras["guidance"])
            if not prefix and self.data.reference_latents:
                reference = self._reference(extras.get("reference_latents") or [])
                if reference is not None:
                    name = self.data.reference_latents
                    tensors[name] = reference if name in self.shared_inputs else _repeat(reference, batch)
            if not prefix:
                for key, name in self.data.conditioning_inputs.items():
                    if key in extras:
                        value = extras[key]
                        tensors[name] = value if name in self.shared_inputs else _repeat(value, batch)
            if not prefix and self.data.concat_latents:
                tensors[self.data.concat_latents] = _repeat(self._start_image(extras), batch)
            if not prefix and self.data.clip_vision in widths:
                features = self._clip_vision(extras, widths)
                if features is not None:
                    tensors[self.data.clip_vision] = features
        return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, guidance

    def _texts(self, prefix: str, cond: torch.Tensor, extras: dict, batch: int, widths: dict[str, int]) -> dict:
        """One branch's text inputs. The conditioning's tensor is prompt_embeds and, from ComfyUI's own encoders, its
        other keys are the family's other text streams (`conditioning_keys`); each width is checked; each goes with
        its mask where the pipeline takes one (ComfyUI's `attention_mask` where it pads, else all valid), or has its
        padding trimmed where the pipeline takes none. xDiT Text Encode's inputs (`xdit_text.*`) go as it sent them."""
        given = {key[len(XDIT_TEXT):]: value for key, value in extras.items() if key.startswith(XDIT_TEXT)}
        texts = {"prompt_embeds": (cond, extras.get("attention_mask"))}
        texts.update({name: (extras[key], None) for key, name in self.data.conditioning_keys.items()
                      if key in extras and name not in given and f"{prefix}{name}" in self.tensor_inputs})
        out = {}
        for name, (tensor, mask) in texts.items():
            self._check_width(f"{prefix}{name}", tensor.shape[-1], widths)
            mask_name = self.data.text_masks.get(name, "prompt_attention_mask" if name == "prompt_embeds" else "")
            if f"{prefix}{mask_name}" in self.tensor_inputs:
                if mask_name not in given:
                    mask = torch.ones(tensor.shape[:2]) if mask is None else mask
                    out[f"{prefix}{mask_name}"] = _repeat(mask.to(torch.int64).reshape(mask.shape[0], -1), batch)
            elif mask is not None:
                tensor = self._trimmed(tensor, mask, name)
            out[f"{prefix}{name}"] = _repeat(tensor, batch)
        for name in self.data.optional_texts:  # a stream the encoder left out (no quoted text): one masked token
            if name not in texts and name not in given and f"{prefix}{name}" in widths:
                out[f"{prefix}{name}"] = torch.zeros(batch, 1, widths[f"{prefix}{name}"])
                out[f"{prefix}{self.data.text_masks[name]}"] = torch.zeros(batch, 1, dtype=torch.int64)
        for name, value in given.items():
            if f"{prefix}{name}" in self.tensor_inputs:
                out[f"{prefix}{name}"] = value if name in self.shared_inputs else _repeat(value, batch)
        return out

    def _trimmed(self, tensor: torch.Tensor, mask: torch.Tensor, name: str) -> torch.Tensor:
        """Text padded at its end, for a pipeline that takes no mask: its valid tokens (every sample as many)."""
        mask = mask.reshape(mask.shape[0], -1).bool()
        valid = mask.sum(1)
        if len(set(valid.tolist())) != 1 or not mask[:, : int(valid[0])].all():
            raise ConditioningError(f"{name} of this conditioning pads its prompts to different lengths, and {self.name} "
                                    "takes no mask: encode each prompt on its own")
        return tensor[:, : int(valid[0])]

    def guidance_parameters(self, cfg: float, conditioning_guidance: float | None, use_negative: bool) -> tuple[float, dict]:
        """The job's guidance_scale and the family call parameters guidance adds: ComfyUI's cfg, or where the
        family distills guidance (its value comes with the conditioning), that as guidance_scale and cfg as
        true CFG; where cfg is another call parameter (`cfg_call`), that, 1 (off) without a negative; where the
        pipeline's guidance is offset from ComfyUI's (`cfg_offset`), cfg less it, 0 (off) without a negative."""
        if self.data.cfg_offset:
            return (cfg - self.data.cfg_offset if use_negative else 0.0), {}
        if self.data.cfg_call:
            return cfg, {self.data.cfg_call: cfg if use_negative else 1.0}
        if not self.data.guidance_in_conditioning:
            return cfg, {}
        guidance = self.data.default_guidance if conditioning_guidance is None else conditioning_guidance
        if use_negative and "true_cfg_scale" not in self.call_parameters:
            raise ConditioningError(f"{self.name} is guidance-distilled and has no classifier-free guidance: set cfg to 1 "
                                    "and its guidance with FluxGuidance on the positive conditioning")
        return guidance, ({"true_cfg_scale": cfg} if use_negative else {})

    def _reference(self, latents: list[torch.Tensor]) -> torch.Tensor | None:
        """ReferenceLatent's VAE-space latents in model space, one tensor (the pipeline packs them itself). Without
        one an edit model that can samples from the text alone, as ComfyUI's own Kontext does."""
        if not latents:
            if self.data.reference_required:
                raise ConditioningError(f"{self.name} edits a reference image and the positive conditioning has none: "
                                        "add ComfyUI's ReferenceLatent (a VAEEncode of the image) to it, or encode with "
                                        "TextEncodeQwenImageEdit given the vae and the image")
            return None
        if self.data.references and len(latents) > self.data.references:
            raise ConditioningError(
                f"{self.name} takes one reference image but the conditioning has {len(latents)}; "
                "chain one ReferenceLatent node only"
            )
        latents = [self._model_space(latent.float()) for latent in latents]
        if len({tuple(latent.shape) for latent in latents}) > 1:
            raise ConditioningError(f"{self.name}'s reference images must share one size; these have "
                                    f"{[list(latent.shape[-2:]) for latent in latents]} latent pixels: scale them alike")
        return torch.cat(latents)

    def _start_image(self, extras: dict) -> torch.Tensor:
        """The start image's encoding as ComfyUI's image-to-video node hands it over (WanImageToVideo: [start image,
        gray frames]; HunyuanVideo15ImageToVideo: the start image, zeros after), in the VAE's space."""
        latents, mask = extras.get("concat_latent_image"), extras.get("concat_mask")
        node = self.data.image_to_video_node
        if latents is None:
            raise ConditioningError(f"{self.name} animates a start image: pass the conditioning through ComfyUI's "
                                    f"{node} node with a start_image")
        if mask is not None and (not (mask[:, :, :1] == 0).all() or (mask[:, :, 1:] == 0).any()):
            raise ConditioningError(f"{self.name} takes one start image (the first frame); give {node} a "
                                    "single start_image")
        return latents.float()

    def _clip_vision(self, extras: dict, widths: dict[str, int]) -> torch.Tensor | None:
        """The start image's CLIP vision features as the pipeline's image encoder gives them (`clip_vision_state`)."""
        output = extras.get("clip_vision_output")
        if output is None and not self.data.clip_vision_required:
            return None
        if output is None:
            raise ConditioningError(f"this {self.name} model (Wan 2.1 I2V) also attends to the start image's CLIP vision "
                                    "features: load clip_vision_h with CLIPVisionLoader, encode the start image with "
                                    "CLIPVisionEncode (crop: none) and connect it to WanImageToVideo's clip_vision_output")
        features = getattr(output, self.data.clip_vision_state)
        self._check_width(self.data.clip_vision, features.shape[-1], widths)
        return features[:1]

    def _single(self, conditioning, which: str):
        if not isinstance(conditioning, list) or not conditioning:
            raise ConditioningError(f"the {which} input is not a CONDITIONING")
        if len(conditioning) > 1:
            raise ConditioningError(
                f"xDiT Sampler takes one {which} conditioning but got {len(conditioning)} (areas or concatenations); "
                "combine them into one first"
            )
        cond, extras = conditioning[0]
        return cond, extras

    def _check_width(self, name: str, width: int, widths: dict[str, int]) -> None:
        if name in widths and width != widths[name]:
            raise ConditioningError(
                f"{name} is {width} wide but this pool's {self.name} model needs {widths[name]}; {self.data.expects}"
            )


def _repeat(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    if tensor.shape[0] == batch:
        return tensor
    if tensor.shape[0] != 1:
        raise ConditioningError(f"conditioning batch {tensor.shape[0]} does not match the latent batch {batch}")
    return tensor.expand(batch, *tensor.shape[1:]).contiguous()


def adapter_for(pipeline: str, latent_scale: int) -> FamilyAdapter:
    """The adapter for the diffusers pipeline class named `pipeline` whose latents are 1/`latent_scale` of the
    pixels (a pool's `pipeline` and `latent_scale` status)."""
    try:
        wrapper = FAMILIES.pipeline_wrapper(pipeline)
    except ValueError as error:
        raise ValueError(f"xDiT Sampler has no adapter for {pipeline}: {error}") from None
    return FamilyAdapter(pipeline, wrapper.comfy, wrapper.all_tensor_inputs(), latent_scale,
                         tuple(wrapper.call_parameters), tuple(wrapper.shared_inputs))
