"""Scheduler wrappers: the schedulers this engine has been verified with, and a step counter.

With sequence, CFG and data parallelism every rank holds the full latents at step boundaries, so the
scheduler's own step is exact; the wrapper counts steps in the runtime state (progress, warm-up).
"""

from __future__ import annotations

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
    def step(self, *args, **kwargs):
        result = self.module.step(*args, **kwargs)
        get_runtime_state().step_index += 1
        return result


@xFuserSchedulerWrappersRegister.register(
    DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, DDIMScheduler, EulerDiscreteScheduler,
    UniPCMultistepScheduler,  # Wan's default (flow sigmas, flow_prediction)
)
class xFuserSchedulerWrapper(xFuserSchedulerBaseWrapper):
    """Every listed scheduler steps on whole latents; no per-class change is needed yet."""
