"""Scheduler wrappers: the schedulers this engine has been verified with, and a step counter.

With sequence, CFG and data parallelism every rank holds the full latents at step boundaries, so the
scheduler's own step is exact; the wrapper counts steps in the runtime state (progress, warm-up).
PipeFusion's patches flowing across steps step each patch on its own copy of the scheduler (`patch_copy`),
which is exact for the schedulers whose step is elementwise over the latents (`steps_each_token`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from typing import Callable

import torch

from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    MiniMaxH3Scheduler,
    UniPCMultistepScheduler,
)

from ..distributed import get_runtime_state
from .wrapper import xFuserBaseWrapper
from .register import xFuserSchedulerWrappersRegister


def steps_each_token(scheduler) -> bool:
    """Whether `scheduler`'s step treats every latent value on its own, given the step's scalars and its own
    history of model outputs (deterministic, no thresholding over the image): then a patch steps exactly as
    its rows of the whole latents would."""
    config = scheduler.config
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return not config.get("stochastic_sampling", False)
    if isinstance(scheduler, DPMSolverMultistepScheduler):
        return config.algorithm_type in ("dpmsolver++", "dpmsolver") and not config.thresholding
    if isinstance(scheduler, UniPCMultistepScheduler):
        return not config.thresholding
    return False


def patch_copy(scheduler, rows: Callable[[torch.Tensor], torch.Tensor | None]):
    """A copy of `scheduler` for one patch: its per-token state — the history a multistep scheduler keeps, tensors
    shaped like the latents, alone or in lists — cut to the patch by `rows` (None: not a per-token tensor); the
    schedule itself is shared, and the copy counts its own steps."""

    def cut(value):
        if isinstance(value, torch.Tensor):
            part = rows(value)
            return value if part is None else part
        return [cut(v) for v in value] if isinstance(value, list) else value

    patch = copy.copy(scheduler)
    for name, value in vars(scheduler).items():
        setattr(patch, name, cut(value))
    return patch


class xFuserSchedulerBaseWrapper(xFuserBaseWrapper):
    _after_step: Callable[[torch.Tensor], None] | None = None

    def step(self, *args, **kwargs):
        result = self.module.step(*args, **kwargs)
        runtime = get_runtime_state()
        runtime.step_index += 1
        if runtime.step_result is not None:  # PipeFusion's flow: the latents this rank's loop goes on with
            result = _replace_sample(result, runtime.step_result(result[0] if isinstance(result, tuple) else result.prev_sample))
        if self._after_step is not None:
            self._after_step(result[0] if isinstance(result, tuple) else result.prev_sample)
        return result

    @contextlib.contextmanager
    def calling_after_each_step(self, callback: Callable[[int, torch.Tensor], None]):
        """Inside: `callback(step index, latents)` after each step, for pipelines that take no step callback of their
        own (HunyuanVideo 1.5); the latents as the pipeline's loop keeps them."""
        steps = itertools.count()
        self._after_step = lambda latents: callback(next(steps), latents)
        try:
            yield
        finally:
            self._after_step = None

    @contextlib.contextmanager
    def tail_of(self, total: int):
        """Inside: `set_timesteps(n)` sets the last n steps of a `total`-step schedule, as diffusers'
        img2img pipelines do (the full schedule with its first timesteps dropped and the begin index
        moved), for pipelines that take neither sigmas nor timesteps (Wan). Outside, `set_timesteps` is
        the scheduler's own (pipelines read its signature)."""
        scheduler = self.module

        def set_timesteps(num_inference_steps: int, *args, **kwargs):
            scheduler.set_timesteps(total, *args, **kwargs)
            start = (total - num_inference_steps) * scheduler.order
            scheduler.timesteps = scheduler.timesteps[start:]
            scheduler.set_begin_index(start)

        self.set_timesteps = set_timesteps
        try:
            yield
        finally:
            del self.set_timesteps


def _replace_sample(result, latents: torch.Tensor):
    if isinstance(result, tuple):
        return (latents, *result[1:])
    return dataclasses.replace(result, prev_sample=latents)


@xFuserSchedulerWrappersRegister.register(
    DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, DDIMScheduler, EulerDiscreteScheduler,
    UniPCMultistepScheduler,  # Wan's default (flow sigmas, flow_prediction)
    MiniMaxH3Scheduler,  # MiniMax-H3's two (video, audio): rectified-flow Euler, the terminal sigma counted as a step
)
class xFuserSchedulerWrapper(xFuserSchedulerBaseWrapper):
    """Every listed scheduler steps on whole latents; no per-class change is needed yet."""
