"""Flux.1: packed image tokens and their rotary ids split at the input, text replicated in front of
the image shard in both double- and single-stream blocks; true CFG arrives as two calls per step."""

from diffusers import FluxTransformer2DModel

from ...attention import TextLayout
from ...plans import CfgMode, Gather, ParallelPlan, PipeFusionPlan, Split
from ...register import xFuserTransformerWrappersRegister
from .base_transformer import xFuserTransformerBaseWrapper


@xFuserTransformerWrappersRegister.register(FluxTransformer2DModel)
class xFuserFluxTransformer2DWrapper(xFuserTransformerBaseWrapper):
    plan = ParallelPlan(
        inputs={"": {"hidden_states": Split(dim=1, expected_dims=3), "img_ids": Split(dim=0, expected_dims=2)}},
        outputs={"proj_out": Gather(dim=1, expected_dims=3)},
        attention={
            "transformer_blocks.*.attn": TextLayout.PREFIX,
            "single_transformer_blocks.*.attn": TextLayout.PREFIX,
        },
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks", "single_transformer_blocks"),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("encoder_hidden_states", "hidden_states"),
            token_inputs={"image_rotary_emb": TextLayout.PREFIX},
        ),
    )
