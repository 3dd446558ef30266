"""Rank 0's checks of a client's message at submit: a job that cannot run is refused before it is queued.

What the wire could not judge is judged here, once, against the loaded pipeline: the family's call
parameters, the inputs' shapes and the layout (the pipeline's own checks, whose result the job reuses when
it runs), the admission limits, LoRA files, a model call's conditioning and a decode's latents. A submit's
message leaves here carrying its request checked against the family; that object is what the ranks run.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ..engine import engine
from ..wire.protocol import Message

if TYPE_CHECKING:
    from .process import Rank


class Validator:
    def __init__(self, rank: "Rank"):
        self.rank = rank

    def __call__(self, message: Message) -> Any:
        """Refuse (ValueError) a job that cannot run; for a sample, what the runner prepared."""
        rank = self.rank
        if rank.state == "starting":
            raise ValueError("the pool is still loading its model; retry when status says idle")
        if message.type == "encode":
            if not rank.args.text_encoders:
                raise ValueError("this pool was started without text encoders; start it with them "
                                 "(`python -m workers serve --text-encoders`, or the xDiT Pool node's text_encoders on)")
            return None
        if message.type == "decode":
            return self._check_decode(message)
        for lora in message.body.loras:
            if not os.path.isfile(lora.path):
                raise ValueError(f"LoRA file {lora.path} does not exist on the pool's machine")
            rank.loras.check(lora)
        if message.type == "evaluate":
            return self._check_model_call(message)
        return self._check_sample(message)

    def _check_sample(self, message: Message):
        rank = self.rank
        if "latents" not in message.tensors:
            raise ValueError("submit needs a 'latents' tensor (the initial noise)")
        message.body = submit = rank.runner.for_family(message.body)
        rank.admission.check(rank.job_megapixels(submit.height, submit.width, message.tensors["latents"]), submit.steps)
        # with --layout auto the layout is chosen when the job runs: here only what every layout checks
        prepared = rank.runner.prepare(submit, message.tensors, check_layout=rank.layouts is None)
        init = message.tensors.get("init_latents")
        if init is not None and init.shape != message.tensors["latents"].shape:
            latents = message.tensors["latents"]
            raise ValueError(f"init_latents {list(init.shape)} must have the shape of latents {list(latents.shape)}")
        engine("loading.pipelines").make_scheduler(rank.default_scheduler, submit.scheduler)
        return prepared

    def _check_model_call(self, message: Message) -> dict[str, torch.Tensor]:
        """The call's tensors, its conditioning filled in from what earlier calls sent, checked once."""
        rank = self.rank
        tensors = rank.conditioning.resolve(message.body.conditioning, message.tensors)
        model_call = engine("model_executor.model_call")
        model_call.check_model_call(rank.pipeline, tensors, message.body.expert)
        transformer = model_call.expert_of(rank.pipeline, message.body.expert)
        engine("model_executor.call_cache").check(transformer.module, message.body.cache.settings)
        size = model_call.call_size(rank.pipeline, tensors["latents"])
        rank.admission.check(rank.job_megapixels(size["height"], size["width"], tensors["latents"]), 1)
        return tensors

    def _check_decode(self, message: Message) -> None:
        rank = self.rank
        audio = message.tensors.get("audio")
        if audio is not None:
            self.rank.pipeline.check_audio_latents(audio)
            if "latents" not in message.tensors:
                return
        vae = getattr(rank.pipeline.module, "vae", None)
        latents = message.tensors.get("latents")
        if vae is None or getattr(vae, "statistics_only", False):  # a single file's VAE statistics alone (LTX-2)
            why = vae.statistics_only if isinstance(getattr(vae, "statistics_only", None), str) else "no VAE weights"
            raise ValueError(f"this pool's pipeline has no VAE to decode with ({why}); decode with ComfyUI's VAE Decode")
        if latents is None or not latents.is_floating_point():
            raise ValueError("decode needs a floating-point 'latents' tensor in the VAE's own space (ComfyUI's LATENT)")
        channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
        dims = 5 if rank.pipeline.comfy.temporal else 4
        if latents.ndim != dims or latents.shape[1] != channels:
            layout = "[batch, channels, frames, height, width]" if dims == 5 else "[batch, channels, height, width]"
            raise ValueError(f"this pool's {type(vae).__name__} decodes {dims}-D latents {layout} with {channels} channels, "
                             f"got {list(latents.shape)}; decode latents of this pool's model")
        engine("model_executor.vae_decode").fit_tiles(vae, latents, rank.world_size, message.body.tile)
