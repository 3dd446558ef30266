"""Scheduler wrappers: the schedulers this engine has been verified with, and a step counter.

With sequence, CFG and data parallelism every rank holds the full latents at step boundaries, so the
scheduler's own step is exact; the wrapper counts steps in the runtime state (progress, warm-up).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable

import torch

from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from ...distributed import get_runtime_state
from ..base_wrapper import xFuserBaseWrapper
from ..register import xFuserSchedulerWrappersRegister


class xFuserSchedulerBaseWrapper(xFuserBaseWrapper):
    _after_step: Callable[[torch.Tensor], None] | None = None

    def step(self, *args, **kwargs):
        result = self.module.step(*args, **kwargs)
        get_runtime_state().step_index += 1
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


@xFuserSchedulerWrappersRegister.register(
    DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, DDIMScheduler, EulerDiscreteScheduler,
    UniPCMultistepScheduler,  # Wan's default (flow sigmas, flow_prediction)
)
class xFuserSchedulerWrapper(xFuserSchedulerBaseWrapper):
    """Every listed scheduler steps on whole latents; no per-class change is needed yet."""
