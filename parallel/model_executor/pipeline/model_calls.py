"""What the pipeline wrapper answers besides sampling: its text encoding, the widths clients check, the initial
noise as the pipeline draws it, and the glue of a single model call (model_call.py: ComfyUI's samplers through
xDiT Model), each overridden by a family where its pipeline does it its own way."""

from __future__ import annotations

import contextlib
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
        from .checks import embedding_width

        config = self.module.transformer.config
        return {name: embedding_width(config, entry) for name, entry in self.embedding_sizes.items()}

    def model_call_arguments(self, latents: torch.Tensor, timestep: torch.Tensor,
                             inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The transformer's keyword arguments for `latents` [B, C, H, W] at the scheduler's `timestep` [B],
        as the pipeline's loop makes them (families with model_call_inputs)."""
        raise NotImplementedError

    def model_call_expert(self, expert: str, inputs: dict[str, torch.Tensor]) -> str:
        """The transformer a call with these inputs runs on, where its conditioning picks one (MiniMax-H3's references:
        `transformer_ref`): the caller's, for most."""
        return expert

    def model_call_context(self, transformer, inputs: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        """What the call (its conditioning, and its `latents`) switches on the wrapped `transformer` for this call only,
        where the model's config fixes what ComfyUI chooses per call (Qwen-Image's reference method, PixArt's position
        grid by size): nothing, for most."""
        return contextlib.nullcontext()

    def frame_timesteps(self) -> bool:
        """Whether a model call may carry one noise level per latent frame, sigma [B, T'] (Wan 2.2 TI2V)."""
        return False

    def model_call_output(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's output as a prediction shaped like `latents`."""
        return output

    def model_call_outputs(self, outputs: tuple, latents: torch.Tensor,
                           inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The transformer's outputs (return_dict=False) as the call's named predictions: `prediction` from its first;
        a model with a second stream (MiniMax-H3's audio) names that too."""
        return {"prediction": self.model_call_output(outputs[0], latents)}

    def timestep_scale(self) -> float:
        """The transformer's timestep per unit of sigma in a model call (its scheduler's num_train_timesteps)."""
        return self.module.scheduler.config.num_train_timesteps

    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's `output_type="latent"` result as its denoising loop keeps latents (what a step callback
        sees): the same for most pipelines; a family overrides it where its pipeline returns them otherwise."""
        return latents

    def model_outputs(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every output of an `output_type="latent"` call by name (`latents`, and LTX-2's `audio`) as the loop keeps
        it (a job asking for `model_latents`): its latents through `model_latents`, the rest as returned."""
        return {**outputs, "latents": self.model_latents(outputs["latents"])}

    def from_model_latents(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A call's latents given as the loop keeps them (`model_latents`) as the pipeline's arguments take them: the
        same for most pipelines; a family overrides it where its pipeline takes them in another space (LTX-2)."""
        return kwargs

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Audio latents [B, C, L, M] in the audio VAE's own space (what the pipeline returns as `audio` with
        output_type="latent") → waveforms [B, channels, samples], as the pipeline's own decode makes them: its audio
        VAE's mel spectrogram through its vocoder (LTX-2's `audio_vae` and `vocoder`)."""
        audio_vae, vocoder = getattr(self.module, "audio_vae", None), getattr(self.module, "vocoder", None)
        if audio_vae is None or vocoder is None:
            raise ValueError(f"{type(self.module).__name__} has no audio VAE and vocoder to decode audio with")
        with torch.no_grad():
            mel = audio_vae.decode(latents.to(audio_vae.device, audio_vae.dtype), return_dict=False)[0]
            return vocoder(mel)

    def check_audio_latents(self, audio: torch.Tensor) -> None:
        """A decode job's audio latents against the audio VAE (LTX-2's [B, C, frames, mel bins]), before any rank
        decodes them."""
        audio_vae = getattr(self.module, "audio_vae", None)
        if audio_vae is None or getattr(self.module, "vocoder", None) is None:
            raise ValueError(f"this pool's {type(self.module).__name__} has no audio VAE and vocoder to decode audio with "
                             "(a file holding its statistics alone); decode the audio with ComfyUI's VAE Decode (Audio)")
        channels = audio_vae.config.latent_channels
        if not audio.is_floating_point() or audio.ndim != 4 or audio.shape[1] != channels:
            raise ValueError(f"this pool's audio VAE decodes audio latents [batch, {channels} channels, frames, mel bins], "
                             f"got {list(audio.shape)} {audio.dtype}; decode audio latents of this pool's model")

    def to_vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """A decode job's video latents as the pipeline's own decode hands them to its VAE: the same for most (they come
        in the VAE's own space); a family overrides it where its decode step denormalises them itself (MiniMax-H3)."""
        return latents

    def from_vae_sample(self, sample: torch.Tensor) -> torch.Tensor:
        """The VAE's decode as a decode job returns it, in [-1, 1]: most VAEs' own range; a family overrides it where its
        VAE decodes into another space (MiniMax-H3's ImageNet-normalised RGB)."""
        return sample

    def audio_sample_rate(self) -> int:
        """The waveforms' samples a second (decode_audio's): the vocoder's output rate."""
        return int(self.module.vocoder.config.output_sampling_rate)

    def comfy_model_class(self) -> str:
        """comfy.supported_models' class for this model (ComfyData.model_class; a family may tell variants apart)."""
        return self.comfy.model_class

    def noise_channels(self) -> int:
        """The latent channels its `__call__` gives `prepare_latents`: the transformer's input channels, over the
        2×2 patch where the pipeline packs latent pixels into tokens itself (Flux, Qwen-Image, FLUX.2)."""
        return self.module.transformer.config.in_channels // (self.latent_patch or 1) ** 2

    def initial_noise(self, generator: torch.Generator, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The initial noise of one image as the pipeline draws it from `generator` (its `prepare_latents`), as its
        `latents` argument takes it; a pipeline without `prepare_latents` (a modular one) says how it draws."""
        import inspect

        pipeline = self.module
        parameters = inspect.signature(pipeline.prepare_latents).parameters
        if "num_frames" in parameters:
            raise ValueError(f"{type(pipeline).__name__} is a video pipeline: --prompt makes image inputs only; "
                             "write its IN file with 5-D latents (see the README's input shapes)")
        arguments = {"batch_size": 1, "height": height, "width": width, "dtype": dtype, "device": torch.device("cpu"),
                     "generator": generator,
                     "num_latents_channels" if "num_latents_channels" in parameters else "num_channels_latents":
                         self.noise_channels()}
        # edit pipelines draw the noise beside their references' latents: the noise alone here
        arguments.update({name: None for name in ("image", "images") if name in parameters})
        latents = pipeline.prepare_latents(**arguments)
        return self.noise_input(latents[0] if isinstance(latents, tuple) else latents, height, width)

    def noise_input(self, prepared: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The initial noise as `prepare_latents` returns it (prompt_inputs.py), as this pipeline's `latents`
        argument takes it: as returned, for most."""
        return prepared

    def latent_scale(self) -> int:
        """Pixels per latent pixel of the image-shaped latents a client (ComfyUI's LATENT) holds for this pipeline:
        its VAE's spatial factor, read off the loaded VAE rather than assumed (FLUX.2 doubles it)."""
        return getattr(self.module, "vae_scale_factor_spatial", None) or self.module.vae_scale_factor
