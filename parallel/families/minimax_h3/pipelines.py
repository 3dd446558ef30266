"""MiniMax-H3's modular pipeline wrapper: its packed sequence's size, its stereo audio per sample, one video per call,
its keyframe workflow (fl2va) from encoded keyframes and its reference workflow (ref2va) from encoded references."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...call_parameters import CallParameter
from ...layout.config import LayoutError
from ...model_executor.pipeline.modular import xFuserModularPipelineWrapper
from ..base import references
from ..comfy_data import ComfyData

ANCHORS = ("first", "last")  # `keyframe_anchors` on the wire: 0 anchors a keyframe at the first latent frame, 1 the last
# `reference_kinds` on the wire (ref2va), one per reference in the order the model reads them
REFERENCE_KINDS = ("image", "video", "video with its soundtrack", "audio")


@dataclass(frozen=True)
class EncodedReference:
    """A reference as ref2va's layout reads it, its modality alone: the job sends the media encoded (the pool holds
    no VAE), where diffusers' MiniMaxH3*Reference hold the media."""

    kind: str  # "image", "video" or "audio"
    has_audio: bool


COMFY = ComfyData(
    latent_formats={24: "MiniMaxH3AV"}, temporal=4, audio_stream=("audio_latents", "audio"), audio_axes=(0, 2, 1, 3),
    conditioning_inputs={"minimax_token_tags": "text_token_tags"}, derives_frames=True,
    expects="the MiniMax-H3 text encoder's hidden states (Qwen3-VL's layer 50) with their modality tags",
    empty_latent="EmptyMiniMaxH3LatentAV", model_class="MiniMaxH3",
    # ComfyUI's model call: the text (its model refines it itself, as the pool's does), the tags and the t2va payload
    # (the seed and the prebuilt layout: the pool builds its own), fl2va's keyframes, which travel noised as
    # condition_latents (nodes/av_calls.py: MiniMaxH3ImageToVideo's first/last frame), and ref2va's references
    # (MiniMaxH3ReferenceToVideo's), which travel in ref2va's wire form (reference_kinds, ...)
    model_call_conds={"context": "prompt_embeds", "minimax_payload.text_token_tags": "text_token_tags",
                      "minimax_payload.seed": "", "minimax_payload.layout": "", "minimax_payload.audio_scale": "",
                      "minimax_payload.keyframes": "", "minimax_payload.frame_count": "",
                      "minimax_payload.cond_video_latents": "", "minimax_payload.refs": "",
                      "minimax_payload.cond_audio_latents": ""},
    keyframes="minimax_payload",
    audio_shifts=(("minimax_h3_sigma_shift_video", 12.0), ("minimax_h3_sigma_shift_audio", 3.0)),
    audio_scale="minimax_payload.audio_scale", vae_normalises=True,  # ComfyUI's VAEs denormalise inside decode
)


class xFuserMiniMaxH3Pipeline(xFuserModularPipelineWrapper):
    """`MiniMaxH3ModularPipeline`, text to video with sound (its `t2va` blocks): video noise [B, 24, T', H/16, W/16]
    and audio noise [B, 2, 32, L] (a sample's two stereo channels, as the pipeline takes them as two batch items), the
    text encoder's hidden states [B, T, text_dim] and their modality tags [T] (shared: the batch has one packed layout).
    The pipeline samples one video per call: a batch goes one sample per data-parallel rank. Guidance is distilled into
    the weights: one transformer call per step, no negative prompt, nothing for CFG parallel to split. Its scheduler
    counts the final step: `num_inference_steps` 4 are 3 transformer calls.

    First/last keyframe to video with sound (its `fl2va` blocks) when the job sends its keyframes encoded (the pool
    encodes none): `condition_latents` [B, 24, Σ t·h·w] with `condition_sizes` [B, N, 3] (each keyframe's (1, H/16,
    W/16); the flattened-and-joined list form of `reference_latents`) and `keyframe_anchors` [B, N] (0: the first
    frame, 1: the last). The pipeline noises each keyframe with a draw from the call's generator, before anything else:
    every rank builds that generator from the job's `seed`, so every rank draws what one process would.

    Reference to video with sound (its `ref2va` blocks, run on its `transformer_ref` partition) when the job sends
    `reference_kinds` [B, R] (REFERENCE_KINDS: 0 image, 1 video, 2 video with its soundtrack, 3 audio; the order is the
    model's reading order), the image and video references encoded in the same form as the keyframes,
    `condition_latents` [B, 24, Σ t·h·w] with `condition_sizes` [B, N, 3] (each at its own size; an image one latent
    frame), and the soundtrack and audio references as `audio_condition_latents` [B, 32, Σ rows] with
    `audio_condition_sizes` [B, M, 1] (each one's rows: 2 per audio latent, channel-major, as diffusers packs them).
    Kinds and sizes may come as floats of whole values, as a pool's wire takes every tensor but masks and tags."""

    comfy = COMFY
    sampling_blocks = ("denoise",)
    workflows = {"normalized_references": ("denoise.ref2va",), "condition_latents": ("denoise.fl2va",)}
    guider_arguments = ()
    state_outputs = ("latents", "audio_latents")
    extra_outputs = ("audio",)  # the audio latents [B, 2, 32, L], as given
    tensor_inputs = ("audio_latents", "text_token_tags", "condition_latents", "condition_sizes", "keyframe_anchors",
                     "reference_kinds", "audio_condition_latents", "audio_condition_sizes")
    shared_inputs = ("text_token_tags",)
    embedding_sizes = {"prompt_embeds": "text_dim"}
    model_call_inputs = ("prompt_embeds", "text_token_tags", "audio_latents", "audio_sigma", "condition_latents",
                         "condition_sizes", "keyframe_anchors", "reference_kinds", "audio_condition_latents",
                         "audio_condition_sizes")
    model_call_required = ("prompt_embeds", "audio_latents", "audio_sigma")
    call_parameters = {
        "num_frames": CallParameter(int, "video frames at 24 fps, 17n+5 from 5 to 15 s (default: as many as the latents "
                                    "hold)", 1, 10_000),
        "seed": CallParameter(int, "the generator the pipeline draws the keyframes' or references' conditioning noise "
                              "from (fl2va, ref2va; default 0), torch.Generator().manual_seed(seed) on every rank", 0,
                              2**63 - 1),
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
        """The packed sequence's rows: the text's, the keyframes' or references' (each latent frame's patches, and a
        reference's audio rows), the audio's (both channels) and the video's."""
        text = kwargs.get("prompt_embeds")
        audio = kwargs.get("audio_latents")
        text_rows = text.shape[1] if isinstance(text, torch.Tensor) else 0
        audio_rows = audio.shape[1] * audio.shape[3] if isinstance(audio, torch.Tensor) and audio.ndim == 4 else 0
        _, patch_h, patch_w = self.module.patch_size
        sizes, audio_sizes = kwargs.get("condition_sizes"), kwargs.get("audio_condition_sizes")
        condition_rows = 0 if sizes is None else sum(int(t) * (int(h) // patch_h) * (int(w) // patch_w)
                                                     for t, h, w in sizes[0].tolist())
        condition_rows += 0 if audio_sizes is None else int(audio_sizes[0].sum())
        video_rows = self.latent_frames(kwargs) * self.image_tokens(kwargs["height"], kwargs["width"])
        return text_rows + condition_rows + audio_rows + video_rows

    def keyframe_anchors(self, kwargs: dict[str, Any]) -> tuple[str, ...]:
        """The first sample's anchors as the pipeline names them (the call's one sample, once split)."""
        anchors = kwargs.get("keyframe_anchors")
        return () if anchors is None else tuple(ANCHORS[int(a)] for a in anchors.reshape(anchors.shape[0], -1)[0])

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
        if kwargs.get("reference_kinds") is None and kwargs.get("audio_condition_latents") is not None:
            raise ValueError("audio_condition_latents are ref2va references' audio rows: send reference_kinds [batch, "
                             "R] too, each reference's kind in reading order (0 image, 1 video, 2 video with its "
                             "soundtrack, 3 audio)")
        if kwargs.get("reference_kinds") is None:
            self.check_keyframes(kwargs, batch)
        else:
            self.check_references(kwargs, batch)
        super().check_inputs({k: v for k, v in kwargs.items() if k != "latents"}, batch)

    def check_keyframes(self, kwargs: dict[str, Any], batch: int) -> None:
        """fl2va's keyframes: one latent frame of the video's size each, with one anchor each."""
        conditions, anchors = kwargs.get("condition_latents"), kwargs.get("keyframe_anchors")
        if conditions is None and anchors is None:
            return
        scale, channels = self.latent_scale(), self.module.vae_latent_channels
        frame = (1, kwargs["height"] // scale, kwargs["width"] // scale)
        if conditions is None or anchors is None or anchors.shape[:1] != (batch,) or anchors.ndim != 2:
            raise ValueError("MiniMax-H3's keyframes (fl2va) are condition_latents [batch, 24, Σ t·h·w] with "
                             "condition_sizes [batch, N, 3] and keyframe_anchors [batch, N] (0: first frame, 1: last)")
        keyframes = references(kwargs, "condition_latents", "condition_sizes")
        sizes = [tuple(k.shape[2:]) for k in keyframes]
        if (conditions.shape[:2] != (batch, channels) or len(keyframes) != anchors.shape[1]
                or any(size != frame for size in sizes) or not set(anchors.flatten().tolist()) <= {0, 1}):
            raise ValueError(f"condition_latents {list(conditions.shape)} of sizes {[list(s) for s in sizes]} with "
                             f"keyframe_anchors {anchors.tolist()}: MiniMax-H3 at {kwargs['height']}x"
                             f"{kwargs['width']} takes keyframes of {channels} channels and size {list(frame)} (one "
                             "latent frame of the video), each with its anchor, 0 (first frame) or 1 (last)")

    def check_references(self, kwargs: dict[str, Any], batch: int) -> None:
        """ref2va's references: a known kind each, as many video latents as image and video references (an image one
        latent frame), as many audio row blocks (even: two channels) as references with audio, not audio alone."""
        kinds = kwargs["reference_kinds"]
        usage = ("MiniMax-H3's references (ref2va) are reference_kinds [batch, R] (0 image, 1 video, 2 video with its "
                 "soundtrack, 3 audio) with condition_latents [batch, 24, Σ t·h·w] and condition_sizes "
                 "[batch, N, 3] for each image and video, audio_condition_latents [batch, 32, Σ rows] and "
                 "audio_condition_sizes [batch, M, 1] (2 rows per audio latent) for each soundtrack and audio; at "
                 "least one image or video")
        if (kinds.ndim != 2 or kinds.shape[0] != batch or kwargs.get("keyframe_anchors") is not None
                or not set(kinds.flatten().tolist()) <= set(range(len(REFERENCE_KINDS)))):
            raise ValueError(f"reference_kinds {kinds.tolist()}: {usage}; keyframe_anchors (fl2va) do not go with them")
        visuals = references(kwargs, "condition_latents", "condition_sizes")
        sounds = references(kwargs, "audio_condition_latents", "audio_condition_sizes")
        names = [REFERENCE_KINDS[int(k)] for k in kinds[0]]
        seen = [name for name in names if name != "audio"]  # the references with video latents, in order
        if ((len(seen), sum(name in REFERENCE_KINDS[2:] for name in names)) != (len(visuals), len(sounds)) or not seen
                or any(v.shape[:2] != (batch, self.module.vae_latent_channels) for v in visuals)
                or any(v.shape[2] != 1 for v, name in zip(visuals, seen) if name == "image")
                or any(s.shape[:2] != (batch, self.module.audio_latent_channels) or s.shape[2] % 2 for s in sounds)):
            raise ValueError(f"references {names} with {len(visuals)} video latents of shapes "
                             f"{[list(v.shape) for v in visuals]} and {len(sounds)} audio row blocks of shapes "
                             f"{[list(s.shape) for s in sounds]}: {usage}")

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        most = max(self.parallel_config.batch_split(batch) or [batch])  # the samples of the busiest rank
        if most > 1:
            raise LayoutError(f"MiniMax-H3 samples one video per call and this batch of {batch} gives {most} to a rank: "
                              f"use a data-parallel degree of {batch}, or one video per job")
        return super().check_layout(kwargs, batch)

    def step_callbacks(self, step_callback):
        """Previews see the video: the loop keeps it as patch rows [T'·h/2·w/2, 24·2·2] (after fl2va's keyframe rows),
        handed back as the sample's latents [1, 24, T', h, w] (the call's one sample; the shape is the running call's,
        set by run_pipeline)."""
        patch = self.module.patch_size

        def as_video(index: int, rows: torch.Tensor) -> None:
            generated = rows[rows.shape[0] - math.prod(self._video_shape[2:]) // math.prod(patch):]
            step_callback(index, unpatchify_video_rows(generated, self._video_shape, patch))

        return super().step_callbacks(as_video)

    def run_pipeline(self, arguments: dict[str, Any]):
        """The call's one sample: its audio as the pipeline's two stereo batch items, and back; its keyframes as the
        pipeline's list of latents and anchor names, or its references as its lists of latents and of audio rows with
        each one's kind; the generator from the seed, alike on every rank."""
        self._video_shape = self.expected_latents_shape(1, arguments["height"], arguments["width"],
                                                        self.latent_frames(arguments))
        call = {k: v for k, v in arguments.items()
                if k not in ("seed", "condition_sizes", "reference_kinds", "audio_condition_sizes")}
        call["generator"] = torch.Generator().manual_seed(arguments.get("seed", 0))
        if isinstance(arguments.get("audio_latents"), torch.Tensor):
            call["audio_latents"] = arguments["audio_latents"][0]
        if arguments.get("condition_latents") is not None:
            call["condition_latents"] = references(arguments, "condition_latents", "condition_sizes")
        if arguments.get("reference_kinds") is not None:
            call["normalized_references"] = encoded_references(arguments["reference_kinds"])
            call["audio_condition_latents"] = [rows[0].T for rows in references(
                arguments, "audio_condition_latents", "audio_condition_sizes")]
        elif arguments.get("condition_latents") is not None:
            call["keyframe_anchors"] = self.keyframe_anchors(arguments)
        latents, audio = super().run_pipeline({**call, "return_dict": False})
        return latents, audio[None]

    # -- model calls (ComfyUI's samplers) ------------------------------------------------------------------
    def timestep_scale(self) -> float:
        return 1.0  # its scheduler's timesteps are 1 − sigma: the call's arguments take sigma as it is

    def model_call_arguments(self, latents, timestep, inputs):
        """The loop's transformer call for one video [1, 24, T', h, w] at video sigma `timestep` [1] and its audio
        [1, 2, 32, L] at `audio_sigma` [1] (each stream's own schedule, as the pipeline's two schedulers give them):
        the layout the pipeline builds, the text's modality tags [1, T] (all text where none are sent); fl2va's
        keyframes, sent noised as the rows take them (`condition_latents`, `condition_sizes`, `keyframe_anchors`),
        in front of the video rows at the anchors' times, held at t = max(t, 0.999) as the pipeline holds them; or
        ref2va's references (`reference_kinds`, ...: its layout, the image and video rows held so too, the
        soundtracks' and audio clips' rows clean, at t = 1, in front of the audio rows)."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep, \
            MiniMaxH3Ref2VAPrepareLayoutStep, MiniMaxH3SetTimestepsStep, patchify_video_latents

        if latents.shape[0] != 1:
            raise ValueError(f"a MiniMax-H3 model call takes one video (batch 1, as ComfyUI's own model), not "
                             f"{latents.shape[0]}")
        module, text, audio = self.module, inputs["prompt_embeds"], inputs["audio_latents"][0]
        tags = inputs.get("text_token_tags")
        tags = torch.ones(text.shape[1], dtype=torch.long) if tags is None else tags[0].long().cpu()
        _, _, frames, height, width = latents.shape
        scale = self.latent_scale()
        size = {**inputs, "height": height * scale, "width": width * scale}
        kinds, sounds = inputs.get("reference_kinds"), []
        if kinds is None:
            self.check_keyframes(size, 1)
            anchors = self.keyframe_anchors(inputs)
            conditions = references(inputs, "condition_latents", "condition_sizes") if anchors else []
            layout = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                tags, frames, height, width, audio.shape[-1], module.patch_size, module.audio_channels,
                module.audio_tag, module.video_tag, anchors)
        else:
            self.check_references(size, 1)
            conditions = references(inputs, "condition_latents", "condition_sizes")
            sounds = [rows[0].T for rows in references(inputs, "audio_condition_latents", "audio_condition_sizes")]
            layout = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
                tags, encoded_references(kinds), conditions, sounds, frames, height, width, audio.shape[-1],
                module.patch_size, module.audio_channels, module.audio_tag, module.video_tag)
        positions, token_tags, video, audio_rows, text_rows, condition_rows, sound_rows = layout
        t, audio_t = 1.0 - float(timestep[0]), 1.0 - float(inputs["audio_sigma"][0])
        steps, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video, audio_rows, condition_rows, sound_rows, text_rows.numel(), t, audio_t,
            max(t, module.keyframe_noise_aug), 1.0)
        rows = [patchify_video_latents(frame.float(), module.patch_size) for frame in [*conditions, latents]]
        target = audio.float().permute(0, 2, 1).reshape(-1, audio.shape[1])
        device = latents.device
        return {"hidden_states": torch.cat(rows)[None],
                "audio_hidden_states": torch.cat([*(s.float().to(target.device) for s in sounds), target])[None],
                "encoder_hidden_states": text, "timestep": steps.to(device), "timestep_indices": indices.to(device),
                "token_tags": token_tags.to(device), "position_ids": positions.to(device), "video_indices": video.to(device),
                "audio_indices": audio_rows.to(device), "text_indices": text_rows.to(device)}

    def model_call_expert(self, expert: str, inputs: dict[str, torch.Tensor]) -> str:
        """A reference call runs on `transformer_ref`, as ref2va's loop does, where the pool holds that partition (a
        diffusers directory); a single file's pool holds the one transformer ComfyUI's own model runs them on."""
        if inputs.get("reference_kinds") is not None and getattr(self.module, "transformer_ref", None) is not None:
            return "transformer_ref"
        return expert

    def model_call_outputs(self, outputs, latents, inputs):
        """The velocities as every model call gives them, d/dsigma (the transformer's are along t = 1 − sigma): the
        video shaped like `latents` (its generated rows: the keyframes' or references' come first), the audio
        (`audio`) like `audio_latents` (its generated rows: the references' sounds come first)."""
        video, audio = outputs
        shape, patch = inputs["audio_latents"].shape, self.module.patch_size
        generated = video[0, video.shape[1] - math.prod(latents.shape[2:]) // math.prod(patch):]
        return {"prediction": -unpatchify_video_rows(generated, tuple(latents.shape), patch),
                "audio": -audio[0, audio.shape[1] - shape[1] * shape[3]:].reshape(shape[1], shape[3], shape[2])
                .transpose(1, 2)[None]}

    # -- decode (a pool's decode job), as the pipeline's decode steps do it ------------------------------------
    def to_vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The video latents as the pipeline returns them (normalised: ComfyUI's MiniMaxH3 LATENT) denormalised by the
        VAE's statistics, as its video decode step does before `vae.decode`."""
        mean, std = self._statistics(self._vae("vae"), latents, 5)
        return latents * std + mean

    def from_vae_sample(self, sample: torch.Tensor) -> torch.Tensor:
        """The VAE's ImageNet-normalised RGB reverted and clamped to [0, 1] as the video decode step does, on the
        pool's [-1, 1] scale."""
        view = (1, -1, 1, 1, 1)
        mean = torch.tensor(self.module.pixel_mean, device=sample.device).view(view)
        std = torch.tensor(self.module.pixel_std, device=sample.device).view(view)
        return (sample.float() * std + mean).clamp(0, 1) * 2 - 1

    def check_audio_latents(self, audio: torch.Tensor) -> None:
        self._vae("audio_vae")
        channels = self.module.audio_latent_channels
        if not audio.is_floating_point() or audio.ndim != 4 or tuple(audio.shape[1:3]) != (2, channels):
            raise ValueError(f"this pool's MiniMax-H3 decodes audio latents [batch, 2 stereo channels, {channels}, audio "
                             f"latents], got {list(audio.shape)} {audio.dtype}; decode audio latents of this pool's model")

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Audio latents [B, 2, 32, L] as the pipeline returns them (normalised) → stereo waveforms [B, 2, samples], as
        its audio decode step makes them: a sample's two channels are two batch items of the mono audio VAE, whose
        BigVGAN decoder is the vocoder (32 kHz)."""
        audio_vae = self._vae("audio_vae")
        latents = latents.to(audio_vae.device, torch.float32)
        mean, std = self._statistics(audio_vae, latents, 3)
        with torch.no_grad():
            return torch.cat([audio_vae.decode(sample * std + mean, return_dict=False)[0].float().permute(1, 0, 2)
                              for sample in latents])

    def audio_sample_rate(self) -> int:
        return int(self.module.audio_sampling_rate)

    def _vae(self, name: str):
        vae = getattr(self.module, name, None)
        if vae is None:
            raise ValueError(f"this pool's MiniMax-H3 has no {name} to decode with (a transformer-only file); decode with "
                             "ComfyUI's VAE Decode")
        return vae

    @staticmethod
    def _statistics(vae, latents: torch.Tensor, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and std, shaped to broadcast over `ndim`-D latents (channels second)."""
        view = (1, -1) + (1,) * (ndim - 2)
        return tuple(torch.tensor(getattr(vae.config, name), device=latents.device).view(view)
                     for name in ("latents_mean", "latents_std"))

    def partial_denoise(self, kwargs: dict[str, Any], init_latents: torch.Tensor, denoise: float) -> dict[str, Any]:
        raise ValueError("denoise below 1 is not available for MiniMax-H3 (its blocks noise no given video); sample "
                         "with denoise 1")

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return ("MiniMax-H3 is guidance-distilled: one transformer call per step, no unconditional branch for CFG "
                "parallel to split; turn CFG parallel off (use its degree for Ulysses, Ring or data parallel)")


def encoded_references(kinds: torch.Tensor) -> list[EncodedReference]:
    """The first sample's `reference_kinds` [B, R] as ref2va's layout reads them."""
    names = [REFERENCE_KINDS[int(k)] for k in kinds[0]]
    return [EncodedReference(name.split()[0], name in REFERENCE_KINDS[2:]) for name in names]


def unpatchify_video_rows(rows: torch.Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of diffusers' `patchify_video_latents`: rows [B·t·h·w, C·pt·ph·pw] (frame-major, then row-major) as
    latents `shape` [B, C, T', H, W]."""
    batch, channels, frames, height, width = shape
    pt, ph, pw = patch
    rows = rows.reshape(batch, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(shape)
