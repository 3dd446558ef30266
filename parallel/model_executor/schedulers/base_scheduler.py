"""Scheduler wrappers: the schedulers this engine has been verified with, and a step counter.

With sequence, CFG and data parallelism every rank holds the full latents at step boundaries, so the
scheduler's own step is exact; the wrapper counts steps in the runtime state (progress, warm-up).
"""

from __future__ import annotations

import contextlib

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
    _tail_of: int | None = None

    def step(self, *args, **kwargs):
        result = self.module.step(*args, **kwargs)
        get_runtime_state().step_index += 1
        return result

    @contextlib.contextmanager
    def tail_of(self, total: int):
        """Inside: `set_timesteps(n)` sets the last n steps of a `total`-step schedule, as diffusers'
        img2img pipelines do (the full schedule with its timesteps cut and the begin index moved), for
        pipelines that take neither sigmas nor timesteps (Wan)."""
        self._tail_of = total
        try:
            yield
        finally:
            self._tail_of = None

    def set_timesteps(self, num_inference_steps: int | None = None, *args, **kwargs):
        if self._tail_of is None:
            return self.module.set_timesteps(num_inference_steps, *args, **kwargs)
        self.module.set_timesteps(self._tail_of, *args, **kwargs)
        start = (self._tail_of - num_inference_steps) * self.module.order
        self.module.timesteps = self.module.timesteps[start:]
        self.module.set_begin_index(start)


@xFuserSchedulerWrappersRegister.register(
    DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, DDIMScheduler, EulerDiscreteScheduler,
    UniPCMultistepScheduler,  # Wan's default (flow sigmas, flow_prediction)
)
class xFuserSchedulerWrapper(xFuserSchedulerBaseWrapper):
    """Every listed scheduler steps on whole latents; no per-class change is needed yet."""
