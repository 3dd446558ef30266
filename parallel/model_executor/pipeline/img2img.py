"""img2img as ComfyUI's `denoise` means it: the tail of a longer schedule, from the starting latents noised to
its first step, with the schedule each pipeline itself would make (its sigmas, its resolution shift)."""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, ClassVar

import numpy as np
import torch

# partial_denoise's note to __call__: sample the tail of a schedule of this many steps (see tail_of).
SCHEDULE_TAIL_OF = "_schedule_tail_of"


def linear_sigmas(steps: int) -> np.ndarray:
    """What Flux's, FLUX.2's, Qwen-Image's, Z-Image's and HunyuanVideo 1.5's `__call__` give their scheduler (the
    last spelled `linspace(1, 0, steps + 1)[:-1]`, the same values)."""
    return np.linspace(1.0, 1 / steps, steps)


class Img2Img:
    """Mixed into the pipeline wrapper (wrapper.py); a family declares or overrides the schedule where its pipeline
    makes its own (FLUX.2's empirical shift). tests/test_pipeline_internals.py holds each family's schedule against
    its pipeline's own `__call__`.

    default_sigmas: the unshifted sigmas the pipeline's `__call__` gives its flow-matching scheduler for a number of
                    steps (linear_sigmas); None: it gives none, the scheduler spans its own range.
    """

    default_sigmas: ClassVar[Callable[[int], np.ndarray] | None] = None

    def flow_sigmas(self, total: int) -> np.ndarray:
        """The unshifted sigmas this pipeline gives a flow-matching scheduler for `total` steps."""
        if self.default_sigmas is not None:
            return self.default_sigmas(total)
        scheduler = self.module.scheduler
        return np.linspace(scheduler.sigma_max, scheduler.sigma_min, total)

    def shift_arguments(self, height: int, width: int, steps: int) -> dict[str, float]:
        """`mu` for schedulers with resolution-dependent shifting, computed as the pipelines do for a call of
        `steps` steps."""
        config = self.module.scheduler.config
        if not config.get("use_dynamic_shifting"):
            return {}
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        mu = calculate_shift(
            self.image_tokens(height, width), config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )
        return {"mu": mu}

    def partial_denoise(self, kwargs: dict[str, Any], init_latents: torch.Tensor, denoise: float) -> dict[str, Any]:
        """img2img as ComfyUI's `denoise` means it: run the last `steps` of a `steps / denoise` schedule,
        starting from `init_latents` noised (with the given `latents` as noise) to that point."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = kwargs["num_inference_steps"]
        total = max(steps, int(steps / denoise))
        noise = kwargs["latents"]
        scheduler = copy.deepcopy(self.module.scheduler.module)
        call = self.call_parameter_names()
        if "sigmas" not in call and "timesteps" not in call and hasattr(scheduler, "set_begin_index"):
            scheduler.set_timesteps(total)  # the pipeline takes no schedule: __call__ cuts the scheduler's own
            start = scheduler.timesteps[(total - steps) * scheduler.order :][:1]
            noised = (scheduler.add_noise(init_latents, noise, start) if hasattr(scheduler, "add_noise")
                      else scheduler.scale_noise(init_latents, start, noise))  # flow matching's name for it
            return {**kwargs, "latents": noised, SCHEDULE_TAIL_OF: total}
        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            sigmas = self.flow_sigmas(total)[total - steps :]
            scheduler.set_timesteps(sigmas=sigmas, **self.shift_arguments(kwargs["height"], kwargs["width"], steps))
            sigma = scheduler.sigmas[0].to(noise.dtype)
            return {**kwargs, "latents": sigma * noise + (1 - sigma) * init_latents, "sigmas": sigmas.tolist()}
        takes_timesteps = "timesteps" in inspect.signature(scheduler.set_timesteps).parameters
        if takes_timesteps and scheduler.init_noise_sigma == 1.0:
            scheduler.set_timesteps(total)
            timesteps = scheduler.timesteps[total - steps :]
            latents = scheduler.add_noise(init_latents, noise, timesteps[:1])
            return {**kwargs, "latents": latents, "timesteps": timesteps.tolist()}
        raise ValueError(
            f"denoise below 1 is not available with {type(scheduler).__name__}; use the pipeline's default scheduler"
        )
