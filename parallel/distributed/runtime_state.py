"""Per-job facts every wrapped layer may need: input size, token counts, step counter.

Set by the pipeline wrapper before the denoising loop; read by hooks and attention at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RuntimeState:
    height: int = 0
    width: int = 0
    batch_size: int = 0
    num_inference_steps: int = 0
    image_tokens: int = 0
    text_tokens: int = 0
    step_index: int = 0
    token_split: Any = None  # token_split.UnevenSplit while the token count does not divide by the sp degree
    text_mask_complete: bool = False  # the text's padding trimmed away (plans.TextPadding): its mask masks nothing
    run: int = 0  # counts jobs, so per-job state elsewhere (PipeFusion's warm-up per expert) knows a new one began
    flow_scheduler: Any = None  # the loop's scheduler where PipeFusion's patches may flow across steps (pipefusion.py)
    step_result: Any = None  # (latents) -> latents: replaces this rank's scheduler step result (PipeFusion's flow)
    flow_combine: Any = None  # (cond, uncond) -> prediction: a flowing step's guidance, per token (two calls per step)

    def set_input_parameters(
        self, *, height: int, width: int, batch_size: int, num_inference_steps: int, image_tokens: int
    ) -> None:
        self.height, self.width = height, width
        self.batch_size = batch_size
        self.num_inference_steps = num_inference_steps
        self.image_tokens = image_tokens
        self.text_tokens = 0
        self.step_index = 0
        self.token_split = None
        self.text_mask_complete = False
        self.flow_scheduler = self.step_result = self.flow_combine = None
        self.run += 1


_RUNTIME = RuntimeState()


def get_runtime_state() -> RuntimeState:
    return _RUNTIME


def reset_runtime_state() -> None:
    global _RUNTIME
    _RUNTIME = RuntimeState()
