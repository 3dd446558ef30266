"""What the pipeline wrapper answers besides sampling: its text encoding, the widths clients check, the initial
noise as the pipeline draws it, and the glue of a single model call (model_call.py: ComfyUI's samplers through
xDiT Model), each overridden by a family where its pipeline does it its own way."""

from __future__ import annotations

from typing import Any

import torch


class ModelCallGlue:
    """Mixed into the pipeline wrapper (wrapper.py), which gives it `module` and the family's declarations."""

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """The pipeline's own `encode_prompt(prompt)` with its defaults, as named pipeline inputs."""
        raise NotImplementedError(f"{type(self.module).__name__} has no text encoding in this engine")

    def encode_text_with_images(self, prompt: str, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """The prompt encoded together with reference images [N, 3, H, W] in [0, 1], where the model's text encoder
        sees them (Qwen-Image-Edit); the others refuse."""
        name = type(self.module).__name__
        references = " (its reference images go in as ReferenceLatent)" if self.comfy.reference_latents else ""
        raise ValueError(f"{name}'s text encoders take no image{references}: encode the text alone, without an image")

    def input_widths(self) -> dict[str, int]:
        """Last-dimension size the model needs for each embedding input (for clients to check)."""
        config = self.module.transformer.config
        return {name: int(config[entry]) for name, entry in self.embedding_sizes.items()}

    def model_call_arguments(self, latents: torch.Tensor, timestep: torch.Tensor,
                             inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The transformer's keyword arguments for `latents` [B, C, H, W] at the scheduler's `timestep` [B],
        as the pipeline's loop makes them (families with model_call_inputs)."""
        raise NotImplementedError

    def frame_timesteps(self) -> bool:
        """Whether a model call may carry one noise level per latent frame, sigma [B, T'] (Wan 2.2 TI2V)."""
        return False

    def model_call_output(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's output as a prediction shaped like `latents`."""
        return output

    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's `output_type="latent"` result as its denoising loop keeps latents (what a step callback
        sees): the same for most pipelines; a family overrides it where its pipeline returns them otherwise."""
        return latents

    def comfy_model_class(self) -> str:
        """comfy.supported_models' class for this model (ComfyData.model_class; a family may tell variants apart)."""
        return self.comfy.model_class

    def noise_channels(self) -> int:
        """The latent channels its `__call__` gives `prepare_latents`: the transformer's input channels, over the
        2×2 patch where the pipeline packs latent pixels into tokens itself (Flux, Qwen-Image, FLUX.2)."""
        return self.module.transformer.config.in_channels // (self.latent_patch or 1) ** 2

    def noise_input(self, prepared: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The initial noise as `prepare_latents` returns it (prompt_inputs.py), as this pipeline's `latents`
        argument takes it: as returned, for most."""
        return prepared

    def latent_scale(self) -> int:
        """Pixels per latent pixel of the image-shaped latents a client (ComfyUI's LATENT) holds for this pipeline:
        its VAE's spatial factor, read off the loaded VAE rather than assumed (FLUX.2 doubles it)."""
        return getattr(self.module, "vae_scale_factor_spatial", None) or self.module.vae_scale_factor
