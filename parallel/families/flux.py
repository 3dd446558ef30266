"""Flux.1 (dev, schnell) and FLUX.1 Kontext: packed 2×2 latent tokens and their rotary ids split at the
input, the text replicated in front of the image shard in double- and single-stream blocks; true CFG
arrives as two calls per step (guidance_scale is the distilled guidance, which needs no second branch).

Kontext runs the same transformer on the noisy tokens followed by the reference image's tokens (its
packed latents and their ids, index 1): the input split shards both, unevenly where their sum does not
divide by the sequence-parallel degree, and the pipeline keeps the first (noisy) output tokens.

Single files: BFL's layout (double_blocks.*, single_blocks.*), converted by diffusers' own converter.

LoRA: BFL's own layout (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`, fused q/k/v) is
not converted by diffusers' Flux loader (it takes Kohya, XLabs and BFL *control* LoRAs). A LoRA on a
fused layer has one A and a stacked B, so it splits exactly into per-layer LoRAs: each part keeps A
and takes its rows of B.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ..call_parameters import CallParameter
from ..loading.checkpoints.shapes import Shapes
from ..layout.config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline import xFuserPipelineBaseWrapper
from ..model_executor.pipeline.img2img import linear_sigmas
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, PatchFlow, PipeFusionPlan, Split, TokenRows
from .base import FAMILIES, Family, SingleFile, TinyModel, Variant, pack_2x2, references, unpack_2x2
from .comfy_data import ComfyData


class xFuserFluxPipeline(xFuserPipelineBaseWrapper):
    default_sigmas = staticmethod(linear_sigmas)
    comfy = ComfyData(
        latent_formats={16: "Flux"}, packed=True, guidance_in_conditioning=True, model_class="Flux",
        model_call_conds={"context": "prompt_embeds", "y": "pooled_prompt_embeds", "guidance": "guidance"},
        expects="encode with xDiT Text Encode on this pool, or Flux's DualCLIPLoader (T5 4096 wide, pooled CLIP-L 768)",
    )
    tensor_inputs = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")
    latent_patch = 2  # the pipeline packs 2×2 latent pixels into one token
    embedding_sizes = {
        "prompt_embeds": "joint_attention_dim",
        "negative_prompt_embeds": "joint_attention_dim",
        "pooled_prompt_embeds": "pooled_projection_dim",
        "negative_pooled_prompt_embeds": "pooled_projection_dim",
    }
    call_parameters = {
        "true_cfg_scale": CallParameter(float, "real classifier-free guidance with negative embeddings (1: off)", 0.0, 100.0),
    }
    # guidance_scale is distilled guidance; real CFG is true_cfg_scale with a negative prompt
    guidance, guidance_needs_negative = ("true_cfg_scale", 1.0), True

    # guidance: the distilled guidance per sample (FluxGuidance); models without guidance_embeds ignore it
    model_call_inputs = ("prompt_embeds", "pooled_prompt_embeds", "guidance")
    model_call_required = ("prompt_embeds", "pooled_prompt_embeds")

    def model_call_arguments(self, latents, timestep, inputs):
        """FluxPipeline's loop: 2×2-packed tokens and their ids, timestep / 1000, guidance as given."""
        batch, _, height, width = latents.shape
        embeds = inputs["prompt_embeds"]
        guidance = inputs.get("guidance") if self.module.transformer.config.guidance_embeds else None
        if self.module.transformer.config.guidance_embeds and guidance is None:
            raise ValueError("this Flux model has distilled guidance: send 'guidance' (FluxGuidance's value) per sample")
        return {"hidden_states": pack_2x2(latents), "timestep": timestep / 1000, "guidance": guidance,
                "pooled_projections": inputs["pooled_prompt_embeds"], "encoder_hidden_states": embeds,
                "txt_ids": embeds.new_zeros(embeds.shape[1], 3),
                "img_ids": self.module._prepare_latent_image_ids(batch, height // 2, width // 2, latents.device, latents.dtype)}

    def comfy_model_class(self) -> str:
        return "Flux" if self.module.transformer.config.guidance_embeds else "FluxSchnell"

    def model_call_output(self, output, latents):
        return unpack_2x2(output, latents.shape[2] * 8, latents.shape[3] * 8)

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        return (batch, self.image_tokens(height, width), self.module.transformer.config.in_channels)

    def guidance_combine(self, kwargs: dict[str, Any]):
        """FluxPipeline's true CFG."""
        scale = kwargs.get("true_cfg_scale", 1.0)
        return lambda cond, uncond: uncond + scale * (cond - uncond)

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return (
            "CFG parallel on Flux needs true classifier-free guidance: true_cfg_scale above 1 "
            f"(got {kwargs.get('true_cfg_scale', 1.0)}) and negative prompt embeddings; guidance_scale is "
            "Flux's distilled guidance and needs no second branch. Add both or turn CFG parallel off."
        )

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.module.encode_prompt(prompt, None)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


class xFuserFluxKontextPipeline(xFuserFluxPipeline):
    """FluxKontextPipeline at exactly the requested size: it resizes height × width to `max_area` (1024²
    by default), so every call gets max_area = height·width; pixel references keep their own size
    (no snapping to Kontext's preferred resolutions)."""

    comfy = dataclasses.replace(  # ComfyUI's ReferenceLatent: `image` sampling, `reference_latents` in model calls
        xFuserFluxPipeline.comfy, reference_latents="image",
        model_call_conds={**xFuserFluxPipeline.comfy.model_call_conds, "ref_latents": "reference_latents"})
    tensor_inputs = (*xFuserFluxPipeline.tensor_inputs, "image")
    model_call_inputs = (*xFuserFluxPipeline.model_call_inputs, "reference_latents", "reference_sizes")

    def model_call_arguments(self, latents, timestep, inputs):
        """FluxKontextPipeline's loop: the reference's packed tokens after the noisy ones, their ids at index 1 (as
        ComfyUI's Flux places one ReferenceLatent)."""
        arguments = super().model_call_arguments(latents, timestep, inputs)
        images = references(inputs)
        if not images:
            return arguments
        if len(images) != 1:
            raise ValueError(f"FLUX.1 Kontext takes one reference image; this call has {len(images)}: chain one "
                             "ReferenceLatent node")
        reference = images[0]
        ids = self.module._prepare_latent_image_ids(reference.shape[0], reference.shape[2] // 2, reference.shape[3] // 2,
                                                    reference.device, reference.dtype)
        ids[..., 0] = 1
        return {**arguments, "hidden_states": torch.cat([arguments["hidden_states"], pack_2x2(reference)], dim=1),
                "img_ids": torch.cat([arguments["img_ids"], ids])}

    def model_call_output(self, output, latents):
        return super().model_call_output(output[:, : (latents.shape[2] // 2) * (latents.shape[3] // 2)], latents)

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        kwargs, batch, tokens = super().prepare(kwargs, check_layout)
        return {**kwargs, "max_area": kwargs["height"] * kwargs["width"], "_auto_resize": False}, batch, tokens

    def reference_tokens(self, image: Any) -> int:
        """Tokens the reference `image` adds: VAE latents [B, latent_channels, h, w] or pixels [B, 3, H, W]."""
        if image is None:
            return 0
        if not isinstance(image, torch.Tensor) or image.ndim != 4:
            raise ValueError("image must be one [B, C, H, W] tensor: the reference image's VAE latents or its pixels")
        channels, (height, width) = image.shape[1], image.shape[2:]
        if channels == self.module.latent_channels:
            if height % 2 or width % 2:
                raise ValueError(f"reference latents of {height}x{width} do not pack into 2x2 tokens; "
                                 "crop or resize the reference image to a multiple of 16 pixels")
            return (height // 2) * (width // 2)
        if channels != 3:
            raise ValueError(f"image has {channels} channels; send {self.module.latent_channels}-channel VAE latents "
                             "or 3-channel pixels in [0, 1]")
        step = self.module.vae_scale_factor * 2
        return (height // step) * (width // step)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        """PipeFusion's stale K/V are kept per named branch, which this pipeline's two true-CFG calls are not."""
        tokens = super().check_layout(kwargs, batch)
        c = self.parallel_config
        if (c.pipefusion_degree > 1 and c.cfg_degree == 1 and self.uses_cfg(kwargs)
                and c.warmup_steps < kwargs.get("num_inference_steps", 28)):
            raise LayoutError(
                "PipeFusion after warm-up with true CFG on FluxKontextPipeline would mix the two branches' stale "
                "K/V; turn on CFG parallel, set --warmup-steps to the step count, or set true_cfg_scale to 1."
            )
        return tokens


# -- LoRA: BFL layout → diffusers names ---------------------------------------------------------------
_BFL_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
    "img_mod.lin": ("norm1.linear",),
    "txt_mod.lin": ("norm1_context.linear",),
}
_BFL_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}
_BFL_LAYER = re.compile(r"^diffusion_model\.(double_blocks|single_blocks)\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def is_bfl_flux_lora(weights: dict[str, torch.Tensor]) -> bool:
    return any(_BFL_LAYER.match(key) for key in weights)


def bfl_flux_to_diffusers(weights: dict[str, torch.Tensor], inner_dim: int) -> dict[str, torch.Tensor]:
    """`transformer.`-prefixed PEFT keys for a BFL-layout Flux LoRA of the blocks."""
    out, unknown = {}, []
    for key, value in weights.items():
        match = _BFL_LAYER.match(key)
        table = (_BFL_DOUBLE if match and match[1] == "double_blocks" else _BFL_SINGLE) if match else {}
        if not match or match[3] not in table:
            unknown.append(key)
            continue
        kind, index, layer, ab = match.groups()
        block = f"transformer.{'transformer_blocks' if kind == 'double_blocks' else 'single_transformer_blocks'}.{index}"
        targets = table[layer]
        if ab == "A" or len(targets) == 1:
            parts = [value] * len(targets)
        else:  # fused output rows: q, k, v are inner_dim each; the rest is the MLP input projection
            sizes = [inner_dim] * 3 + ([value.shape[0] - 3 * inner_dim] if len(targets) == 4 else [])
            parts = list(value.split(sizes))
        for target, part in zip(targets, parts):
            out[f"{block}.{target}.lora_{ab}.weight"] = part.contiguous()
    if unknown:
        raise ValueError(f"BFL Flux LoRA has layers this loader does not map, e.g. {unknown[0]}")
    return out


def convert_lora(state: dict[str, torch.Tensor], transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    if not is_bfl_flux_lora(state):
        return state
    config = transformer.config
    return bfl_flux_to_diffusers(state, config.num_attention_heads * config.attention_head_dim)


# -- single-file checkpoints: BFL's layout -------------------------------------------------------------
def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    hidden, in_channels = shape("img_in.weight")
    out_channels = shape("final_layer.linear.weight")[0]
    if in_channels != out_channels:
        raise shape.error(f"a Flux.1 transformer with {in_channels} input and {out_channels} output channels (Fill / "
                          "Depth / Canny); only text-to-image Flux.1 dev and schnell are supported")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    guidance = "guidance_in.in_layer.weight" in shape
    # FLUX.1 Kontext [dev] has FLUX.1 [dev]'s weights' shapes: its file's name tells it (flux1-kontext-dev.safetensors)
    variant = ("flux1-kontext-dev" if shape.named("kontext") else "flux1-dev") if guidance else "flux1-schnell"
    return variant, {
        "in_channels": in_channels, "attention_head_dim": head_dim,
        "num_attention_heads": shape.heads(hidden, head_dim),
        "num_layers": shape.blocks(r"double_blocks\.(\d+)\."),
        "num_single_layers": shape.blocks(r"single_blocks\.(\d+)\."),
        "joint_attention_dim": shape("txt_in.weight")[1],
        "pooled_projection_dim": shape("vector_in.in_layer.weight")[1],
        "guidance_embeds": guidance, "axes_dims_rope": _rope_axes(head_dim),
    }


def _rope_axes(head_dim: int) -> list[int]:
    """RoPE has no weights; Flux.1 splits its 128 head dims 16 (index) + 56 + 56 (rows, columns).

    Other head sizes keep those proportions: each spatial axis 7/16 of the head, rounded down to even.
    """
    spatial = head_dim * 7 // 16 // 2 * 2
    return [head_dim - 2 * spatial, spatial, spatial]


# diffusers' Flux converter splits the single blocks' fused linear1 (q | k | v | mlp) at Flux.1's width:
# inner_dim = 3072, mlp 4 x 3072.
FLUX1_WIDTH = 3072


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    """diffusers' converter. A narrower Flux (the test models) gets its fused linear1 rows padded to the split
    diffusers expects and the pieces cut back after; Flux.1 checkpoints pass through untouched."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    width = config["num_attention_heads"] * config["attention_head_dim"]
    if width == FLUX1_WIDTH:
        return convert_flux_transformer_checkpoint_to_diffusers(state_dict)
    targets = [FLUX1_WIDTH] * 3 + [4 * FLUX1_WIDTH]
    sizes = {}
    for key in [k for k in state_dict if re.fullmatch(r"single_blocks\.\d+\.linear1\.(weight|bias)", k)]:
        fused = state_dict[key]
        sizes[key] = [width] * 3 + [fused.shape[0] - 3 * width]
        if not all(0 < size <= target for size, target in zip(sizes[key], targets)):
            raise ValueError(f"{key} has {fused.shape[0]} rows, which is not q, k, v of {width} and an MLP part "
                             f"no wider than Flux.1's ({4 * FLUX1_WIDTH})")
        state_dict[key] = torch.cat([torch.cat([piece, piece.new_zeros((target - len(piece), *piece.shape[1:]))])
                                     for piece, target in zip(fused.split(sizes[key]), targets)])
    converted = convert_flux_transformer_checkpoint_to_diffusers(state_dict)
    for key, (q, k, v, mlp) in sizes.items():
        block, kind = f"single_transformer_blocks.{key.split('.')[1]}.", key.rsplit(".", 1)[1]
        for name, rows in (("attn.to_q", q), ("attn.to_k", k), ("attn.to_v", v), ("proj_mlp", mlp)):
            converted[f"{block}{name}.{kind}"] = converted[f"{block}{name}.{kind}"][:rows]
    return converted


# -- tiny built-in model: Flux.1-dev style (guidance_embeds=True) ---------------------------------------
def build_tiny(seed: int, pipeline: str = "FluxPipeline"):
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from ..loading import tiny_models as tm

    tok, clip = tm._clip(seed + 1, False)
    tok2, t5 = tm._t5(seed + 2)
    transformer = tm._transformer(seed, FluxTransformer2DModel, patch_size=1, in_channels=64, num_layers=tm.BLOCKS // 2,
                                  num_single_layers=tm.BLOCKS // 2, joint_attention_dim=tm.T5_DIM,
                                  pooled_projection_dim=tm.CLIP_DIM, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    return getattr(diffusers, pipeline)(scheduler=scheduler, vae=tm._vae(seed + 3, 16, 0.3611, 0.1159), text_encoder=clip,
                        tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok2, transformer=transformer)


def tiny_inputs(**kwargs) -> dict:
    from ..loading import tiny_models as tm

    return tm.image_inputs(latent_channels=16, packed=True, pooled_dim=tm.CLIP_DIM, **kwargs)


def build_tiny_kontext(seed: int):
    return build_tiny(seed, "FluxKontextPipeline")


def tiny_kontext_inputs(**kwargs) -> dict:
    """Flux's inputs plus `image`: reference VAE latents [B, 16, H/8, W/8] of the output's size."""
    inputs = tiny_inputs(**kwargs)
    gen = torch.Generator().manual_seed(kwargs["seed"] + 1000)
    shape = (kwargs["batch"], 16, kwargs["height"] // 8, kwargs["width"] // 8)
    return {**inputs, "image": torch.randn(shape, generator=gen)}


TINY_TRUE_CFG = {"true_cfg_scale": 2.0}

FLUX = FAMILIES.register(Family(
    name="flux",
    pipelines={"FluxPipeline": xFuserFluxPipeline, "FluxKontextPipeline": xFuserFluxKontextPipeline},
    transformer="FluxTransformer2DModel",
    plan=ParallelPlan(
        inputs={"": {"hidden_states": Split(dim=1, expected_dims=3), "img_ids": Split(dim=0, expected_dims=2),
                     # the text too, where it divides (joint attention gathers the whole sequence per head)
                     "encoder_hidden_states": Split(dim=1, expected_dims=3, text=True),
                     "txt_ids": Split(dim=0, expected_dims=2, text=True)}},
        outputs={"proj_out": Gather(dim=1, expected_dims=3)},
        attention={
            "transformer_blocks.*.attn": TextLayout.PREFIX,
            "single_transformer_blocks.*.attn": TextLayout.PREFIX,
        },
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,  # Kontext: noisy + reference tokens need not divide by the degree
        pipefusion=PipeFusionPlan(
            blocks=("transformer_blocks", "single_transformer_blocks"),
            carried=("hidden_states", "encoder_hidden_states"),
            returns=("encoder_hidden_states", "hidden_states"),
            token_inputs={"image_rotary_emb": TokenRows(text=TextLayout.PREFIX)},
            stand_in=0,  # its blocks take a stream of no tokens
            flow=PatchFlow(embedder="x_embedder", output=(("norm_out", ("temb",)), ("proj_out", ()))),
        ),
    ),
    convert_lora=convert_lora,
    single_file=SingleFile(
        marker="double_blocks.0.img_mod.lin.weight",  # FLUX.2's double blocks share one modulation: no img_mod
        title="Flux.1",
        variants={
            "flux1-dev": Variant("flux", "Flux.1 dev", "BFL keys double_blocks.*, with guidance_in.*"),
            "flux1-schnell": Variant("flux", "Flux.1 schnell", "BFL keys double_blocks.*, no guidance_in.*"),
            "flux1-kontext-dev": Variant("flux-kontext", "FLUX.1 Kontext dev", "as Flux.1 dev, `kontext` in the file name"),
        },
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={
        "flux": TinyModel("FluxPipeline", build_tiny, tiny_inputs, guidance=3.5, true_cfg=TINY_TRUE_CFG),
        "flux-kontext": TinyModel("FluxKontextPipeline", build_tiny_kontext, tiny_kontext_inputs, guidance=3.5,
                                  true_cfg=TINY_TRUE_CFG),
    },
    attention_layers={"FluxAttention": "diffusers.models.transformers.transformer_flux"},
))
