"""Per-family conversion between ComfyUI's data and the diffusers pipeline's inputs and outputs.

ComfyUI keeps VAE-space latents and applies the model's latent format (`comfy/latent_formats.py`)
inside its samplers; diffusers pipelines take model-space latents. So the sampler converts with the
family's scale/shift (and Flux's 2×2 packing), uses ComfyUI's own noise for the seed, and turns a
native CONDITIONING into the pipeline's prompt_embeds / pooled / mask inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ConditioningError(ValueError):
    """A conditioning that does not fit the pool's model; the text says which encoder it needs."""


@dataclass(frozen=True)
class FamilyAdapter:
    name: str
    latent_format: str  # class name in comfy.latent_formats
    scale: float
    shift: float = 0.0
    packed: bool = False  # Flux packs 2×2 latent pixels into one 64-channel token
    guidance_in_conditioning: bool = False  # Flux: FluxGuidance's "guidance" is the distilled guidance
    expects: str = ""

    def to_model(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pack((latents - self.shift) * self.scale) if self.packed else (latents - self.shift) * self.scale

    def noise_to_model(self, noise: torch.Tensor) -> torch.Tensor:
        return self.pack(noise) if self.packed else noise

    def to_comfy(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        if self.packed:
            latents = self.unpack(latents, height, width)
        return latents / self.scale + self.shift

    def preview_latents(self, preview: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Model-space latents of the first sample, in ComfyUI's image layout for its previewer."""
        return self.unpack(preview, height, width) if self.packed else preview

    def format_name(self, channels: int) -> str:
        """The comfy.latent_formats class of a latent with `channels` channels."""
        return self.latent_format

    def job_size(self, samples: torch.Tensor) -> dict[str, int]:
        """The job's pixel size (and frames, for video) of a ComfyUI latent."""
        return {"height": samples.shape[-2] * 8, "width": samples.shape[-1] * 8}

    @staticmethod
    def pack(latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)

    @staticmethod
    def unpack(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        b, _, d = latents.shape
        h, w = height // 16, width // 16
        return latents.view(b, h, w, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h * 2, w * 2)

    # -- conditioning -------------------------------------------------------------------------------
    def pipeline_inputs(self, positive, negative, batch: int, widths: dict[str, int]) -> tuple[dict, float | None]:
        """prompt_embeds & co. for `batch` samples, and the conditioning's Flux guidance if any."""
        tensors, guidance = {}, None
        for prefix, conditioning in (("", positive), ("negative_", negative)):
            if conditioning is None:
                continue
            cond, extras = self._single(conditioning, prefix or "positive")
            self._check_width(f"{prefix}prompt_embeds", cond.shape[-1], widths)
            tensors[f"{prefix}prompt_embeds"] = _repeat(cond, batch)
            if f"{prefix}pooled_prompt_embeds" in widths:
                pooled = extras.get("pooled_output")
                if pooled is None:
                    raise ConditioningError(f"the {prefix or 'positive '}conditioning has no pooled output; {self.expects}")
                self._check_width(f"{prefix}pooled_prompt_embeds", pooled.shape[-1], widths)
                tensors[f"{prefix}pooled_prompt_embeds"] = _repeat(pooled, batch)
            if self.name.startswith("pixart"):
                mask = extras.get("attention_mask")
                mask = torch.ones(cond.shape[:2], dtype=torch.int64) if mask is None else mask.to(torch.int64)
                tensors[f"{prefix}prompt_attention_mask"] = _repeat(mask.reshape(mask.shape[0], -1), batch)
            if not prefix and self.guidance_in_conditioning and "guidance" in extras:
                guidance = float(extras["guidance"])
        return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, guidance

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
                f"{name} is {width} wide but this pool's {self.name} model needs {widths[name]}; {self.expects}"
            )


@dataclass(frozen=True)
class VideoFamilyAdapter(FamilyAdapter):
    """Wan: 5-D latents [B, C, T', H, W] with ComfyUI's per-channel latent formats (Wan21: 16 channels,
    ×8 spatial; Wan22: 48 channels, ×16), 4 frames per latent frame after the first.

    Model space is ComfyUI's process_in, (x − mean) · scale_factor / std with scale_factor 1.0, which is
    what diffusers' WanPipeline undoes before decoding (x = latents · std + mean); so the conversion uses
    ComfyUI's own latent format (imported when used: the nodes run inside ComfyUI).
    """

    formats: tuple[tuple[int, str, int], ...] = ((16, "Wan21", 8), (48, "Wan22", 16))  # channels, format, ×spatial
    temporal: int = 4

    def _entry(self, channels: int) -> tuple[int, str, int]:
        for entry in self.formats:
            if entry[0] == channels:
                return entry
        raise ConditioningError(
            f"a {self.name} video latent has {channels} channels; expected one of {[e[0] for e in self.formats]} "
            "(Wan 2.1 / 2.2 A14B: 16, Wan 2.2 TI2V 5B: 48)"
        )

    def _format(self, channels: int):
        import comfy.latent_formats

        return getattr(comfy.latent_formats, self.format_name(channels))()

    def format_name(self, channels: int) -> str:
        return self._entry(channels)[1]

    def job_size(self, samples: torch.Tensor) -> dict[str, int]:
        if samples.ndim != 5:
            raise ConditioningError(
                f"{self.name} samples videos: the latent must be 5-D [batch, channels, frames, height, width], "
                f"got {list(samples.shape)}; use EmptyHunyuanLatentVideo (Wan 2.1 / 2.2 A14B) or a Wan latent node"
            )
        _, _, spatial = self._entry(samples.shape[1])
        return {"height": samples.shape[-2] * spatial, "width": samples.shape[-1] * spatial,
                "num_frames": (samples.shape[2] - 1) * self.temporal + 1}

    def to_model(self, latents: torch.Tensor) -> torch.Tensor:
        return self._format(latents.shape[1]).process_in(latents)

    def noise_to_model(self, noise: torch.Tensor) -> torch.Tensor:
        return noise

    def to_comfy(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return self._format(latents.shape[1]).process_out(latents)

    def preview_latents(self, preview: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The middle latent frame, as an image latent [1, C, H, W]."""
        return preview[:, :, preview.shape[2] // 2] if preview.ndim == 5 else preview


def _repeat(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    if tensor.shape[0] == batch:
        return tensor
    if tensor.shape[0] != 1:
        raise ConditioningError(f"conditioning batch {tensor.shape[0]} does not match the latent batch {batch}")
    return tensor.expand(batch, *tensor.shape[1:]).contiguous()


ADAPTERS = {
    "PixArtAlphaPipeline": FamilyAdapter(
        "pixart-alpha", "SD15", 0.18215, expects="encode with xDiT Text Encode on this pool, or PixArt's T5-XXL encoder"
    ),
    "PixArtSigmaPipeline": FamilyAdapter(
        "pixart-sigma", "SDXL", 0.13025, expects="encode with xDiT Text Encode on this pool, or PixArt's T5-XXL encoder"
    ),
    "StableDiffusion3Pipeline": FamilyAdapter(
        "sd3", "SD3", 1.5305, 0.0609,
        expects="encode with xDiT Text Encode on this pool, or SD3's TripleCLIPLoader (CLIP-L + CLIP-G + T5: 4096 wide, pooled 2048)",
    ),
    "FluxPipeline": FamilyAdapter(
        "flux", "Flux", 0.3611, 0.1159, packed=True, guidance_in_conditioning=True,
        expects="encode with xDiT Text Encode on this pool, or Flux's DualCLIPLoader (T5 4096 wide, pooled CLIP-L 768)",
    ),
}


ADAPTERS["WanPipeline"] = VideoFamilyAdapter(
    "wan", "Wan21", 1.0,
    expects="encode with xDiT Text Encode on this pool, or Wan's UMT5-XXL CLIP loader (4096 wide, 512 tokens)",
)


def adapter_for(pipeline: str) -> FamilyAdapter:
    if pipeline not in ADAPTERS:
        raise ValueError(f"xDiT Sampler has no adapter for {pipeline}; supported: {sorted(ADAPTERS)}")
    return ADAPTERS[pipeline]
