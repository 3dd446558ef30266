"""Wan 2.1 / 2.2 text- and image-to-video: 5-D latents [B, C, T', H/8, W/8] (TI2V 5B: 48 channels, H/16),
one token per latent frame × 2×2 latent pixels.

The plan, as diffusers' own `_cp_plan` for WanTransformer3DModel: the rotary embedding (cos, sin) is
split on the token axis, the patch-embedded tokens are split where they enter the first block, and
proj_out gathers; Wan 2.2 TI2V's per-token timesteps ([B, S]) are split alike, so its per-token
modulation matches. Self-attention runs USP; cross-attention to the text (and Wan 2.1 I2V's image
tokens) stays local; CFG arrives as two calls. A video's token count rarely divides by the
sequence-parallel degree: the plan splits it unevenly (token_split.py), so only a video with fewer
tokens than ranks is refused. Wan 2.2 A14B's second (low-noise) expert, `transformer_2`, is wrapped
like the first.

ComfyUI keeps Wan latents in its Wan21 (16 channels, ×8) and Wan22 (48 channels, ×16) formats.
"""

from __future__ import annotations

from typing import Any

import torch

from ..call_parameters import CallParameter
from ..config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipelines import xFuserPipelineBaseWrapper
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, Split
from .base import FAMILIES, ComfyData, Family

DEFAULT_FRAMES = 81  # WanPipeline.__call__'s default num_frames
PROMPT_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length: what a text prompt is padded to


class xFuserWanPipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(
        latent_formats={16: "Wan21", 48: "Wan22"}, spatial={16: 8, 48: 16}, temporal=4,
        expects="encode with xDiT Text Encode on this pool, or Wan's UMT5-XXL CLIP loader (4096 wide, 512 tokens)",
        empty_latent="EmptyHunyuanLatentVideo (Wan 2.1 / 2.2 A14B) or a Wan latent node",
    )
    embedding_sizes = {"prompt_embeds": "text_dim", "negative_prompt_embeds": "text_dim"}
    call_parameters = {
        "num_frames": CallParameter(int, "video frames, 4k+1 (default: as many as the latents hold)", 1, 10_000),
        "guidance_scale_2": CallParameter(float, "Wan 2.2 A14B: guidance of the low-noise expert (default: guidance_scale)",
                                          0.0, 100.0),
    }

    def _config(self):
        transformer = self.module.transformer if self.module.transformer is not None else self.module.transformer_2
        return transformer.config

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """As `WanPipeline(prompt=...)` encodes it: UMT5, padded with zeros to 512 tokens."""
        embeds, _ = self.module.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=PROMPT_TOKENS)
        return {"prompt_embeds": embeds}

    def prepare(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
        """Given latents define the frames: image-to-video builds its condition for num_frames frames."""
        latents = kwargs.get("latents")
        if kwargs.get("num_frames") is None and isinstance(latents, torch.Tensor) and latents.ndim == 5:
            kwargs = {**kwargs, "num_frames": (latents.shape[2] - 1) * self.module.vae_scale_factor_temporal + 1}
        return super().prepare(kwargs)

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
        scale = self.module.vae_scale_factor_spatial
        for name, size, patch in (("height", height, patch_h), ("width", width, patch_w)):
            if size % (scale * patch):
                raise LayoutError(
                    f"{name} {size} is not a multiple of {scale * patch} (VAE factor {scale} × patch {patch}); "
                    f"round it to a multiple of {scale * patch}."
                )
        return (height // (scale * patch_h)) * (width // (scale * patch_w))

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

    def partial_denoise(self, kwargs: dict[str, Any], init_latents: torch.Tensor, denoise: float) -> dict[str, Any]:
        raise ValueError("denoise below 1 is not available for Wan yet (WanPipeline takes no sigmas); use denoise 1.0")


class xFuserWanImageToVideoPipeline(xFuserWanPipeline):
    """Wan image-to-video: the transformer also takes the first frame's VAE latents and a frame mask
    (36 input channels for 16 output channels); every rank encodes the image with its own VAE."""

    tensor_inputs = ("image",)

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        if kwargs.get("image") is None:
            raise ValueError(f"{type(self.module).__name__} needs `image`, the first frame to animate")
        super().check_inputs(kwargs, batch)


WAN = FAMILIES.register(Family(
    name="wan",
    pipelines={"WanPipeline": xFuserWanPipeline, "WanImageToVideoPipeline": xFuserWanImageToVideoPipeline},
    transformer="WanTransformer3DModel",
    plan=ParallelPlan(
        inputs={"": {"timestep": Split(dim=1, ndim=2)}, "blocks.0": {"hidden_states": Split(dim=1)}},
        outputs={"rope": Split(dim=1, items=(0, 1)), "proj_out": Gather(dim=1)},
        attention={"blocks.*.attn1": TextLayout.NONE},
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
        output_channels="out_channels",
    ),
))
