"""Z-Image: one stream of single-stream blocks over [image; text], Qwen3 text, latents and text as lists.

The transformer takes one tensor per sample (latents [C, 1, H, W], text [L, D]), pads each sample's image
tokens and its text tokens to a multiple of 32 with learned pad tokens (attended, not masked), refines the
image tokens (`noise_refiner`) and the text (`context_refiner`) apart, then runs its main `layers` over the
two joined. Sequence parallel splits the image tokens through the noise refiner and the joined sequence
through the main layers, text with image alike: both are multiples of 32, so any degree up to 32 divides
them, and the rotary table (complex, one row per token, passed to every block) is split at each block. The
short text refiner runs whole on every rank. Only samples of different lengths in one call are masked;
sequence-parallel attention takes no mask, so such samples run one at a time (the transformer wrapper).
PipeFusion pipelines the main layers: a patch is a slice of the joined, padded sequence, its rotary rows with
it; samples that run one at a time keep their own stale K/V.

Classifier-free guidance is Z-Image's own, `pos + guidance_scale · (pos − neg)` in one call on the batch
[positives; negatives] (guidance_scale 0: off, as Z-Image-Turbo samples): CFG parallel splits that batch.
The pipeline takes its embeddings as lists of [tokens, width] tensors; jobs send them as [B, tokens, width]
tensors (one text length per batch) and the wrapper hands them over as lists.

Single files (Tongyi-MAI's and Comfy-Org's `z_image_turbo_bf16.safetensors`, also fp8 and GGUF) hold the
original layout (fused `attention.qkv`, `x_embedder`, `final_layer`), converted by diffusers' own converter;
every size reads from the shapes, the rotary axes in Z-Image's proportions of the head (32 + 48 + 48 of 128).
They hold the transformer only: a file pool takes Qwen3 embeddings and returns latents, and serves ComfyUI's samplers
(Load Diffusion Model (xDiT Pool): ComfyUI's ZImage model, each call the pipeline loop's transformer call).
"""

from __future__ import annotations

from typing import Any

import torch

from ..loading.checkpoints.shapes import Shapes
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline import xFuserPipelineBaseWrapper
from ..model_executor.pipeline.img2img import linear_sigmas
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, PipeFusionPlan, Split, TokenRows
from .base import FAMILIES, Family, SingleFile, TinyModel, Variant
from .comfy_data import ComfyData

TOKEN_MULTIPLE = 32  # the transformer pads the image tokens and the text tokens of each sample to this
EMBEDDINGS = ("prompt_embeds", "negative_prompt_embeds")


class xFuserZImagePipeline(xFuserPipelineBaseWrapper):
    default_sigmas = staticmethod(linear_sigmas)
    # Its VAE is FLUX.1's, so its latents are in Flux's format. ComfyUI's model (0.33's ZImage; 0.3.64 has none)
    # passes the text's token count and padding mask, and uses neither: its text is every token it is given.
    comfy = ComfyData(
        latent_formats={16: "Flux"}, cfg_offset=1.0,
        expects="encode with xDiT Text Encode on this pool, or on ComfyUI 0.33 with CLIPLoader type lumina2 (Z-Image's "
                "Qwen3 4B, 2560 wide; ComfyUI 0.3.64 has no Z-Image text encoder)",
        empty_latent="EmptySD3LatentImage (16 channels)", model_class="ZImage",
        model_call_conds={"context": "prompt_embeds", "num_tokens": "", "attention_mask": ""},
    )
    model_call_inputs = model_call_required = ("prompt_embeds",)
    latent_patch = 2
    embedding_sizes = {name: "cap_feat_dim" for name in EMBEDDINGS}

    def attention_heads(self) -> int:
        return self.module.transformer.config.n_heads

    def noise_channels(self) -> int:
        return self.module.transformer.config.in_channels  # its transformer patchifies inside: latents stay unpacked

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        """The image tokens as the transformer pads them (what the split sees)."""
        tokens = super().sequence_tokens(kwargs)
        return -(-tokens // TOKEN_MULTIPLE) * TOKEN_MULTIPLE

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("guidance_scale", 5.0) > 0 and kwargs.get("negative_prompt_embeds") is not None

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return ("CFG parallel on Z-Image needs guidance_scale above 0 (got "
                f"{kwargs.get('guidance_scale', 5.0)}) and negative prompt embeddings; add both or turn CFG parallel off "
                "(Z-Image-Turbo samples without guidance).")

    def call_context(self, kwargs: dict[str, Any]):
        """Embeddings [B, tokens, width] as the list of [tokens, width] the pipeline takes."""
        for name in EMBEDDINGS:
            if isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = list(kwargs[name].unbind(0))
        return super().call_context(kwargs)

    def model_call_arguments(self, latents, timestep, inputs):
        """ZImagePipeline's loop: one [C, 1, H, W] latent and one [tokens, width] text per sample, the time running
        the other way, (1000 − timestep) / 1000."""
        return {"x": list(latents.unsqueeze(2).unbind(0)), "t": (1000 - timestep) / 1000,
                "cap_feats": list(inputs["prompt_embeds"].unbind(0))}

    def model_call_output(self, output, latents):
        """The samples stacked back to [B, C, H, W], negated as the pipeline negates them (a flow towards noise)."""
        return -torch.stack([sample.float() for sample in output])[:, :, 0]

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _ = self.module.encode_prompt(prompt, device=self.module.transformer.device,
                                              do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds[0][None]}


# -- single-file checkpoints: the original layout, diffusers' converter ------------------------------------
def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    if "siglip_embedder.1.weight" in shape:
        raise shape.error("Z-Image Omni (SigLIP image conditioning), which this pack does not support (only Z-Image "
                          "text-to-image: Z-Image, Z-Image-Turbo)")
    dim, patch_values = shape("x_embedder.weight")
    head_dim = shape("layers.0.attention.q_norm.weight")[0]
    heads = shape.heads(dim, head_dim)
    spatial = head_dim * 3 // 8
    return "z-image", {
        "dim": dim, "in_channels": patch_values // 4, "n_heads": heads, "n_kv_heads": heads,
        "n_layers": shape.blocks(r"layers\.(\d+)\."), "n_refiner_layers": shape.blocks(r"noise_refiner\.(\d+)\."),
        "cap_feat_dim": shape("cap_embedder.1.weight")[1], "axes_dims": [head_dim - 2 * spatial, spatial, spatial],
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers(state_dict)


# -- tiny built-in model ----------------------------------------------------------------------------------
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT_WIDTH = 16


def build_tiny(seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from ..loading import tiny_models as tm

    transformer = tm._peak_attention(tm._seeded(
        seed, ZImageTransformer2DModel, all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=tm.HEADS * tm.HEAD_DIM,
        n_layers=tm.BLOCKS, n_refiner_layers=1, n_heads=tm.HEADS, n_kv_heads=tm.HEADS, cap_feat_dim=TEXT_WIDTH,
        axes_dims=[4, 6, 6]), tm.QK_SCALE)
    vae = tm._vae(seed + 3, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE values
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # Z-Image-Turbo's
    tokenizer = tm._qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen3Config(hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer), bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    text_encoder = tm._seeded(seed + 1, Qwen3Model, config)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Latents [B, 16, H/8, W/8]; embeddings 16 wide, the negatives shorter than the positives (as an empty
    negative prompt is), so the two pad to different lengths where the text passes 32 tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or 16
    out = {"latents": torch.randn(batch, 16, height // 8, width // 8, generator=gen),
           "prompt_embeds": torch.randn(batch, tokens, TEXT_WIDTH, generator=gen)}
    if negative:
        out["negative_prompt_embeds"] = torch.randn(batch, max(1, tokens // 2 - 3), TEXT_WIDTH, generator=gen)
    return out


Z_IMAGE = FAMILIES.register(Family(
    name="z-image",
    pipelines={"ZImagePipeline": xFuserZImagePipeline},
    transformer="ZImageTransformer2DModel",
    plan=ParallelPlan(
        # The padded image tokens through the noise refiner, then [image; text] through the main layers; each
        # block's rotary table split alike (see the module docstring).
        inputs={"noise_refiner.0": {"x": Split(dim=1, expected_dims=3)},
                "noise_refiner.*": {"freqs_cis": Split(dim=1, expected_dims=3)},
                "layers.0": {"x": Split(dim=1, expected_dims=3)},
                "layers.*": {"freqs_cis": Split(dim=1, expected_dims=3)}},
        outputs={"noise_refiner.-1": Gather(dim=1, expected_dims=3), "layers.-1": Gather(dim=1, expected_dims=3)},
        attention={"noise_refiner.*.attention": TextLayout.NONE, "layers.*.attention": TextLayout.NONE},
        text_input=None,
        image_input="x",
        cfg=CfgMode.BATCHED,
        # The main layers as a pipeline: a patch is a slice of the joined [image; text] sequence (both padded to
        # multiples of 32), its rotary rows with it; the refiners before them run whole on every stage.
        pipefusion=PipeFusionPlan(blocks=("layers",), carried=("x",), returns=("x",),
                                  token_inputs={"freqs_cis": TokenRows(dim=1)}),
    ),
    single_file=SingleFile(
        marker="cap_pad_token",
        title="Z-Image",
        variants={"z-image": Variant("z-image", "Z-Image (Turbo)", "original keys x_embedder.*, cap_pad_token, layers.*.attention.qkv")},
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={"z-image": TinyModel("ZImagePipeline", build_tiny, tiny_inputs, guidance=1.0, unguided=0.0)},
    attention_layers={"ZSingleStreamAttnProcessor": "diffusers.models.transformers.transformer_z_image"},
))
