"""Declarative parallel plans: what a transformer splits, where it gathers, which attention is joint.

A family's transformer wrapper is mostly one `ParallelPlan`, in the spirit of diffusers' `_cp_plan`.
Hooks apply it to the untouched diffusers module (see hooks.py); the capability table is derived
from the plans, so there is exactly one place that declares what a family supports.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .attention import TextLayout


@dataclass(frozen=True)
class Split:
    """Shard this tensor along `dim` (the token axis) over the sequence-parallel group."""

    dim: int


@dataclass(frozen=True)
class Gather:
    """All-gather this tensor along `dim` over the sequence-parallel group, undoing a Split."""

    dim: int


class CfgMode(enum.Enum):
    """How the pipeline presents the two guidance branches to the transformer."""

    BATCHED = "batched"  # one call on cat([uncond, cond]) (PixArt, SD3): split the batch
    SEQUENTIAL = "sequential"  # two calls per step in cache_context("cond"/"uncond") (Flux true CFG)


@dataclass(frozen=True)
class ParallelPlan:
    """How a transformer class is parallelised.

    inputs:    module path ("" = the transformer) → {forward argument: Split}, applied before it runs.
    outputs:   module path → Split or Gather, applied to the module's output (first element of a tuple).
    attention: glob over module paths → where that attention keeps replicated text tokens; every
               matching attention runs USP. Attention not listed (e.g. cross-attention) stays local.
    text_input: the forward argument whose token count is the text length for joint attention.
    cfg:       how guidance branches arrive (see CfgMode).
    """

    inputs: dict[str, dict[str, Split]] = field(default_factory=dict)
    outputs: dict[str, Split | Gather] = field(default_factory=dict)
    attention: dict[str, TextLayout] = field(default_factory=dict)
    text_input: str = "encoder_hidden_states"
    cfg: CfgMode = CfgMode.BATCHED
    cfg_branches: tuple[str, str] = ("uncond", "cond")

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.attention)
