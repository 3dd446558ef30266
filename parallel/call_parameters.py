"""Family scalars a job may set (Flux's `true_cfg_scale`, Wan's `num_frames`, Wan 2.2's `guidance_scale_2`).

Each family declares them once, on its pipeline wrapper (`call_parameters`). Requests carry them as a
generic `call` map that is checked here against that declaration, so neither the pool nor the CLI names
a family parameter: contract E, the pool CLI and rank 0 all accept exactly what the family declares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallParameter:
    """One keyword argument of the pipeline's `__call__` that a job may set."""

    kind: type  # int or float
    help: str
    minimum: float | None = None
    maximum: float | None = None

    def check(self, name: str, value: Any) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.kind is int and not isinstance(value, int)):
            raise ValueError(f"{name} must be {'an integer' if self.kind is int else 'a number'}, not {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, not {value}")
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"{low if low is not None else '-inf'} to {high if high is not None else 'inf'}"
            raise ValueError(f"{name} is {value}; use {span}")
        return self.kind(value)


def check_call(declared: dict[str, CallParameter], call: dict[str, Any], model: str) -> dict[str, int | float]:
    """`call` validated against what the family of `model` declares; one clear error otherwise."""
    unknown = sorted(set(call) - set(declared))
    if unknown:
        takes = ", ".join(sorted(declared)) or "no family parameters"
        raise ValueError(f"{model} does not take {', '.join(unknown)}; it takes {takes}")
    return {name: declared[name].check(name, value) for name, value in call.items()}
