"""MiniMax-H3's modular pipeline wrapper: its packed sequence's size, its stereo audio per sample, one video per call."""

from __future__ import annotations

from typing import Any

import torch

from ...call_parameters import CallParameter
from ...layout.config import LayoutError
from ...model_executor.pipeline.modular import xFuserModularPipelineWrapper
from ..comfy_data import ComfyData

COMFY = ComfyData(
    latent_formats={24: "MiniMaxH3AV"}, temporal=4, audio_stream=("audio_latents", "audio"), audio_axes=(0, 2, 1, 3),
    conditioning_inputs={"minimax_token_tags": "text_token_tags"}, derives_frames=True,
    expects="the MiniMax-H3 text encoder's hidden states (Qwen3-VL's layer 50) with their modality tags",
    empty_latent="EmptyMiniMaxH3LatentAV",
)


class xFuserMiniMaxH3Pipeline(xFuserModularPipelineWrapper):
    """`MiniMaxH3ModularPipeline`, text to video with sound (its `t2va` blocks): video noise [B, 24, T', H/16, W/16]
    and audio noise [B, 2, 32, L] (a sample's two stereo channels, as the pipeline takes them as two batch items), the
    text encoder's hidden states [B, T, text_dim] and their modality tags [T] (shared: the batch has one packed layout).
    The pipeline samples one video per call: a batch goes one sample per data-parallel rank. Guidance is distilled into
    the weights: one transformer call per step, no negative prompt, nothing for CFG parallel to split. Its scheduler
    counts the final step: `num_inference_steps` 4 are 3 transformer calls."""

    comfy = COMFY
    sampling_blocks = ("denoise",)
    guider_arguments = ()
    state_outputs = ("latents", "audio_latents")
    extra_outputs = ("audio",)  # the audio latents [B, 2, 32, L], as given
    tensor_inputs = ("audio_latents", "text_token_tags")
    shared_inputs = ("text_token_tags",)
    embedding_sizes = {"prompt_embeds": "text_dim"}
    call_parameters = {
        "num_frames": CallParameter(int, "video frames at 24 fps, 17n+5 from 5 to 15 s (default: as many as the latents "
                                    "hold)", 1, 10_000),
    }

    # -- shapes ------------------------------------------------------------------------------------------
    def latent_scale(self) -> int:
        return self.module.vae_spatial_compression_ratio

    def latent_frames(self, kwargs: dict[str, Any]) -> int:
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames, video_latent_num_frames

        latents = kwargs.get("latents")
        if isinstance(latents, torch.Tensor) and latents.ndim == 5:
            return latents.shape[2]
        chunk, kept = self.module.vae_frames_per_chunk, self.module.vae_latents_per_chunk
        return video_latent_num_frames(align_num_frames(kwargs.get("num_frames") or 124, chunk, kept), chunk, kept)

    def image_tokens(self, height: int, width: int) -> int:
        _, patch_h, patch_w = self.module.patch_size
        return self.grid_tokens(height, width, self.latent_scale(), patch_h, patch_w)

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        """The packed sequence's rows: the text's, the audio's (both channels) and the video's."""
        text = kwargs.get("prompt_embeds")
        audio = kwargs.get("audio_latents")
        text_rows = text.shape[1] if isinstance(text, torch.Tensor) else 0
        audio_rows = audio.shape[1] * audio.shape[3] if isinstance(audio, torch.Tensor) and audio.ndim == 4 else 0
        return text_rows + audio_rows + self.latent_frames(kwargs) * self.image_tokens(kwargs["height"], kwargs["width"])

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        """Given latents define the frames (5n+2 latent frames: 17n+5 frames)."""
        latents = kwargs.get("latents")
        if kwargs.get("num_frames") is None and isinstance(latents, torch.Tensor) and latents.ndim == 5:
            chunk, kept = self.module.vae_frames_per_chunk, self.module.vae_latents_per_chunk
            kwargs = {**kwargs, "num_frames": (latents.shape[2] - 2) // kept * chunk + kept}
        return super().prepare(kwargs, check_layout)

    def expected_latents_shape(self, batch: int, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        scale = self.latent_scale()
        return (batch, self.module.vae_latent_channels, frames, height // scale, width // scale)

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        latents, audio, text = kwargs.get("latents"), kwargs.get("audio_latents"), kwargs.get("prompt_embeds")
        scale, channels = self.latent_scale(), self.module.vae_latent_channels
        expected = self.expected_latents_shape(batch, kwargs["height"], kwargs["width"], self.latent_frames(kwargs))
        if isinstance(latents, torch.Tensor) and tuple(latents.shape) != expected:
            raise ValueError(f"latents have shape {list(latents.shape)} but MiniMax-H3 at {kwargs['height']}x"
                             f"{kwargs['width']} needs [batch, {channels}, latent frames, height/{scale}, width/{scale}] "
                             f"= {list(expected)}")
        audio_channels = self.module.audio_latent_channels
        if latents is not None and audio is None:
            raise ValueError("MiniMax-H3 samples video and audio together: send audio_latents too, the audio's initial "
                             f"noise [batch, 2 stereo channels, {audio_channels}, audio latents]")
        if audio is not None and (audio.ndim != 4 or audio.shape[:3] != (batch, 2, audio_channels)):
            raise ValueError(f"audio_latents have shape {list(audio.shape)}; MiniMax-H3 takes [batch {batch}, 2 stereo "
                             f"channels, {audio_channels}, audio latents]")
        tags = kwargs.get("text_token_tags")
        if isinstance(text, torch.Tensor) and (tags is None or tags.shape != text.shape[1:2]):
            raise ValueError(f"prompt_embeds of {text.shape[1]} tokens need text_token_tags [{text.shape[1]}], each "
                             "token's modality (1: text, 0: a keyframe's vision tokens), as the text encoder gives them")
        super().check_inputs({k: v for k, v in kwargs.items() if k != "latents"}, batch)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        most = max(self.parallel_config.batch_split(batch) or [batch])  # the samples of the busiest rank
        if most > 1:
            raise LayoutError(f"MiniMax-H3 samples one video per call and this batch of {batch} gives {most} to a rank: "
                              f"use a data-parallel degree of {batch}, or one video per job")
        return super().check_layout(kwargs, batch)

    def step_callbacks(self, step_callback):
        """Previews see the video: the loop keeps it as patch rows [T'·h/2·w/2, 24·2·2], handed back as the sample's
        latents [1, 24, T', h, w] (the call's one sample; the shape is the running call's, set by run_pipeline)."""
        def as_video(index: int, rows: torch.Tensor) -> None:
            step_callback(index, unpatchify_video_rows(rows, self._video_shape, self.module.patch_size))

        return super().step_callbacks(as_video)

    def run_pipeline(self, arguments: dict[str, Any]):
        """The call's one sample: its audio as the pipeline's two stereo batch items, and back."""
        self._video_shape = self.expected_latents_shape(1, arguments["height"], arguments["width"],
                                                        self.latent_frames(arguments))
        audio = arguments.get("audio_latents")
        if isinstance(audio, torch.Tensor):
            arguments = {**arguments, "audio_latents": audio[0]}
        latents, audio = super().run_pipeline({**arguments, "return_dict": False})
        return latents, audio[None]

    def partial_denoise(self, kwargs: dict[str, Any], init_latents: torch.Tensor, denoise: float) -> dict[str, Any]:
        raise ValueError("denoise below 1 is not available for MiniMax-H3 (its blocks noise no given video); sample "
                         "with denoise 1")

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return ("MiniMax-H3 is guidance-distilled: one transformer call per step, no unconditional branch for CFG "
                "parallel to split; turn CFG parallel off (use its degree for Ulysses, Ring or data parallel)")


def unpatchify_video_rows(rows: torch.Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of diffusers' `patchify_video_latents`: rows [B·t·h·w, C·pt·ph·pw] (frame-major, then row-major) as
    latents `shape` [B, C, T', H, W]."""
    batch, channels, frames, height, width = shape
    pt, ph, pw = patch
    rows = rows.reshape(batch, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(shape)
