"""PixArt-α/Σ: image tokens split after the patch embedding, self-attention USP, cross-attention local."""

from diffusers import PixArtTransformer2DModel

from ...attention import TextLayout
from ...plans import Gather, ParallelPlan, PipeFusionPlan, Split
from ...register import xFuserTransformerWrappersRegister
from .base_transformer import xFuserTransformerBaseWrapper


@xFuserTransformerWrappersRegister.register(PixArtTransformer2DModel)
class xFuserPixArtTransformer2DWrapper(xFuserTransformerBaseWrapper):
    plan = ParallelPlan(
        outputs={"pos_embed": Split(dim=1, expected_dims=3), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn1": TextLayout.NONE},
        pipefusion=PipeFusionPlan(blocks=("transformer_blocks",)),
    )
