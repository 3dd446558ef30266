"""FLUX.2 [klein]: Flux's double- and single-stream design with 4-axis rotary ids and Qwen3 text.

As for FLUX.1, the packed image tokens and their rotary ids (`img_ids`, [B, S, 4]) are split at the
transformer's input; the text is replicated in front of every image shard, in the double blocks'
joint attention and in the single blocks' joint sequence. [klein] base models use real
classifier-free guidance (two calls per step, `guidance_scale` with negative embeddings); distilled
ones (`is_distilled`) take none. Latents go in as the pipeline takes them, [B, 4·C, H/16, W/16]
(2×2 patches in channels), and come out as it returns them, unpatchified: [B, C, H/8, W/8].

Its text embeddings are three hidden layers of Qwen3 stacked (`joint_attention_dim` = 3 × its width),
padded to the pipeline's max_sequence_length with the padding tokens embedded and attended, as the
pipeline does: no mask.

Single files in BFL's layout (`single_stream_modulation.lin`, ...) are recognised and refused with the reason
(read_checkpoint): the pipeline's latents need the FLUX.2 VAE's batch-norm statistics, which they lack.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..checkpoints.shapes import Shapes
from ..model_executor.attention import TextLayout
from ..model_executor.pipelines import xFuserPipelineBaseWrapper
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, Split
from .base import FAMILIES, ComfyData, Family, SingleFile, TinyModel

TRANSFORMER_MODULE = "diffusers.models.transformers.transformer_flux2"


class xFuserFlux2KleinPipeline(xFuserPipelineBaseWrapper):
    # ComfyUI 0.3.64 has no FLUX.2 model, so no latent format to convert with: LATENTs of it are not taken yet.
    comfy = ComfyData(latent_formats={}, expects="FLUX.2 needs a ComfyUI with FLUX.2 support (not 0.3.64)")
    latent_patch = 2
    embedding_sizes = {"prompt_embeds": "joint_attention_dim", "negative_prompt_embeds": "joint_attention_dim"}

    def flow_sigmas(self, total: int) -> np.ndarray:
        return np.linspace(1.0, 1 / total, total)  # Flux2KleinPipeline's own default

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        scale = self.module.vae_scale_factor * 2
        return (batch, self.module.transformer.config.in_channels, height // scale, width // scale)

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        if self.module.config.is_distilled:
            return False
        return kwargs.get("guidance_scale", 4.0) > 1.0 and kwargs.get("negative_prompt_embeds") is not None

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        if self.module.config.is_distilled:
            return "this FLUX.2 [klein] model is guidance-distilled: it runs one branch; turn CFG parallel off."
        return ("CFG parallel on FLUX.2 [klein] needs guidance_scale above 1 (got "
                f"{kwargs.get('guidance_scale')}) and negative prompt embeddings; add both or turn CFG parallel off.")

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _ = self.module.encode_prompt(prompt, device=self.module.transformer.device)
        return {"prompt_embeds": embeds}


# -- tiny built-in model ----------------------------------------------------------------------------------
QWEN3_LAYERS = 28  # the pipeline reads hidden states 9, 18 and 27
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_text_encoder(seed: int, width: int):
    """Qwen3 with a byte-level vocabulary and a chat template, 28 narrow layers (hidden states 9, 18, 27 used)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .. import tiny_models as tm

    tokenizer = tm._qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen3Config(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=QWEN3_LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer),
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, tm._seeded(seed, Qwen3ForCausalLM, config)


def build_tiny(seed: int):
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel, FlowMatchEulerDiscreteScheduler

    from .. import tiny_models as tm

    text_width = 16
    transformer = tm._transformer(seed, Flux2Transformer2DModel, in_channels=128, num_layers=tm.BLOCKS // 2,
                                  num_single_layers=tm.BLOCKS // 2, joint_attention_dim=3 * text_width,
                                  axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    vae = tm._seeded(seed + 3, AutoencoderKLFlux2, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
                     latent_channels=32, sample_size=64)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    tokenizer, text_encoder = _tiny_text_encoder(seed + 1, text_width)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer)


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Latents as the pipeline takes them ([B, 128, H/16, W/16]) and 3 × 16 wide text embeddings."""
    gen = torch.Generator().manual_seed(seed)
    out = {"latents": torch.randn(batch, 128, height // 16, width // 16, generator=gen)}
    for prefix in ("", "negative_") if negative else ("",):
        out[prefix + "prompt_embeds"] = torch.randn(batch, text_tokens or 16, 48, generator=gen)
    return out


# -- single-file checkpoints: recognised, refused with the reason ------------------------------------------
def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    model = "FLUX.2 [dev]" if "guidance_in.in_layer.weight" in shape else "FLUX.2 [klein]"
    raise shape.error(f"a {model} transformer in BFL's layout. FLUX.2 single files do not load yet: the pipeline "
                      "returns latents denormalised with the FLUX.2 VAE's batch-norm statistics, which a transformer "
                      "file does not hold; use the model's diffusers folder (models/diffusers)")


FLUX2 = FAMILIES.register(Family(
    name="flux2",
    pipelines={"Flux2KleinPipeline": xFuserFlux2KleinPipeline},
    transformer="Flux2Transformer2DModel",
    plan=ParallelPlan(
        inputs={"": {"hidden_states": Split(dim=1, expected_dims=3), "img_ids": Split(dim=1, expected_dims=3),
                     # the text too, where it divides (its rotary ids carry their positions)
                     "encoder_hidden_states": Split(dim=1, expected_dims=3, text=True),
                     "txt_ids": Split(dim=1, expected_dims=3, text=True)}},
        outputs={"proj_out": Gather(dim=1, expected_dims=3)},
        attention={
            "transformer_blocks.*.attn": TextLayout.PREFIX,
            "single_transformer_blocks.*.attn": TextLayout.PREFIX,
        },
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
    ),
    single_file=SingleFile(marker="single_stream_modulation.lin.weight", title="FLUX.2", variants={},
                           read=read_checkpoint, convert=lambda state_dict, config: state_dict),
    tiny={"flux2-klein": TinyModel("Flux2KleinPipeline", build_tiny, tiny_inputs, guidance=4.0)},
    attention_layers={"Flux2Attention": TRANSFORMER_MODULE, "Flux2ParallelSelfAttention": TRANSFORMER_MODULE},
))
