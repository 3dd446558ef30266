"""Qwen-Image: an MMDiT over packed 2×2 latent tokens with Qwen2.5-VL text, true CFG as two calls.

The image tokens are split at the transformer's input and their rotary table (the first of the two
tables `pos_embed` returns; the text's second one stays whole) with them; the text is replicated in
front of every image shard in the joint attention. The text mask (`prompt_embeds_mask`) marks padding
only where prompts of different lengths share a batch; sequence-parallel attention takes no mask, so
trailing padding common to the whole batch is trimmed away before the call (exact: padded keys are
masked out and the text's rotary positions start at 0 either way), an all-valid mask is dropped, and
prompts that still differ in length are refused under Ulysses, Ring and PipeFusion with one line.

Single files (Comfy-Org's `qwen_image_*.safetensors`, also fp8 and GGUF) keep diffusers' own names, under
ComfyUI's `model.diffusion_model.` prefix where it is whole-checkpoint; the rotary axes have no weights and
follow the head size in Qwen-Image's proportions (16 + 56 + 56 of 128).

Qwen-Image-Edit (`QwenImageEditPipeline`) and Edit Plus (`QwenImageEditPlusPipeline`, several references) run the
same transformer on the noisy tokens followed by each reference image's tokens (`img_shapes` lists them; the
rotary table covers them all): the plan splits that whole sequence, so the reference tokens are sharded with the
noisy ones, and the pipeline keeps the noisy part of the gathered output; PipeFusion's patches cut that whole
sequence too (the base's check: the total divides into patches). References come as pixels (encoded by the
pipeline at ~1024²) or as latents (ComfyUI's ReferenceLatent), which the pipeline's sizing and VAE encode are
answered with. A model call (ComfyUI's samplers on any Qwen-Image pool) takes the references as ComfyUI's model
places them: at frame index 1, 2, ... (`index`, img_shapes), and with 2511's `index_timestep_zero` also modulated at
timestep 0 (diffusers' `zero_cond_t`, switched on for that call; its per-token `modulate_index` split with the tokens).

Its attention layers are diffusers' shared `Attention` class with a processor that calls
`dispatch_attention_fn`, so the family declares the processor (`attention_layers`).
"""

from __future__ import annotations

from ...loading.checkpoints.shapes import Shapes
from ...model_executor.attention import TextLayout
from ...model_executor.plans import CfgMode, Gather, ParallelPlan, PatchFlow, PipeFusionPlan, Split, TokenRows
from ..base import FAMILIES, Family, SingleFile, TinyModel, Variant
from .pipelines import xFuserQwenImageEditPipeline, xFuserQwenImageEditPlusPipeline, xFuserQwenImagePipeline
from .tiny import build_tiny, tiny_edit_inputs, tiny_inputs


# -- single-file checkpoints: diffusers' own names -----------------------------------------------------------
ZERO_COND_MARKER = "__index_timestep_zero__"  # Comfy-Org's Qwen-Image-Edit 2511 files: references at timestep 0


def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    hidden, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    spatial = head_dim * 7 // 16 // 2 * 2
    if "transformer_blocks.0.img_mod.1.weight" not in shape or "time_text_embed.addition_t_embedding.weight" in shape:
        raise shape.error("a Qwen-Image transformer of a variant this pack does not support (only Qwen-Image text-to-image)")
    return "qwen-image", {
        "zero_cond_t": ZERO_COND_MARKER in shape,
        "in_channels": in_channels, "out_channels": shape("proj_out.weight")[0] // 4, "attention_head_dim": head_dim,
        "num_attention_heads": shape.heads(hidden, head_dim), "num_layers": shape.blocks(r"transformer_blocks\.(\d+)\."),
        "joint_attention_dim": shape("txt_in.weight")[1], "axes_dims_rope": [head_dim - 2 * spatial, spatial, spatial],
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    """Already diffusers' names; 2511's marker (an empty tensor) read as the config's zero_cond_t instead."""
    return {name: tensor for name, tensor in state_dict.items() if name != ZERO_COND_MARKER}

QWEN_IMAGE = FAMILIES.register(Family(
    name="qwen-image",
    pipelines={"QwenImagePipeline": xFuserQwenImagePipeline, "QwenImageEditPipeline": xFuserQwenImageEditPipeline,
               "QwenImageEditPlusPipeline": xFuserQwenImageEditPlusPipeline},
    transformer="QwenImageTransformer2DModel",
    plan=ParallelPlan(
        # modulate_index: 2511's (zero_cond_t) per-token choice of modulation, split with the tokens at each block
        inputs={"": {"hidden_states": Split(dim=1, expected_dims=3)},
                "transformer_blocks.*": {"modulate_index": Split(dim=1, expected_dims=2)}},
        outputs={"pos_embed": Split(dim=0, items=(0,), expected_dims=2), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn": TextLayout.PREFIX},
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks",),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("encoder_hidden_states", "hidden_states"),
            token_inputs={"image_rotary_emb": TokenRows(dim=0, items=(0,))},  # the image's table; the text's whole
            flow=PatchFlow(embedder="img_in", output=(("norm_out", ("temb",)), ("proj_out", ()))),
        ),
    ),
    single_file=SingleFile(
        marker="txt_norm.weight",
        title="Qwen-Image",
        variants={"qwen-image": Variant("qwen-image", "Qwen-Image", "diffusers' keys img_in.*, txt_norm.*, transformer_blocks.*")},
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={"qwen-image": TinyModel("QwenImagePipeline", build_tiny, tiny_inputs, guidance=1.0,
                                  true_cfg={"true_cfg_scale": 4.0}),
          "qwen-image-edit": TinyModel("QwenImageEditPipeline", lambda seed: build_tiny(seed, "QwenImageEditPipeline"),
                                       lambda **kwargs: tiny_edit_inputs(1, **kwargs), guidance=1.0,
                                       true_cfg={"true_cfg_scale": 4.0}),
          "qwen-image-edit-plus": TinyModel("QwenImageEditPlusPipeline",
                                            lambda seed: build_tiny(seed, "QwenImageEditPlusPipeline"),
                                            lambda **kwargs: tiny_edit_inputs(2, **kwargs), guidance=1.0,
                                            true_cfg={"true_cfg_scale": 4.0})},
    attention_layers={"QwenDoubleStreamAttnProcessor2_0": "diffusers.models.transformers.transformer_qwenimage"},
))
