"""SD3 / SD3.5: joint attention with the text (replicated) after the image shard; SD3.5's extra
image-only attention (attn2) is plain USP."""

from diffusers import SD3Transformer2DModel

from ...attention import TextLayout
from ...plans import Gather, ParallelPlan, PipeFusionPlan, Split
from ...register import xFuserTransformerWrappersRegister
from .base_transformer import xFuserTransformerBaseWrapper


@xFuserTransformerWrappersRegister.register(SD3Transformer2DModel)
class xFuserSD3Transformer2DWrapper(xFuserTransformerBaseWrapper):
    plan = ParallelPlan(
        outputs={"pos_embed": Split(dim=1, expected_dims=3), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn": TextLayout.SUFFIX, "transformer_blocks.*.attn2": TextLayout.NONE},
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks",),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("encoder_hidden_states", "hidden_states"),
        ),
    )
