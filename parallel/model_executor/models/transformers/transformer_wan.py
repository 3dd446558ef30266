"""Wan 2.1 / 2.2: video tokens and their 3-D rotary embedding split alike, self-attention USP,
cross-attention to the text (and Wan 2.1 I2V's image tokens) local; CFG arrives as two calls.

As diffusers' own `_cp_plan` for this class: the rotary embedding (cos, sin) is split on the token
axis, the patch-embedded tokens are split where they enter the first block, and proj_out gathers;
Wan 2.2 TI2V's per-token timesteps ([B, S]) are split alike, so its per-token modulation matches.
Token counts (frames × H/16 × W/16) that do not divide by the sequence-parallel degree are split
unevenly (see token_split.py).
"""

import torch
from diffusers import WanTransformer3DModel

from ...attention import TextLayout
from ...plans import CfgMode, Gather, ParallelPlan, Split
from ...register import xFuserTransformerWrappersRegister
from .base_transformer import xFuserTransformerBaseWrapper


@xFuserTransformerWrappersRegister.register(WanTransformer3DModel)
class xFuserWanTransformer3DWrapper(xFuserTransformerBaseWrapper):
    plan = ParallelPlan(
        inputs={"": {"timestep": Split(dim=1, ndim=2)}, "blocks.0": {"hidden_states": Split(dim=1, expected_dims=3)}},
        outputs={"rope": Split(dim=1, items=(0, 1), expected_dims=4), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"blocks.*.attn1": TextLayout.NONE},
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
    )

    def empty_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Image-to-video inputs carry the image condition too (36 channels); the output has out_channels."""
        shape = (hidden_states.shape[0], self.module.config.out_channels, *hidden_states.shape[2:])
        return hidden_states.new_empty(shape)
