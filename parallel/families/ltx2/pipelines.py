"""LTX-2's pipeline wrapper: its video and audio shapes, its guidance terms and the scalars a job may set."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...call_parameters import CallParameter
from ...layout.config import LayoutError
from ...model_executor.pipeline import xFuserPipelineBaseWrapper
from ...model_executor.pipeline.img2img import linear_sigmas
from ..comfy_data import ComfyData
from .comfy_block_order import A2V_GATE, a2v_gate_reads_audio_timestep, v2a_reads_updated_video

DEFAULT_FRAMES = 121  # LTX2Pipeline.__call__'s num_frames for a model without a duration head
UPDATED_VIDEO = "v2a_reads_updated_video"  # a model call in ComfyUI >= 0.31's block order (comfy_block_order.py)


def _scale(what: str) -> CallParameter:
    return CallParameter(float, what, 0.0, 100.0)


class xFuserLTX2Pipeline(xFuserPipelineBaseWrapper):
    """`LTX2Pipeline`: video latents [B, 128, T', H/32, W/32] and audio latents [B, C, L, M] in their VAEs' own
    spaces (the pipeline normalises both with its VAEs' statistics on the way in and undoes it on the way out,
    so given and returned latents are in the same space, ComfyUI's), sampled together. Audio noise must be given
    as the video's is: a pipeline left to draw it would draw different noise on every rank."""

    comfy = ComfyData(
        latent_formats={128: "LTXAV"}, temporal=8, tokens="loop", audio_stream=("audio_latents", "audio"),
        vae_normalises=True, model_class="LTXAV", model_call_versions={UPDATED_VIDEO: "0.31.0"},
        # Model from xDiT Pool on a pipeline folder's pool: ComfyUI's text (its connectors run on the pool, per call)
        # and LTXVConditioning's frame rate
        model_call_conds={"context": "prompt_embeds", "frame_rate": "frame_rate"},
        conditioning_calls={"frame_rate": ("frame_rate", 25.0)},
        expects="Gemma's stacked hidden states as LTX2Pipeline's prompt_embeds, with prompt_attention_mask",
        empty_latent="EmptyLTXVLatentVideo and LTXVEmptyLatentAudio into LTXVConcatAVLatent",
    )
    tensor_inputs = ("audio_latents", "prompt_attention_mask", "negative_prompt_attention_mask")
    extra_outputs = ("audio",)  # LTX2PipelineOutput(frames, audio): the audio latents after the video latents
    guidance = ("guidance_scale", 3.0)
    default_sigmas = staticmethod(linear_sigmas)
    model_call_inputs = ("prompt_embeds", "audio_latents", "audio_sigma", "frame_rate", "token_sigmas", UPDATED_VIDEO,
                         A2V_GATE)
    model_call_required = ("prompt_embeds", "audio_latents", "audio_sigma")
    call_parameters = {
        "num_frames": CallParameter(int, "video frames, 8k+1 (default: as many as the latents hold)", 1, 10_000),
        "frame_rate": CallParameter(float, "frames a second (the audio's length and the video's time positions; "
                                    "default 24)", 1.0, 1000.0),
        "stg_scale": _scale("spatio-temporal guidance of the video (default 1; 0: off)"),
        "audio_stg_scale": _scale("spatio-temporal guidance of the audio (default: stg_scale)"),
        "stg_block": CallParameter(int, "the block spatio-temporal guidance perturbs (default 28, as LTX2Pipeline; a "
                                   "model with fewer blocks perturbs none, as in diffusers)", 0, 1000),
        "modality_scale": _scale("modality-isolation guidance of the video (default 3; 1: off)"),
        "audio_modality_scale": _scale("modality-isolation guidance of the audio (default: modality_scale)"),
        "audio_guidance_scale": _scale("classifier-free guidance of the audio (default 7)"),
        "guidance_rescale": CallParameter(float, "guidance rescale of the video (default 0.7)", 0.0, 1.0),
        "audio_guidance_rescale": CallParameter(float, "guidance rescale of the audio (default: guidance_rescale)", 0.0,
                                                1.0),
    }

    # -- model calls (ComfyUI's samplers): ComfyUI's LTXAV call on the loop's transformer ------------------
    def model_call_arguments(self, latents, timestep, inputs):
        """The loop's transformer call for video `latents` [B, 128, T', h, w] at `timestep` (sigma × 1000) and audio
        [B, C, L, M] at `audio_sigma` (each stream's own, as ComfyUI's LTXAV takes them), at `frame_rate` (25 where
        none is sent, as ComfyUI's). The text is ComfyUI's, [B, T, video width + audio width]: its text encoder already
        projected Gemma's states (the connectors' text_proj_in), so it goes through the connectors themselves as the
        pipeline's connectors call runs them, right-padded to the pipeline's 1024 tokens with their mask (the
        connectors' registers take the padding). Every sample's tokens are all real: ComfyUI's LTXAV keeps the text
        as CONDRegular, which batches only prompts of one length (cond and uncond of different lengths come as two
        calls), so its connectors append the registers after the same count of tokens in each row, as these do."""
        module, text = self.module, inputs["prompt_embeds"]
        connectors = module.connectors
        widths = (connectors.config.video_hidden_dim, connectors.config.audio_hidden_dim)
        if not connectors.config.per_modality_projections or text.shape[-1] != sum(widths):
            raise ValueError(f"prompt_embeds have width {text.shape[-1]}; a model call of this LTX-2 takes ComfyUI's "
                             f"LTX-2.3 text, its video and audio projections side by side ({widths[0]} + {widths[1]})")
        batch, _, frames, height, width = latents.shape
        padding = max(1024 - text.shape[1], 0)
        text = torch.cat([text, text.new_zeros(batch, padding, text.shape[2])], dim=1)
        valid = (torch.arange(text.shape[1], device=text.device) < text.shape[1] - padding).to(text.dtype)
        additive = ((valid - 1) * torch.finfo(text.dtype).max).reshape(1, 1, 1, -1).expand(batch, -1, -1, -1)
        video_text, video_mask = connectors.video_connector(text[..., :widths[0]], additive)
        mask = (video_mask < 1e-6).to(torch.int64).reshape(batch, -1)
        audio_text = connectors.audio_connector(text[..., widths[0]:], additive)[0]
        audio = inputs["audio_latents"]
        rate = float(inputs["frame_rate"].reshape(-1)[0]) if "frame_rate" in inputs else 25.0
        audio_timestep = inputs["audio_sigma"].to(timestep) * self.timestep_scale()
        transformer, (patch_t, patch) = module.transformer, self._patches()
        tokens = batch * frames * height * width // patch_t // patch**2
        timestep, sigma, cross = self._token_timesteps(timestep, inputs, tokens)
        coords = transformer.rope.prepare_video_coords(batch, frames, height, width, latents.device, fps=rate)
        return {**self._keyframes(transformer, coords), "hidden_states": module._pack_latents(latents, patch, patch_t),
                "audio_hidden_states": module._pack_audio_latents(audio),
                "encoder_hidden_states": video_text * mask[..., None], "audio_encoder_hidden_states": audio_text,
                "timestep": timestep, "sigma": sigma, "audio_timestep": audio_timestep, "audio_sigma": audio_timestep,
                "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask, "num_frames": frames,
                "height": height, "width": width, "fps": rate, "audio_num_frames": audio.shape[2],
                "video_coords": coords,
                "audio_coords": transformer.audio_rope.prepare_audio_coords(batch, audio.shape[2], latents.device),
                "use_cross_timestep": cross}

    @staticmethod
    def _keyframes(transformer, coords) -> dict:
        """LTX-2.5's learned keyframe marker where ComfyUI's LTXAV adds it on every call: the tokens whose pixel frames
        start at 0 (the first latent frame, a single pixel frame). diffusers adds it only where a mask is passed."""
        if not transformer.config.use_keyframes_abs_pos_embedding:
            return {}
        return {"video_keyframes_mask": (coords[:, 0, :, 0] == 0).to(coords.dtype)[..., None]}

    def _token_timesteps(self, timestep, inputs, tokens: int):
        """The call's video timesteps, prompt sigma and cross-timestep choice. One timestep: each, as LTX-2.3's loop
        passes them. `token_sigmas` [B, tokens] (a ComfyUI noise mask's per-token timesteps): those for the video's
        own modulation (split with its tokens), their largest for the prompt's, as ComfyUI's LTXAV takes them, and
        use_cross_timestep off, so the video's cross-modal scale and shift read each token's timestep and the audio's
        its own, as ComfyUI's do (the audio-to-video gate too, where ComfyUI's reads the audio's: `A2V_GATE`).
        The video-to-audio gate reads the audio sigma, ComfyUI's the largest: equal, av_calls refuses other masks."""
        if "token_sigmas" not in inputs:
            return timestep, timestep, True
        per_token = inputs["token_sigmas"].to(timestep) * self.timestep_scale()
        if per_token.ndim != 2 or per_token.numel() != tokens:
            raise ValueError(f"token_sigmas have shape {list(per_token.shape)}; send one per video token, "
                             f"[batch, {tokens // max(per_token.shape[0], 1)}]")
        return per_token, per_token.amax(dim=1), False

    def model_call_context(self, transformer, inputs):
        """ComfyUI >= 0.31's block order (each block's video-to-audio attention reads the video after that block's
        audio-to-video update) where the call's `v2a_reads_updated_video` [B] is 1, the reference's where it is 0 or
        not sent; ComfyUI's audio-to-video gate (the audio's timestep for every video token) where its
        `a2v_gate_reads_audio_timestep` [B] is 1 (av_calls sends it with `token_sigmas`)."""
        stack, module = contextlib.ExitStack(), transformer.module
        stack.enter_context(v2a_reads_updated_video(module, self._flag(inputs, UPDATED_VIDEO)))
        stack.enter_context(a2v_gate_reads_audio_timestep(module, self._flag(inputs, A2V_GATE)))
        return stack

    @staticmethod
    def _flag(inputs, name: str) -> bool:
        """A model call's on/off input [B]: one value for the call, 1 or 0 (not sent: 0)."""
        flag = inputs.get(name)
        values = set() if flag is None else set(flag.reshape(-1).tolist())
        if not values <= {0.0, 1.0} or len(values) > 1:
            raise ValueError(f"{name} holds {sorted(values)}: send one value per call, 1 (as ComfyUI's LTXAV "
                             "computes) or 0 (as diffusers' transformer does)")
        return values == {1.0}

    def model_call_outputs(self, outputs, latents, inputs):
        """The velocities shaped as the streams came: the video like `latents`, the audio (`audio`) like
        `audio_latents`."""
        video, audio = outputs
        shape = inputs["audio_latents"].shape
        patch_t, patch = self._patches()
        return {"prediction": self.module._unpack_latents(video.float(), *latents.shape[2:], patch, patch_t),
                "audio": self.module._unpack_audio_latents(audio.float(), shape[2], shape[3])}

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """As `LTX2Pipeline(prompt=...)` encodes it: Gemma's stacked hidden states, left-padded to 1024 tokens, and
        their mask."""
        embeds, mask, _, _ = self.module.encode_prompt(prompt, do_classifier_free_guidance=False,
                                                       device=self.module.transformer.device)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    # -- the loop's space: both VAEs' latents normalised by their statistics (ComfyUI's LTXAV latents) ------
    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The video the pipeline returns (denormalised: its VAE's space) normalised as its loop samples it."""
        vae = self.module.vae
        return self.module._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    def model_outputs(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        outputs = super().model_outputs(outputs)
        return {**outputs, "audio": self._audio(outputs["audio"], self.module._normalize_audio_latents)}

    def from_model_latents(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Normalised video and audio latents (ComfyUI's) denormalised, as the pipeline normalises what it is given."""
        vae, kwargs = self.module.vae, dict(kwargs)
        if isinstance(kwargs.get("latents"), torch.Tensor):
            kwargs["latents"] = self.module._denormalize_latents(kwargs["latents"], vae.latents_mean, vae.latents_std,
                                                                 vae.config.scaling_factor)
        if isinstance(kwargs.get("audio_latents"), torch.Tensor):
            kwargs["audio_latents"] = self._audio(kwargs["audio_latents"], self.module._denormalize_audio_latents)
        return kwargs

    def _audio(self, latents: torch.Tensor, change) -> torch.Tensor:
        """Audio latents [B, C, L, M] through one of the pipeline's statistics functions (on packed [B, L, C·M])."""
        audio_vae, pipeline = self.module.audio_vae, self.module
        packed = change(pipeline._pack_audio_latents(latents), audio_vae.latents_mean, audio_vae.latents_std)
        return pipeline._unpack_audio_latents(packed, latents.shape[2], latents.shape[3])

    # -- shapes: one token per latent pixel of each latent frame (patch 1 × 1 × 1) ------------------------
    def latent_scale(self) -> int:
        return self.module.vae_spatial_compression_ratio

    def _patches(self) -> tuple[int, int]:
        config = self.module.transformer.config
        return config.patch_size_t, config.patch_size

    def latent_frames(self, kwargs: dict[str, Any]) -> int:
        latents = kwargs.get("latents")
        if isinstance(latents, torch.Tensor) and latents.ndim == 5:
            return latents.shape[2]
        frames = kwargs.get("num_frames") or DEFAULT_FRAMES
        return (frames - 1) // self.module.vae_temporal_compression_ratio + 1

    def image_tokens(self, height: int, width: int) -> int:
        patch = self._patches()[1]
        return self.grid_tokens(height, width, self.module.vae_spatial_compression_ratio, patch, patch)

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        return self.latent_frames(kwargs) // self._patches()[0] * self.image_tokens(kwargs["height"], kwargs["width"])

    def token_rows(self, kwargs: dict[str, Any]) -> int:
        patch_t, patch = self._patches()
        return self.latent_frames(kwargs) // patch_t * (kwargs["height"] // (self.module.vae_spatial_compression_ratio * patch))

    def expected_latents_shape(self, batch: int, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        scale = self.module.vae_spatial_compression_ratio
        return (batch, self.module.transformer.config.in_channels, frames, height // scale, width // scale)

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        """Given latents define the frames (the audio's length follows num_frames). A pool of ComfyUI's diffusion-model
        file (file.py: connectors without the text projections) runs model calls only: its pipeline would have to
        project Gemma's states with weights the file lacks."""
        if getattr(self.module.connectors, "video_text_proj_in", True) is None:
            raise ValueError(f"{self.module.config._name_or_path} has no text projection (ComfyUI's LTX-2.3 "
                             "diffusion-model file: ComfyUI's text encoder holds it), so its pool takes model calls only; "
                             "to sample prompts on the pool load the whole checkpoint (ltx-2.3-*.safetensors), or sample "
                             "with ComfyUI's own text encoder and Load Diffusion Model (xDiT Pool)")
        latents = kwargs.get("latents")
        if kwargs.get("num_frames") is None and isinstance(latents, torch.Tensor) and latents.ndim == 5:
            kwargs = {**kwargs, "num_frames": (latents.shape[2] - 1) * self.module.vae_temporal_compression_ratio + 1}
        return super().prepare(kwargs, check_layout)

    def call_context(self, kwargs: dict[str, Any]):
        """STG's block, a call parameter, as the list the pipeline takes."""
        if "stg_block" in kwargs:
            kwargs["spatio_temporal_guidance_blocks"] = [kwargs.pop("stg_block")]
        return super().call_context(kwargs)

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        latents, audio = kwargs.get("latents"), kwargs.get("audio_latents")
        expected = self.expected_latents_shape(batch, kwargs["height"], kwargs["width"], self.latent_frames(kwargs))
        if isinstance(latents, torch.Tensor) and tuple(latents.shape) != expected:
            raise ValueError(f"latents have shape {list(latents.shape)} but LTX-2 at {kwargs['height']}x{kwargs['width']} "
                             f"needs [batch, channels, latent frames, height/32, width/32] = {list(expected)}")
        audio_vae, width = self.module.audio_vae, self.module.transformer.config.audio_in_channels
        bins = audio_vae.config.mel_bins // self.module.audio_vae_mel_compression_ratio
        if latents is not None and audio is None:
            raise ValueError("LTX-2 samples video and audio together: send audio_latents too, the audio's initial noise "
                             f"[batch, {audio_vae.config.latent_channels}, audio frames, {bins}]")
        if audio is not None and (audio.ndim != 4 or audio.shape[0] != batch
                                  or tuple(audio.shape[1::2]) != (audio_vae.config.latent_channels, bins)):
            raise ValueError(f"audio_latents have shape {list(audio.shape)}; this LTX-2 takes [batch {batch}, "
                             f"{audio_vae.config.latent_channels} channels, audio frames, {bins} mel bins]")
        text = self.module.connectors.config
        for name in ("prompt_embeds", "negative_prompt_embeds"):
            embeds = kwargs.get(name)
            if isinstance(embeds, torch.Tensor) and embeds.shape[-1] != text.caption_channels * text.text_proj_in_factor:
                raise ValueError(f"{name} have width {embeds.shape[-1]}; this LTX-2 takes its text encoder's "
                                 f"{text.text_proj_in_factor} hidden states of {text.caption_channels} stacked per token "
                                 f"({text.caption_channels * text.text_proj_in_factor})")
            if isinstance(embeds, torch.Tensor) and kwargs.get(name.replace("embeds", "attention_mask")) is None:
                raise ValueError(f"{name} need {name.replace('embeds', 'attention_mask')} ([batch, tokens], 1 for each "
                                 "valid token), as Gemma's tokenizer makes it")
        if self.uses_cfg(kwargs) and kwargs.get("prompt_embeds") is not None and kwargs.get("negative_prompt_embeds") is None:
            raise ValueError(f"guidance_scale {kwargs.get('guidance_scale')} guides with a negative prompt: send "
                             "negative_prompt_embeds and their mask, or set guidance_scale to 1")
        super().check_inputs({k: v for k, v in kwargs.items() if k != "latents"}, batch)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        c = self.parallel_config
        tokens = self.sequence_tokens(kwargs)
        if tokens < c.sp_degree:
            raise LayoutError(f"{self.latent_frames(kwargs)} latent frames at {kwargs['height']}x{kwargs['width']} give "
                              f"{tokens} video tokens, fewer than the sequence-parallel degree {c.sp_degree}; lower the "
                              "degrees or sample a larger video")
        return super().check_layout(kwargs, batch)

    def partial_denoise(self, kwargs: dict[str, Any], init_latents: torch.Tensor, denoise: float) -> dict[str, Any]:
        raise ValueError("denoise below 1 is not available for LTX-2 yet (its audio would need noising to the same "
                         "point); sample with denoise 1")

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return (f"CFG parallel on LTX-2 splits its [negative, positive] batch, which it makes for guidance_scale above 1 "
                f"(got {kwargs.get('guidance_scale', 3.0)}); set one, or turn CFG parallel off.")


class xFuserLTX2ImageToVideoPipeline(xFuserLTX2Pipeline):
    """`LTX2ImageToVideoPipeline` given its latents: their first latent frame holds the start image's VAE encoding (as
    ComfyUI's LTXVImgToVideoInplace puts it there), which the pipeline keeps clean (a timestep of 0 for its tokens:
    per-token timesteps, split with the video tokens); with latents given the pipeline encodes no image itself."""



CONDITION_INPUTS = ("condition_images", "condition_indices", "condition_strengths")


class xFuserLTX2ConditionPipeline(xFuserLTX2Pipeline):
    """`LTX2ConditionPipeline`: pictures (or clips) held at chosen latent frames. diffusers' pipeline takes them only as
    pixels (`LTX2VideoCondition`), so a job sends pixels and every rank encodes them with the pipeline's VAE (at its
    mode: alike on every rank): `condition_images` [N, 3, H, W] (or clips [N, F, 3, H, W]) in 0..255,
    `condition_indices` [N] latent frames (whole numbers as floats, as contract E's tensors are; negative: from the
    end), `condition_strengths` [N] in [0, 1]. A condition at frame 0 overwrites the first frame's tokens; any other is
    appended as tokens of its own with its positions, which split with the video's as its per-token timesteps do.
    Images are H.264-compressed on the client if at all (ComfyUI's LTXVPreprocess): the ranks pass crf 0. Given
    latents are the initial noise as they are (noise_scale 0), not noised again by a generator each rank would draw
    differently."""

    tensor_inputs = xFuserLTX2Pipeline.tensor_inputs + CONDITION_INPUTS
    shared_inputs = CONDITION_INPUTS  # every sample of a batch gets every condition, as in diffusers
    call_defaults = {"noise_scale": 0.0}

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        images, indices, strengths = (kwargs.get(name) for name in CONDITION_INPUTS)
        if images is not None or indices is not None or strengths is not None:
            if images is None or indices is None or strengths is None:
                raise ValueError("LTX-2 conditions need all three of condition_images [N, 3, H, W], condition_indices "
                                 "[N] and condition_strengths [N]; send the missing ones")
            count, frames = len(images), self.latent_frames(kwargs)
            if images.ndim not in (4, 5) or images.shape[-3] != 3:
                raise ValueError(f"condition_images have shape {list(images.shape)}; send RGB pictures [N, 3, H, W] or "
                                 "clips [N, frames, 3, H, W] in 0..255")
            if tuple(indices.shape) != (count,) or tuple(strengths.shape) != (count,):
                raise ValueError(f"{count} condition_images need condition_indices and condition_strengths of shape "
                                 f"[{count}], got {list(indices.shape)} and {list(strengths.shape)}")
            if not all(float(i).is_integer() and -frames <= int(i) < frames for i in indices):
                raise ValueError(f"condition_indices {indices.tolist()} are latent frames of a video of {frames}; "
                                 f"send whole numbers in [-{frames}, {frames - 1}]")
            if not all(0.0 <= float(s) <= 1.0 for s in strengths):
                raise ValueError(f"condition_strengths {strengths.tolist()} must lie in [0, 1]")
        super().check_inputs(kwargs, batch)

    def call_context(self, kwargs: dict[str, Any]):
        """The condition tensors as the `LTX2VideoCondition`s the pipeline takes."""
        from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

        images, indices, strengths = (kwargs.pop(name, None) for name in CONDITION_INPUTS)
        if images is not None:
            kwargs["conditions"] = [LTX2VideoCondition(frames=image.float(), index=int(index), strength=float(strength),
                                                       crf=0) for image, index, strength in zip(images, indices, strengths)]
        return super().call_context(kwargs)


REFERENCE_INPUTS = ("reference_videos", "reference_strengths")
ATTENTION_MASK = "conditioning_attention_mask"


class xFuserLTX2InContextPipeline(xFuserLTX2ConditionPipeline):
    """`LTX2InContextPipeline` (IC-LoRA): the condition pipeline's pictures, and reference videos encoded on every rank
    and appended to the video's tokens (with their own positions and per-token timesteps: split as the keyframes are).
    A job sends `reference_videos` [R, F, 3, H, W] in 0..255 (F = 8k + 1) and `reference_strengths` [R] in [0, 1].
    `conditioning_attention_strength` below 1, or a pixel mask `conditioning_attention_mask` [1, 1, F, H, W] in [0, 1],
    weakens how the references and the video attend to each other: the pipeline's [tokens × tokens] mask in the video's
    self-attention, which the plan carries (ParallelPlan.attention_masks)."""

    tensor_inputs = xFuserLTX2ConditionPipeline.tensor_inputs + REFERENCE_INPUTS + (ATTENTION_MASK,)
    shared_inputs = xFuserLTX2ConditionPipeline.shared_inputs + REFERENCE_INPUTS + (ATTENTION_MASK,)
    call_parameters = {**xFuserLTX2ConditionPipeline.call_parameters, "conditioning_attention_strength": CallParameter(
        float, "how strongly the reference videos and the video attend to each other (default 1: fully)", 0.0, 1.0)}

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        videos, strengths = (kwargs.get(name) for name in REFERENCE_INPUTS)
        if (videos is None) != (strengths is None):
            raise ValueError("LTX-2 reference videos need both reference_videos [R, F, 3, H, W] and reference_strengths "
                             "[R]; send the missing one")
        if videos is not None:
            if videos.ndim != 5 or videos.shape[2] != 3 or (videos.shape[1] - 1) % 8:
                raise ValueError(f"reference_videos have shape {list(videos.shape)}; send RGB clips [R, F, 3, H, W] of "
                                 "8k + 1 frames in 0..255")
            if tuple(strengths.shape) != (len(videos),) or not all(0.0 <= float(s) <= 1.0 for s in strengths):
                raise ValueError(f"{len(videos)} reference_videos need reference_strengths [{len(videos)}] in [0, 1], "
                                 f"got {strengths.tolist()}")
        mask = kwargs.get(ATTENTION_MASK)
        if mask is not None and (videos is None or mask.ndim != 5 or tuple(mask.shape[:2]) != (1, 1)
                                 or tuple(mask.shape[2:]) != tuple(videos.shape[1:2]) + tuple(videos.shape[3:])):
            raise ValueError(f"{ATTENTION_MASK} has shape {list(mask.shape)}; send [1, 1, F, H, W] in [0, 1], the "
                             "reference videos' frames and pixels, with reference_videos")
        super().check_inputs(kwargs, batch)

    def call_context(self, kwargs: dict[str, Any]):
        """The reference tensors as the `LTX2ReferenceCondition`s the pipeline takes (frames in 0..1, as its video
        processor reads tensors)."""
        from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition

        videos, strengths = (kwargs.pop(name, None) for name in REFERENCE_INPUTS)
        if videos is not None:
            kwargs["reference_conditions"] = [
                LTX2ReferenceCondition(frames=video.float() / 255, strength=float(strength))
                for video, strength in zip(videos, strengths)]
        return super().call_context(kwargs)
