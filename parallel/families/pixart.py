"""PixArt-α and PixArt-Σ: one transformer class (PixArtTransformer2DModel) and one call.

Image tokens split after the patch embedding, self-attention runs USP, cross-attention to the T5
caption stays local; CFG arrives batched. ComfyUI keeps PixArt-α latents in SD1.5's format and
PixArt-Σ latents in SDXL's, and passes T5 attention masks in the conditioning.

A model call is ComfyUI's PixArt (comfy/ldm/pixart/pixartms.py): its own discrete timestep, the T5 text unmasked
(ComfyUI's T5 for PixArt pads nothing and its model passes no mask), the α micro-conditions (ComfyUI's c_size
[h, w] and c_ar in pixels), the positions' grid laid by the call's size, and the noise alone (the learned-sigma
channels dropped).

Single files: the PixArt repository's own layout (blocks.*.cross_attn, .pth or .safetensors), converted
by a port of diffusers' PixArt conversion script (diffusers has no PixArt single-file loader).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..loading.checkpoints.shapes import Shapes
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline import xFuserPipelineBaseWrapper
from ..model_executor.plans import Gather, ParallelPlan, PipeFusionPlan, Split
from .base import FAMILIES, Family, SingleFile, TinyModel, Variant, replaced
from .comfy_data import ComfyData

EXPECTS = "encode with xDiT Text Encode on this pool, or PixArt's T5-XXL encoder"
# ComfyUI's PixArt passes c_size and c_ar to every file; those without micro-conditions (Σ) ignore them
MODEL_CALL_CONDS = {"context": "prompt_embeds", "c_size": "resolution", "c_ar": "aspect_ratio"}


class xFuserPixArtAlphaPipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(latent_formats={4: "SD15"}, model_class="PixArtAlpha", model_call_conds=MODEL_CALL_CONDS,
                      model_call_timestep=True, expects=EXPECTS)
    tensor_inputs = ("prompt_attention_mask", "negative_prompt_attention_mask")
    # Resolution binning would resize to the model's aspect-ratio bins; given embeddings need no prompt.
    call_defaults = {"use_resolution_binning": False, "negative_prompt": None}
    embedding_sizes = {"prompt_embeds": "caption_channels", "negative_prompt_embeds": "caption_channels"}

    model_call_inputs = ("prompt_embeds", "prompt_attention_mask", "resolution", "aspect_ratio")
    model_call_required = ("prompt_embeds",)

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = self.module.encode_prompt(prompt, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def model_call_arguments(self, latents, timestep, inputs):
        """The pipeline's loop: latents as they are, the timestep per sample, the text's mask where the call has one
        (ComfyUI's has none), micro-conditions where the transformer takes them."""
        added = {"resolution": None, "aspect_ratio": None}
        if self.module.transformer.config.use_additional_conditions:
            missing = [name for name in added if name not in inputs]
            if missing:
                raise ValueError(f"this PixArt takes micro-conditions: a model call needs {missing} (ComfyUI's c_size, c_ar)")
            added = {name: inputs[name] for name in added}
        return {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": inputs["prompt_embeds"],
                "encoder_attention_mask": inputs.get("prompt_attention_mask"), "added_cond_kwargs": added}

    def model_call_context(self, transformer, inputs):
        """ComfyUI's PixArt lays its sin-cos positions on a grid of round(side / 64) · 64 latent pixels (side: the mean
        of height and width) with the file's interpolation, or round(side / 64) where the file saves no table (the
        config's None); diffusers' PatchEmbed on the config's sample size: ComfyUI's, for this call."""
        height, width = inputs["latents"].shape[-2:]
        side = (height + width) // 2
        if round(side / 64) == 0:
            raise ValueError(f"ComfyUI's PixArt has no positions for {height}x{width} latents (a grid of 0: it divides by "
                             "zero below 32 latent pixels a side on average); sample at 256 px or more")
        module = transformer.module
        embed = module.pos_embed
        scale = module.config.interpolation_scale or round(side / 64.0)
        stack = contextlib.ExitStack()
        # height -1: no stored table fits, so PatchEmbed lays the positions for this call
        for name, value in (("base_size", round(side / 64) * 64 // embed.patch_size), ("interpolation_scale", scale),
                            ("height", -1)):
            stack.enter_context(replaced(embed, name, value))
        return stack

    def model_call_output(self, output, latents):
        """The noise alone, as ComfyUI's PixArt returns it (the pipeline drops the learned-sigma half too)."""
        return output[:, : latents.shape[1]]


class xFuserPixArtSigmaPipeline(xFuserPixArtAlphaPipeline):
    """Same transformer class and call as PixArt-α; SDXL's latent format."""

    comfy = ComfyData(latent_formats={4: "SDXL"}, model_class="PixArtSigma", model_call_conds=MODEL_CALL_CONDS,
                      model_call_timestep=True, expects=EXPECTS)


# -- single-file checkpoints: the PixArt repository's layout ---------------------------------------------
HEAD_DIM = 72  # PixArt-XL: 16 heads of 72; no weight shows it
CAPTION_TOKENS = {120: "pixart-alpha-1024", 300: "pixart-sigma-1024"}  # T5 lengths: α 120, Σ 300


def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    if any(".q_norm." in k or ".k_norm." in k or ".sr." in k for k in shape.shapes):
        from ..loading.checkpoints.detect import supported_list

        raise shape.error("a PixArt with q/k norm or KV compression, which diffusers' PixArt transformer does not "
                          "implement; supported: " + supported_list())
    micro = "csize_embedder.mlp.0.weight" in shape
    if "y_embedder.y_embedding" in shape:
        tokens = shape("y_embedder.y_embedding")[0]
        if tokens not in CAPTION_TOKENS:
            raise shape.error(f"a PixArt with {tokens} caption tokens; known are { {v: k for k, v in CAPTION_TOKENS.items()} }")
        variant = CAPTION_TOKENS[tokens]
    else:  # no caption null-embedding saved: ComfyUI's rule, α-1024 has micro-conditions and Σ has none
        variant = "pixart-alpha-1024" if micro else "pixart-sigma-1024"
    hidden, in_channels, patch, _ = shape("x_embedder.proj.weight")
    overrides = {
        "in_channels": in_channels, "out_channels": shape("final_layer.linear.weight")[0] // patch**2,
        "patch_size": patch, "attention_head_dim": HEAD_DIM,
        "num_attention_heads": shape.heads(hidden, HEAD_DIM), "num_layers": shape.blocks(r"blocks\.(\d+)\."),
        "cross_attention_dim": hidden, "caption_channels": shape("y_embedder.y_proj.fc1.weight")[1],
        "use_additional_conditions": micro,
    }
    if "pos_embed" in shape:  # the saved sin-cos table gives the training resolution (latent side = grid x patch)
        sample_size = math.isqrt(shape("pos_embed")[1]) * patch
        # PixArt's pe_interpolation is resolution / 512 (1 at 512 px, 2 at 1024, 4 at 2K)
        overrides.update(sample_size=sample_size, interpolation_scale=max(sample_size // 64, 1))
    else:  # none saved: ComfyUI scales the positions by each call's size (diffusers: by sample_size, the same there)
        overrides["interpolation_scale"] = None
    return variant, overrides


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    """PixArt-α/Σ original keys → diffusers names (the layout diffusers' PixArt conversion script documents)."""
    out = {}

    def move(src: str, dst: str) -> None:
        for kind in ("weight", "bias"):
            out[f"{dst}.{kind}"] = state_dict.pop(f"{src}.{kind}")

    def split(src: str, *dsts: str) -> None:  # fused q|k|v or k|v rows
        for kind in ("weight", "bias"):
            for dst, piece in zip(dsts, torch.chunk(state_dict.pop(f"{src}.{kind}"), len(dsts), dim=0)):
                out[f"{dst}.{kind}"] = piece

    move("x_embedder.proj", "pos_embed.proj")
    move("y_embedder.y_proj.fc1", "caption_projection.linear_1")
    move("y_embedder.y_proj.fc2", "caption_projection.linear_2")
    emb = "adaln_single.emb."
    move("t_embedder.mlp.0", emb + "timestep_embedder.linear_1")
    move("t_embedder.mlp.2", emb + "timestep_embedder.linear_2")
    if config["use_additional_conditions"]:  # PixArt-α 1024-MS micro-conditions: resolution and aspect ratio
        for src, dst in (("csize_embedder", "resolution_embedder"), ("ar_embedder", "aspect_ratio_embedder")):
            move(f"{src}.mlp.0", f"{emb}{dst}.linear_1")
            move(f"{src}.mlp.2", f"{emb}{dst}.linear_2")
    move("t_block.1", "adaln_single.linear")
    for i in range(config["num_layers"]):
        src, dst = f"blocks.{i}.", f"transformer_blocks.{i}."
        out[dst + "scale_shift_table"] = state_dict.pop(src + "scale_shift_table")
        split(src + "attn.qkv", dst + "attn1.to_q", dst + "attn1.to_k", dst + "attn1.to_v")
        move(src + "attn.proj", dst + "attn1.to_out.0")
        move(src + "cross_attn.q_linear", dst + "attn2.to_q")
        split(src + "cross_attn.kv_linear", dst + "attn2.to_k", dst + "attn2.to_v")
        move(src + "cross_attn.proj", dst + "attn2.to_out.0")
        move(src + "mlp.fc1", dst + "ff.net.0.proj")
        move(src + "mlp.fc2", dst + "ff.net.2")
    move("final_layer.linear", "proj_out")
    out["scale_shift_table"] = state_dict.pop("final_layer.scale_shift_table")
    return out  # left behind on purpose: y_embedder.y_embedding (training's null caption), pos_embed (recomputed)


# -- tiny built-in models ------------------------------------------------------------------------------
def _tiny(alpha: bool) -> TinyModel:
    def build(seed: int):
        from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline, PixArtTransformer2DModel

        from ..loading import tiny_models as tm

        tok, t5 = tm._t5(seed + 1)
        # out_channels = 2 * in_channels: learned sigma, as in the real checkpoints (the pipeline drops it).
        transformer = tm._transformer(seed, PixArtTransformer2DModel, in_channels=4, out_channels=8, num_layers=tm.BLOCKS,
                                      sample_size=8, patch_size=2, cross_attention_dim=tm.HEADS * tm.HEAD_DIM,
                                      caption_channels=tm.T5_DIM, norm_num_groups=4, use_additional_conditions=False)
        vae = tm._vae(seed + 2, 4, 0.18215 if alpha else 0.13025)
        # An untrained epsilon-prediction PixArt blows latents up ~100-200x; v-prediction keeps them O(1).
        scheduler = DPMSolverMultistepScheduler(prediction_type="v_prediction")
        cls = PixArtAlphaPipeline if alpha else PixArtSigmaPipeline
        return cls(tokenizer=tok, text_encoder=t5, vae=vae, transformer=transformer, scheduler=scheduler)

    def inputs(**kwargs) -> dict:
        from ..loading import tiny_models as tm

        return tm.image_inputs(latent_channels=4, packed=False, pooled_dim=None, **kwargs)

    return TinyModel("PixArtAlphaPipeline" if alpha else "PixArtSigmaPipeline", build, inputs)


PIXART = FAMILIES.register(Family(
    name="pixart",
    pipelines={"PixArtAlphaPipeline": xFuserPixArtAlphaPipeline, "PixArtSigmaPipeline": xFuserPixArtSigmaPipeline},
    transformer="PixArtTransformer2DModel",
    plan=ParallelPlan(
        outputs={"pos_embed": Split(dim=1, expected_dims=3), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn1": TextLayout.NONE},
        pipefusion=PipeFusionPlan(blocks=("transformer_blocks",)),
    ),
    single_file=SingleFile(
        marker="blocks.0.cross_attn.q_linear.weight",
        title="PixArt",
        variants={
            "pixart-alpha-1024": Variant("pixart-alpha", "PixArt-α XL-2 1024-MS", "PixArt keys blocks.*.cross_attn, 120 tokens"),
            "pixart-sigma-1024": Variant("pixart-sigma", "PixArt-Σ XL-2 1024-MS", "PixArt keys blocks.*.cross_attn, 300 tokens"),
        },
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={"pixart-alpha": _tiny(alpha=True), "pixart-sigma": _tiny(alpha=False)},
))
