"""A model call of a model that samples video with sound from ComfyUI's AV latent (MiniMax-H3, LTX-2), as ComfyUI's own
diffusion model takes and answers it: the sampler hands it the latent's two streams, [video, audio], and ComfyUI's
ModelSamplingAV carries the audio scaled onto the video's schedule (its `audio_scale`: video shift / audio shift). The
model undoes that before its network runs and turns the audio velocity back after, so the pool, which samples each
stream on its own schedule as the pipeline does, gets the stream's own audio at its own sigma (the video's, moved
from the one shift to the other) and answers the stream's own velocity. Its keyframes (MiniMaxH3ImageToVideo's first
and last frame, in the call's payload) and its references (MiniMaxH3ReferenceToVideo's images, videos and sounds, in
ref2va's wire form) go noised as ComfyUI's model noises them, so the pool puts in front of the audio and video rows
what ComfyUI's model does. The formulas are ComfyUI 0.33's (comfy/ldm/minimax/model.py: time_shift_sigma,
MiniMaxH3Model.forward, _cond_video_rows and _cond_audio_rows).

LTX-2 (ComfyUI's LTXAV) samples both streams on one schedule: its model takes the (video, audio) timesteps, each its
stream's sigma, and answers [video, audio] velocities as they are; the frame rate (LTXVConditioning's) goes along. A
video noise mask (LTXVImgToVideoInplace's) makes the video's timesteps per token, which go as `token_sigmas`.
"""

from __future__ import annotations

import torch

from ..parallel.families import ComfyData
from ..parallel.families.ltx2.comfy_block_order import A2V_GATE


def time_shift(sigma: torch.Tensor, from_shift: float, to_shift: float) -> torch.Tensor:
    """A sigma of a schedule shifted by `from_shift` as the same step of one shifted by `to_shift`."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


class AudioCall:
    """One call's streams: `inputs()` what the pool takes, `answer()` the pool's predictions as ComfyUI's model's.
    `timesteps`: ComfyUI's model's (video, audio) timesteps, where the audio's is its own (LTXAV: each stream's
    sigma, the audio's from its own noise mask) rather than derived from the video's by two shifts."""

    def __init__(self, data: ComfyData, streams: list[torch.Tensor], sigma: torch.Tensor, options: dict, scale,
                 timesteps=None):
        batch = streams[0].shape[0]
        if batch != 1 and data.audio_shifts:
            raise ValueError(f"this model's call takes one video at a time (got a batch of {batch}), as ComfyUI's own "
                             "does (its packed sequence holds one video): use batch size 1, and cfg 1 with BasicGuider "
                             "(its guidance is distilled)")
        self.data, self.video, self.scale = data, streams[0], float(1.0 if scale is None else scale)
        # LTXAV: a batch (cond and uncond) holds samples at one noise level, one per sample here
        self.sigma = torch.broadcast_to(sigma.float().reshape(-1)[:batch], (batch,)).clamp(min=1e-6)
        self.token_sigmas = None
        if data.audio_shifts:
            (video_option, video_shift), (audio_option, audio_shift) = data.audio_shifts
            self.audio_sigma = time_shift(self.sigma, float(options.get(video_option, video_shift)),
                                          float(options.get(audio_option, audio_shift)))
        else:
            video_t, audio_t = timesteps if isinstance(timesteps, (tuple, list)) else (timesteps, timesteps)
            self.audio_sigma = _audio_sigma(audio_t.float(), batch)  # LTXAV's timesteps are its sigmas (flow matching)
            self.token_sigmas = _token_sigmas(video_t.float(), self.video, self.audio_sigma)
        carry = self.audio_sigma / self.sigma if self.scale != 1.0 else torch.ones(1)
        self.audio = streams[1].float() * carry  # the stream's own audio, ComfyUI's layout

    def inputs(self) -> dict[str, torch.Tensor]:
        audio = self.audio.permute(*self.data.audio_axes) if self.data.audio_axes else self.audio
        tensors = {"latents": self.video.float().contiguous(), "sigma": self.sigma.contiguous(),
                   "audio_latents": audio.contiguous(), "audio_sigma": self.audio_sigma.contiguous()}
        if self.token_sigmas is None:
            return tensors
        # ComfyUI's LTXAV gates the audio-to-video update of every video token by the audio's timestep
        return {**tensors, "token_sigmas": self.token_sigmas,
                A2V_GATE: torch.ones(self.video.shape[0])}

    def batched(self, conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The conditioning one per sample: what ComfyUI gives once for the call (one layout's per-token tags [T], a
        frame rate [1]) repeated over the call's batch."""
        batch = self.video.shape[0]
        return {name: value[None].expand(batch, *value.shape).contiguous() if value.ndim == 1 else value
                for name, value in conditioning.items()}

    def keyframes(self, kwargs: dict) -> dict[str, torch.Tensor]:
        """The call's keyframes (`ComfyData.keyframes`) as the pool takes them: each latent [1, C, 1, h, w] noised
        as ComfyUI's model noises it (`_noised`), joined as `condition_latents` with their `condition_sizes` and
        `keyframe_anchors` (0: the first frame, 1: the last; ComfyUI's model built its layout from them first,
        refusing any other); or its references (MiniMaxH3ReferenceToVideo's `refs`: `references`)."""
        prefix = self.data.keyframes
        if prefix and kwargs.get(f"{prefix}.refs"):
            return self.references(kwargs[f"{prefix}.refs"], int(kwargs.get(f"{prefix}.seed") or 0))
        frames = kwargs.get(f"{prefix}.keyframes") if prefix else None
        if not frames:
            return {}
        seed = int(kwargs.get(f"{prefix}.seed") or 0)
        latents = [_noised(frame["latent"], seed) for frame in frames]
        anchors = [0.0 if frame["resolved_frame_index"] == 0 else 1.0 for frame in frames]  # its layout refused others
        return {**_joined(latents, "condition"), "keyframe_anchors": torch.tensor([anchors])}

    @staticmethod
    def references(refs: list[dict], seed: int) -> dict[str, torch.Tensor]:
        """ref2va's wire form of ComfyUI's reference blocks, in their order: `reference_kinds` [1, R] (0 image, 1 video,
        2 video with its soundtrack, 3 audio), each image's and video's latent noised as its model noises them
        (`condition_latents`, `condition_sizes`), each soundtrack and audio clean, as its model packs them (its
        audio_cond_noise_aug 1: channel-major rows, `audio_condition_latents` [1, 32, Σ rows] with their sizes)."""
        from comfy.ldm.minimax.model import pack_audio

        kinds, visuals, sounds = [], [], []
        for ref in refs:
            sound = ref.get("audio_latent") is not None and int(ref.get("ref_audio_t") or 0) > 0
            kinds.append({"image": 0, "audio": 3}.get(ref["kind"], 2 if sound else 1))
            if ref.get("latent") is not None:
                visuals.append(_noised(ref["latent"], seed))
            if sound:
                sounds.append(pack_audio(ref["audio_latent"].float().cpu()).T[None])
        wire = {"reference_kinds": torch.tensor([kinds], dtype=torch.float32), **_joined(visuals, "condition")}
        return {**wire, **_joined(sounds, "audio_condition")} if sounds else wire

    def answer(self, outputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        audio = outputs[self.data.audio_stream[1]].float()
        if self.data.audio_axes:
            audio = audio.permute(*sorted(range(audio.ndim), key=self.data.audio_axes.__getitem__))
        if self.scale != 1.0:  # d/d(video sigma) of the carried audio
            audio = (1.0 - self.scale) * self.audio + (1.0 + (self.scale - 1.0) * self.audio_sigma) * audio
        return [outputs["prediction"], audio.contiguous()]


def _audio_sigma(timestep: torch.Tensor, batch: int) -> torch.Tensor:
    """LTXAV's audio timestep as one sigma per sample [B]: an audio noise mask of ones (LTXVConcatAVLatent's beside a
    video mask) gives every token the same; a mask that holds audio back is refused, as diffusers' transformer would
    gate the video-to-audio attention with each audio token's timestep, ComfyUI's model with the video's largest."""
    if timestep.numel() > batch and bool((timestep != timestep.reshape(-1)[0]).any()):
        raise ValueError("this model's call got an audio noise mask that holds some audio back (its tokens' timesteps "
                         f"range {timestep.min().item():.4g}..{timestep.max().item():.4g}), which the pool's call cannot "
                         "match ComfyUI's model on; sample without the audio's noise mask, or with ComfyUI's own model")
    return timestep.reshape(batch, -1)[:, 0] if timestep.numel() >= batch else timestep.reshape(-1).expand(batch)


def _token_sigmas(timestep: torch.Tensor, video: torch.Tensor, audio_sigma: torch.Tensor) -> torch.Tensor | None:
    """A video noise mask's per-token timesteps (ComfyUI's process_timestep: mask × sigma, patchified; LTXVImgToVideo-
    Inplace's start frame at 1 - strength) as `token_sigmas` [B, tokens], or None for one timestep per sample. ComfyUI's
    model gates the video-to-audio attention with the largest, the pool's transformer call with the audio's sigma
    (use_cross_timestep off): a mask where the two differ is refused."""
    batch = video.shape[0]
    if timestep.numel() == batch:
        return None
    tokens = video.shape[2] * video.shape[3] * video.shape[4]
    if timestep.numel() not in (tokens, batch * tokens):
        raise ValueError(f"this model's call got {timestep.numel()} video timesteps for {tokens} video tokens (a noise "
                         "mask of another size); resize the mask to the latent, or sample with ComfyUI's own model")
    top = timestep.max()
    if not torch.allclose(top.expand_as(audio_sigma), audio_sigma, rtol=1e-6, atol=0.0):
        raise ValueError(f"this model's call got a noise mask whose largest video timestep ({top.item():.4g}) is not "
                         f"the audio's ({audio_sigma.max().item():.4g}): a video mask below 1 everywhere, or a held "
                         "audio, which the pool's call cannot match ComfyUI's model on; leave some frames unmasked "
                         "(LTXVImgToVideoInplace does) and the audio free, or sample with ComfyUI's own model")
    return timestep.reshape(-1, tokens).expand(batch, tokens).contiguous()


def _noised(latent: torch.Tensor, seed: int) -> torch.Tensor:
    """A conditioning latent [1, C, t, h, w] mixed, in ComfyUI's row layout, with a draw from a generator seeded by
    the call's seed, restarted for every latent, as ComfyUI's model does (its _cond_video_rows)."""
    from comfy.ldm.minimax.model import VISUAL_COND_TIMESTEP, patchify_video, unpatchify_video

    latent = latent.float().cpu()
    rows = patchify_video(latent)
    noise = torch.randn(rows.shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    rows = VISUAL_COND_TIMESTEP * rows + (1.0 - VISUAL_COND_TIMESTEP) * noise
    _, channels, length, height, width = latent.shape
    return unpatchify_video(rows, length, height // 2, width // 2, channels)


def _joined(latents: list[torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Tensors [1, C, *size] as `{name}_latents` [1, C, Σ size] and `{name}_sizes` [1, N, len(size)] (families.base.
    references reads them back)."""
    sizes = torch.tensor([list(latent.shape[2:]) for latent in latents], dtype=torch.float32)
    return {f"{name}_latents": torch.cat([latent.flatten(2) for latent in latents], dim=2),
            f"{name}_sizes": sizes[None].contiguous()}
