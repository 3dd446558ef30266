"""MiniMax-H3's curve form: the files the ComfyUI templates ship (`*_pruned_*`) hold `adaln_t_table` [grid, k] in place
of the time embedder, and adaln projections that take the k coordinates of that table as they are (ComfyUI's
MiniMaxH3Model: `adaln_curve_grid`, `apply_silu=False`). diffusers' MiniMaxH3Transformer3DModel runs them after a
declared module swap, its forward untouched: `time_proj` passes the timestep through, `time_embedder` interpolates the
table at it, and every adaln module (the blocks' `adaln_proj`, `norm_out`) drops its SiLU.

The arithmetic is ComfyUI's: t clamped to [0, 1], the fractional row t·(grid−1), the two rows around it blended by
`torch.lerp` (t = 1 on the last interval), all in float32 — the table stays float32 whatever the compute dtype, as
ComfyUI keeps it, so the timestep is not rounded before it picks its rows.
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.models.transformers.transformer_minimax_h3 import (MiniMaxH3AdaLayerNormModulation,
                                                                   MiniMaxH3AdaLayerNormOut)
from torch import nn

TABLE = "adaln_t_table"  # the file's name, kept as the buffer's: `time_embedder.adaln_t_table` after conversion


class CurveTimeEmbedding(nn.Module):
    """The time embedding of a curve-form file: the table's rows interpolated at each timestep."""

    def __init__(self, grid: int, k: int):
        super().__init__()
        self.register_buffer(TABLE, torch.zeros(grid, k, dtype=torch.float32))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the loader casts every weight to the compute dtype; the table stays float32 (see the module's docstring)
        if prefix + TABLE in state_dict:
            state_dict[prefix + TABLE] = state_dict[prefix + TABLE].float()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        table = getattr(self, TABLE)
        position = timestep.float().clamp(0.0, 1.0) * (table.shape[0] - 1)
        low = position.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[low], table[low + 1], (position - low).unsqueeze(1))


class CurveModulation(MiniMaxH3AdaLayerNormModulation):
    """A block's adaln projection over the curve's coordinates: no SiLU before its linear."""

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        modulation = self.linear(temb.to(get_parameter_dtype(self.linear)))
        return modulation.view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


class CurveNormOut(MiniMaxH3AdaLayerNormOut):
    """The final norm's shift and scale over the curve's coordinates: no SiLU before its linear."""

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        shift, scale = self.linear(temb.to(get_parameter_dtype(self.linear))).chunk(2, dim=-1)
        return self.norm(hidden_states) * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(
            0, timestep_indices)


def use_curve_form(model: nn.Module, state_dict: dict) -> bool:
    """Swaps `model`'s time embedding and adaln modules for the curve form's when the converted `state_dict` holds the
    table (True); a file with a time embedder leaves the model as diffusers made it (False)."""
    table = state_dict.get(f"time_embedder.{TABLE}")
    if table is None:
        return False
    model.time_proj = nn.Identity()
    model.time_embedder = CurveTimeEmbedding(*table.shape)
    for block in model.transformer_blocks:
        block.adaln_proj.__class__ = CurveModulation
    model.norm_out.__class__ = CurveNormOut
    return True
