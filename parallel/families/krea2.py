"""Krea 2 (Raw and Turbo): one stream of single-stream blocks over [text; image], Qwen3-VL text.

Its text is a stack of Qwen3-VL hidden layers per token ([B, tokens, layers, width]), fused into one sequence by a
small text transformer inside the model, then joined in front of the packed 2×2 latent tokens; the blocks run on
the joined sequence with one rotary table (text rows all at the origin). Sequence parallel splits that joined
sequence, text with image alike (unevenly where it does not divide), entering the first block, and the rotary table
where it is made; the short text fusion runs whole on every rank. PipeFusion pipelines the blocks, a patch a slice
of the joined sequence (as Z-Image's).

Its pipeline pads every prompt to 512 tokens in the middle (the chat suffix follows the padding) and masks the
padding; the text's rows sit at the rotary origin and its fusion has no positions, so the valid tokens are moved
to the front and the rest trimmed before the transformer runs (`TextPadding(order_free=True)`): exact, and with
one prompt per call no mask is left, which sequence-parallel attention needs. Prompts of one batch that still
differ in length are refused there in one line.

Classifier-free guidance is Krea's own, `cond + guidance_scale · (cond − uncond)` (on whenever guidance_scale > 0;
Turbo samples with 0), as two calls per step that name no branch (the plan's order: cond first). ComfyUI's cfg is
that scale + 1 (`cfg_offset`), its latents are Wan 2.1's (Qwen-Image's VAE), its conditioning the layers
flattened, [B, tokens, layers · width] (CLIPLoader type krea2), which the wrapper unflattens.

Single files (Krea's / Comfy-Org's repackaged `krea2_*.safetensors`: `first.*`, `blocks.*`, `txtfusion.*`; also fp8
and GGUF) are converted by diffusers' own converter; every size reads from the shapes; Turbo (few-step, fixed
shift) from the file name. LoRAs: diffusers' Krea 2 loader reads Krea's and AI-Toolkit's layouts itself.

No step cache: diffusers gives its transformer no cache hooks (no CacheMixin), so `--cache` is refused in one line
(model_executor/step_cache.py), the reason `--list-supported` prints.
"""

from __future__ import annotations

from typing import Any

import torch

from ..loading.checkpoints.shapes import Shapes
from ..layout.config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline import xFuserPipelineBaseWrapper
from ..model_executor.pipeline.img2img import linear_sigmas
from ..model_executor.plans import (CfgMode, Gather, ParallelPlan, PipeFusionPlan, Split, TextPadding, TokenRows)
from .base import FAMILIES, Family, SingleFile, TinyModel, Variant, pack_2x2, unpack_2x2
from .comfy_data import ComfyData

TEXTS = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}


class xFuserKrea2Pipeline(xFuserPipelineBaseWrapper):
    default_sigmas = staticmethod(linear_sigmas)
    comfy = ComfyData(
        latent_formats={16: "Wan21"}, packed=True, cfg_offset=1.0, model_class="Krea2",
        model_call_conds={"context": "prompt_embeds"}, text_masks={"prompt_embeds": "prompt_embeds_mask"},
        expects="encode with xDiT Text Encode on this pool, or on ComfyUI 0.33 with CLIPLoader type krea2 (Qwen3-VL 4B, "
                "12 hidden layers stacked: 30720 wide)",
        empty_latent="EmptySD3LatentImage (16 channels)",
    )
    tensor_inputs = tuple(TEXTS.values())
    latent_patch = 2
    # the stacked layers, flattened as ComfyUI carries them (or [B, tokens, layers, width] as the pipeline takes them)
    embedding_sizes = {name: ("num_text_layers", "text_hidden_dim") for name in TEXTS}
    model_call_inputs, model_call_required = ("prompt_embeds", "prompt_embeds_mask"), ("prompt_embeds",)

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("guidance_scale", 4.5) > 0

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return ("CFG parallel on Krea 2 needs guidance_scale above 0 (got "
                f"{kwargs.get('guidance_scale', 4.5)}); Krea 2 Turbo samples without guidance: turn CFG parallel off.")

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        return (batch, self.image_tokens(height, width), self.module.transformer.config.in_channels)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        """PipeFusion keeps stale K/V per named branch, which this pipeline's two guidance calls are not; its patches
        cut the joined [valid text; image] sequence, which must divide into them."""
        tokens = super().check_layout(kwargs, batch)
        c = self.parallel_config
        if c.pipefusion_degree == 1:
            return tokens
        if self.uses_cfg(kwargs) and c.cfg_degree == 1 and c.warmup_steps < kwargs.get("num_inference_steps", 28):
            raise LayoutError("PipeFusion after warm-up with guidance on Krea2Pipeline would mix the two branches' stale "
                              "K/V; turn on CFG parallel, set --warmup-steps to the step count, or set guidance_scale to 0.")
        for mask in TEXTS.values():
            if isinstance(kwargs.get(mask), torch.Tensor):
                text = int(kwargs[mask].bool().sum(dim=1).max())
                if (text + tokens) % (c.patches * c.sp_degree):
                    raise LayoutError(f"{text} valid text tokens and {tokens} image tokens do not split into {c.patches} "
                                      f"PipeFusion patches × sequence-parallel degree {c.sp_degree}: PipeFusion cuts them "
                                      f"joined; choose a size or a prompt whose sum divides by {c.patches * c.sp_degree}")
        return tokens

    def converted(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = self._unflattened(kwargs)
        for embeds, mask in TEXTS.items():  # the pipeline needs a mask with given embeddings: none given is all valid
            if isinstance(kwargs.get(embeds), torch.Tensor):
                given = kwargs.get(mask)
                kwargs[mask] = (torch.ones(kwargs[embeds].shape[:2], dtype=torch.bool, device=kwargs[embeds].device)
                                if given is None else given.bool())
        # Its loop takes both texts' positions from the prompt's length: a shorter text (ComfyUI's carry no padding)
        # is padded at its end, masked, which changes nothing (the text carries no position)
        longest = max((kwargs[name].shape[1] for name in TEXTS if isinstance(kwargs.get(name), torch.Tensor)), default=0)
        for embeds, mask in TEXTS.items():
            short = longest - kwargs[embeds].shape[1] if isinstance(kwargs.get(embeds), torch.Tensor) else 0
            if short:
                kwargs[embeds] = torch.nn.functional.pad(kwargs[embeds], (0, 0, 0, 0, 0, short))
                kwargs[mask] = torch.nn.functional.pad(kwargs[mask], (0, short), value=False)
        return kwargs

    def _unflattened(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Embeddings [B, tokens, layers · width] (ComfyUI's conditioning) as the pipeline takes them, [B, tokens,
        layers, width]."""
        layers = self.module.transformer.config.num_text_layers
        out = dict(kwargs)
        for name in TEXTS:
            value = out.get(name)
            if isinstance(value, torch.Tensor) and value.ndim == 3:
                if value.shape[-1] % layers:
                    raise ValueError(f"{name} is {value.shape[-1]} wide, which is not {layers} stacked text layers; "
                                     f"encode the prompt with this model's own text encoder")
                out[name] = value.unflatten(-1, (layers, -1))
        return out

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """The pipeline's encoding as ComfyUI's CLIPLoader krea2 gives it: the valid tokens alone (the text carries no
        position, so dropping its masked padding is exact) and the layers flattened. ComfyUI's own Krea 2 takes no
        mask, so the conditioning then samples alike on it and on the pool."""
        embeds, mask = self.module.encode_prompt(prompt, device=self.module.transformer.device)
        return {"prompt_embeds": embeds[:, mask[0].bool()].flatten(2)}

    def model_call_arguments(self, latents, timestep, inputs):
        """Krea2Pipeline's loop: 2×2-packed tokens, their and the text's positions, timestep / 1000, the text's mask
        (without one all valid, as ComfyUI's own Krea 2 takes its text)."""
        batch, _, height, width = latents.shape
        embeds = self._unflattened({"prompt_embeds": inputs["prompt_embeds"]})["prompt_embeds"]
        positions = self.module.prepare_position_ids(embeds.shape[1], height // 2, width // 2, latents.device)
        mask = inputs.get("prompt_embeds_mask")
        mask = torch.ones(batch, embeds.shape[1], dtype=torch.bool, device=embeds.device) if mask is None else mask.bool()
        return {"hidden_states": pack_2x2(latents), "encoder_hidden_states": embeds, "timestep": timestep / 1000,
                "position_ids": positions, "encoder_attention_mask": mask}

    def model_call_output(self, output, latents):
        return unpack_2x2(output, latents.shape[2] * 8, latents.shape[3] * 8)



# -- single-file checkpoints: Krea's layout, diffusers' converter ---------------------------------------------
def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    """Every size from the shapes (the head sizes from the q/k norms); Turbo, whose weights look alike, by name."""
    hidden, in_channels = shape("first.weight")
    head_dim = shape("blocks.0.attn.qknorm.qnorm.scale")[0]
    text_dim = shape("txtfusion.layerwise_blocks.0.prenorm.scale")[0]
    text_head_dim = shape("txtfusion.layerwise_blocks.0.attn.qknorm.qnorm.scale")[0]
    text_heads = shape.heads(text_dim, text_head_dim)
    variant = "krea2-turbo" if shape.named("turbo") else "krea2"
    return variant, {
        "in_channels": in_channels, "num_layers": shape.blocks(r"blocks\.(\d+)\."), "attention_head_dim": head_dim,
        "num_attention_heads": shape.heads(hidden, head_dim),
        "num_key_value_heads": shape.heads(shape("blocks.0.attn.wk.weight")[0], head_dim),
        "intermediate_size": shape("blocks.0.mlp.gate.weight")[0], "timestep_embed_dim": shape("tmlp.0.weight")[1],
        "text_hidden_dim": text_dim, "num_text_layers": shape("txtfusion.projector.weight")[1],
        "text_num_attention_heads": text_heads,
        "text_num_key_value_heads": shape.heads(shape("txtfusion.layerwise_blocks.0.attn.wk.weight")[0], text_head_dim),
        "text_intermediate_size": shape("txtfusion.layerwise_blocks.0.mlp.gate.weight")[0],
        "num_layerwise_text_blocks": shape.blocks(r"txtfusion\.layerwise_blocks\.(\d+)\."),
        "num_refiner_text_blocks": shape.blocks(r"txtfusion\.refiner_blocks\.(\d+)\."),
        "axes_dims_rope": rope_axes(head_dim),
    }


def rope_axes(head_dim: int) -> list[int]:
    """No weights show them: ComfyUI's and Krea's split of a head, 32 + 48 + 48 of 128 (6/16 per spatial axis)."""
    spatial = 6 * (head_dim // 16)
    return [head_dim - 2 * spatial, spatial, spatial]


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    return convert_krea2_transformer_checkpoint_to_diffusers(state_dict)


# -- tiny built-in model ----------------------------------------------------------------------------------
TEXT_WIDTH, TEXT_LAYERS = 16, 3  # the tiny Qwen3-VL's width; hidden states 1, 2 and 3 stacked


def build_tiny(seed: int):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel

    from ..loading import tiny_models as tm

    transformer = tm._transformer(seed, Krea2Transformer2DModel, in_channels=64, num_layers=tm.BLOCKS,
                                  num_key_value_heads=tm.HEADS // 2, intermediate_size=96, timestep_embed_dim=32,
                                  text_hidden_dim=TEXT_WIDTH, num_text_layers=TEXT_LAYERS, text_num_attention_heads=2,
                                  text_num_key_value_heads=2, text_intermediate_size=32, axes_dims_rope=rope_axes(tm.HEAD_DIM))
    _random_norms(transformer, seed)
    vae = tm._seeded(seed + 3, AutoencoderKLQwenImage, base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=6400)
    tokenizer, text_encoder = tm._qwen3_vl(seed + 1, TEXT_WIDTH, "Qwen3VLModel", layers=TEXT_LAYERS)
    return Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer, text_encoder_select_layers=tuple(range(1, TEXT_LAYERS + 1)))


@torch.no_grad()
def _random_norms(transformer: torch.nn.Module, seed: int) -> None:
    """Krea 2's zero-centred norms (scale 1 + weight) and modulation tables start at zero; random ones, as trained
    ones are, so a converter that drops or misplaces one shows. Its q/k norms scale by QK_SCALE, peaking attention
    (tiny_models._peak_attention's scaling of a zero-centred weight would not)."""
    from ..loading import tiny_models as tm

    gen = torch.Generator().manual_seed(seed + 7)
    for name, param in transformer.named_parameters():
        if name.endswith(("norm_q.weight", "norm_k.weight")):
            param.fill_(tm.QK_SCALE - 1)
        if name.endswith("scale_shift_table") or (name.endswith(".weight") and "norm" in name.split(".")[-2]):
            param.add_(0.2 * torch.randn(param.shape, generator=gen))


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Packed latents [B, h/2·w/2, 64] and embeddings [B, tokens, 3, 16] masked as the pipeline pads them: the prompt,
    padding, then the chat suffix's 5 tokens; each later prompt of a batch 3 tokens shorter, the negatives 5."""
    from ..loading import tiny_models as tm

    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or tm.TEXT_TOKENS
    out = {"latents": torch.randn(batch, (height // 16) * (width // 16), 64, generator=gen)}
    for (embeds, mask), shorter in zip(TEXTS.items(), (3, 5)):
        if embeds.startswith("negative") and not negative:
            continue
        out[embeds] = torch.randn(batch, tokens, TEXT_LAYERS, TEXT_WIDTH, generator=gen)
        prompt = (tokens - 7 - shorter * torch.arange(batch)).clamp(min=1)
        position = torch.arange(tokens)
        out[mask] = (position < prompt[:, None]) | (position >= tokens - 5)
    return out


KREA2 = FAMILIES.register(Family(
    name="krea2",
    pipelines={"Krea2Pipeline": xFuserKrea2Pipeline},
    transformer="Krea2Transformer2DModel",
    plan=ParallelPlan(
        # [text; image] entering the first block, the rotary table where it is made; gathered after the last block.
        inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, expected_dims=3)}},
        outputs={"rotary_emb": Split(dim=0, items=(0, 1), expected_dims=2),
                 "transformer_blocks.-1": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn": TextLayout.NONE},
        text_input=None,
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
        text_padding={"": TextPadding(text="encoder_hidden_states", mask="encoder_attention_mask",
                                            order_free=True, rows=("position_ids",))},
        pipefusion=PipeFusionPlan(blocks=("transformer_blocks",), carried=("hidden_states",), returns=("hidden_states",),
                                  token_inputs={"image_rotary_emb": TokenRows(dim=0)}),
    ),
    single_file=SingleFile(
        marker="txtfusion.projector.weight",
        title="Krea 2",
        variants={"krea2": Variant("krea2", "Krea 2", "Krea's keys first.*, blocks.*, txtfusion.*"),
                  "krea2-turbo": Variant("krea2", "Krea 2 Turbo", "the same, `turbo` in the file name")},
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={"krea2": TinyModel("Krea2Pipeline", build_tiny, tiny_inputs, guidance=3.0, unguided=0.0)},
    attention_layers={"Krea2Attention": "diffusers.models.transformers.transformer_krea2"},
))
