"""FLUX.2 [klein] and [dev]: Flux's double- and single-stream design with 4-axis rotary ids; Qwen3 text
([klein]) or Mistral Small 3.1 text ([dev]).

As for FLUX.1, the packed image tokens and their rotary ids (`img_ids`, [B, S, 4]) are split at the
transformer's input; the text is replicated in front of every image shard, in the double blocks'
joint attention and in the single blocks' joint sequence. [klein] base models use real
classifier-free guidance (two calls per step, `guidance_scale` with negative embeddings); distilled
ones (`is_distilled`) take none, nor does [dev] (distilled guidance, embedded). Latents go in as the
pipelines take them, [B, 4·C, H/16, W/16] (2×2 patches in channels), and come out as each returns them:
[klein] unpatchified, [B, C, H/8, W/8]; [dev] packed, [B, H/16·W/16, 4·C].

Its text embeddings are three hidden layers of the text model stacked (`joint_attention_dim` = 3 × its width),
padded to the pipeline's max_sequence_length with the padding tokens embedded and attended, as the
pipelines do: no mask.

Single files in BFL's layout (`single_stream_modulation.lin`, ...; fp8, scaled fp8 and GGUF alike) load;
[klein] ones with the FLUX.2 VAE file beside them (`--vae flux2-vae.safetensors`): that pipeline returns its
latents denormalised with the VAE's batch-norm statistics. Every size reads from the shapes (4B, 9B, [dev]'s
32B); whether a [klein] is guidance-distilled does not show in the weights, so it comes from the name, as
BFL names the undistilled ones (`flux-2-klein-base-4b`). [dev] is told by its guidance embedder.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from ..loading.checkpoints.shapes import Shapes
from ..layout.config import LayoutError
from ..model_executor.pipeline import xFuserPipelineBaseWrapper
from ..model_executor.pipeline.img2img import linear_sigmas
from ..model_executor.plans import JoinedStream, Split
from .base import FAMILIES, Family, SingleFile, TinyModel, Variant, VaeFile, references
from .comfy_data import ComfyData, DeclaredLatentFormat
from .flux import FLUX

TRANSFORMER_MODULE = "diffusers.models.transformers.transformer_flux2"


# ComfyUI's FLUX.2 latent (`comfy.latent_formats.Flux2` in the ComfyUIs with FLUX.2; 0.3.64 has none): the VAE's latents 2×2-patchified
# and normalised with its batch norm inside ComfyUI's VAE encode, so process_in/out are the identity, exactly the
# latents diffusers' Flux2 pipelines normalise and patchify themselves (tests/test_comfyui.py checks it against them).
# The preview factors are ComfyUI's, for the 32 unfolded channels.
COMFY_FLUX2 = DeclaredLatentFormat(
    channels=128, spatial=16, preview_unfold=2, rgb_bias=(-0.0329, -0.0718, -0.0851),
    source="ComfyUI comfy/latent_formats.py, class Flux2 (the releases with FLUX.2 support, from late 2025)",
    rgb_factors=(
        (0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644), (0.2144, 0.3009, 0.3652),
        (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160), (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109),
        (-0.3527, -0.2712, -0.1666), (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
        (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080), (-0.0939, -0.0008, 0.0186),
        (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127), (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065),
        (0.0128, 0.0101, 0.0142), (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
        (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025), (0.0220, 0.0169, -0.0048),
        (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609), (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614),
    ),
)


class xFuserFlux2KleinPipeline(xFuserPipelineBaseWrapper):
    """Reference images (`image`, [N, 3, H, W] in [0, 1]: N references of one size) reach the pipeline as the PIL
    images it takes, each sized by its own rules (at most 1 MP, cropped to whole 16-pixel tokens); their tokens
    follow the image's in the sequence, split with them."""
    default_sigmas = staticmethod(linear_sigmas)

    comfy = ComfyData(
        latent_formats={128: "Flux2"}, tokens="loop", declared_formats={"Flux2": COMFY_FLUX2},
        expects="encode with xDiT Text Encode on this pool, or on ComfyUI 0.33 with CLIPLoader type flux2 (FLUX.2 "
                "[klein]: Qwen3 4B or 8B, three hidden layers stacked: 7680 or 12288 wide)",
        empty_latent="EmptyFlux2LatentImage (ComfyUI 0.33), or xDiT Empty Latent on a ComfyUI without it: 128 channels "
                     "at 1/16 size",
        model_class="Flux2",
        model_call_conds={"context": "prompt_embeds", "guidance": "guidance", "ref_latents": "reference_latents"},
    )
    latent_patch = 2
    embedding_sizes = {"prompt_embeds": "joint_attention_dim", "negative_prompt_embeds": "joint_attention_dim"}
    tensor_inputs = ("image",)
    # guidance: [dev]'s distilled guidance (FluxGuidance), ignored by [klein]; ReferenceLatent's images (base.references)
    model_call_inputs = ("prompt_embeds", "guidance", "reference_latents", "reference_sizes")
    model_call_required = ("prompt_embeds",)

    def model_call_arguments(self, latents, timestep, inputs):
        """The pipelines' loop: one token per latent pixel, each reference's tokens after them at time index 10, 20,
        ... (`_prepare_image_ids`, as ComfyUI's FLUX.2 places ReferenceLatent's images), the text's ids along L."""
        pipeline, embeds = self.module, inputs["prompt_embeds"]
        tokens, ids = pipeline._pack_latents(latents), pipeline._prepare_latent_ids(latents)
        parts = references(inputs)
        if parts:
            reference_ids = pipeline._prepare_image_ids([part[:1] for part in parts]).expand(len(latents), -1, -1)
            tokens = torch.cat([tokens, *(pipeline._pack_latents(part) for part in parts)], dim=1)
            ids = torch.cat([ids, reference_ids], dim=1)
        guided = pipeline.transformer.config.guidance_embeds
        if guided and inputs.get("guidance") is None:
            raise ValueError("FLUX.2 [dev] has distilled guidance: send 'guidance' (FluxGuidance's value) per sample")
        return {"hidden_states": tokens, "timestep": timestep / 1000, "encoder_hidden_states": embeds,
                "guidance": inputs["guidance"] if guided else None, "txt_ids": pipeline._prepare_text_ids(embeds).to(embeds.device),
                "img_ids": ids.to(latents.device)}

    def model_call_output(self, output, latents):
        """The noisy tokens back to [B, 128, h, w] (the references' are dropped, as the pipelines drop them)."""
        batch, channels, height, width = latents.shape
        return output[:, : height * width].transpose(1, 2).reshape(batch, channels, height, width)

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        if isinstance(kwargs.get("image"), torch.Tensor):
            kwargs = {**kwargs, "image": reference_images(kwargs["image"])}
        return super().prepare(kwargs, check_layout)

    def reference_tokens(self, images: list | None) -> int:
        """Tokens the references add, each sized as the pipeline sizes it."""
        multiple = self.module.vae_scale_factor * 2
        tokens = 0
        for image in images or ():
            if image.width * image.height > 1024 * 1024:
                image = self.module.image_processor._resize_to_target_area(image, 1024 * 1024)
            tokens += (image.width // multiple) * (image.height // multiple)
        return tokens

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        if kwargs.get("image") and self.parallel_config.pipefusion_degree > 1:
            raise LayoutError("PipeFusion does not take FLUX.2 reference images yet (their tokens follow the image's "
                              "patches in the sequence); use Ulysses, Ring, CFG or data parallel for them")
        return super().check_layout(kwargs, batch)

    def shift_arguments(self, height: int, width: int, steps: int) -> dict[str, float]:
        """FLUX.2's own shift: empirical, of the image tokens and the steps of the call (not calculate_shift's)."""
        return {"mu": inspect.getmodule(type(self.module)).compute_empirical_mu(self.image_tokens(height, width), steps)}

    def noise_input(self, prepared: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """prepare_latents packs its noise into tokens, [B, h·w, 128]; `latents` takes it unpacked, [B, 128, h, w]."""
        scale = self.latent_scale()
        return prepared.transpose(1, 2).reshape(prepared.shape[0], prepared.shape[2], height // scale, width // scale)

    def latent_scale(self) -> int:
        return self.module.vae_scale_factor * 2  # its LATENT is the VAE's latents 2×2-patchified: 1/16 size

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        scale = self.latent_scale()
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

    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """[klein] returns its latents unpatchified and denormalised with the VAE's batch-norm statistics; its loop
        keeps them 2×2-patchified, normalised and packed, [B, H/16·W/16, 128] (ComfyUI's FLUX.2 LATENT, unpacked)."""
        pipeline, bn = self.module, self.module.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipeline.vae.config.batch_norm_eps).to(latents)
        return pipeline._pack_latents((pipeline._patchify_latents(latents) - mean) / std)


def reference_images(pixels: torch.Tensor) -> list:
    """[N, 3, H, W] in [0, 1] → N PIL images, as diffusers' image processor converts them (rounded to 8 bits)."""
    from diffusers.image_processor import VaeImageProcessor

    if pixels.ndim != 4 or pixels.shape[1] != 3:
        raise ValueError(f"image has shape {list(pixels.shape)}; FLUX.2 takes reference images as [N, 3, H, W] in [0, 1]")
    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(pixels.float().clamp(0, 1).cpu()))


class xFuserFlux2Pipeline(xFuserFlux2KleinPipeline):
    """FLUX.2 [dev]: the same transformer with a guidance embedder (`guidance_scale` is distilled guidance: one
    branch, no CFG) and Mistral Small 3.1's hidden layers 10, 20 and 30 stacked as its text. It returns its
    latents packed, [B, H/16·W/16, 128], as the pipeline keeps them (no VAE involved), where [klein] unpacks
    and denormalises them."""

    comfy = dataclasses.replace(xFuserFlux2KleinPipeline.comfy, guidance_in_conditioning=True, default_guidance=4.0,
                                expects="encode with xDiT Text Encode on this pool, or on ComfyUI 0.33 with CLIPLoader "
                                        "type flux2 (FLUX.2 [dev]: Mistral Small 3.1, three hidden layers stacked: "
                                        "15360 wide)")

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        return False

    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return latents  # already as its loop keeps them

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return "FLUX.2 [dev] is guidance-distilled: it runs one branch (guidance_scale is embedded); turn CFG parallel off."


# -- tiny built-in models ---------------------------------------------------------------------------------
QWEN3_LAYERS = 28  # the pipeline reads hidden states 9, 18 and 27
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_text_encoder(seed: int, width: int):
    """Qwen3 with a byte-level vocabulary and a chat template, 28 narrow layers (hidden states 9, 18, 27 used)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..loading import tiny_models as tm

    tokenizer = tm._qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen3Config(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=QWEN3_LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer),
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, tm._seeded(seed, Qwen3ForCausalLM, config)


MISTRAL_LAYERS = 30  # FLUX.2 [dev] reads hidden states 10, 20 and 30
MISTRAL_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
                         "{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}")


def _tiny_mistral3(seed: int, width: int):
    """Mistral 3 (Pixtral vision tower + Mistral text model) with a byte-level vocabulary and a chat template for
    the pipeline's [{"type": "text", ...}] messages; 30 narrow text layers (hidden states 10, 20, 30 used)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from ..loading import tiny_models as tm

    tokenizer = tm._qwen_tokenizer()
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    text = MistralConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=MISTRAL_LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id)
    vision = PixtralVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, image_size=32, patch_size=8)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=len(tokenizer) - 1)
    return tokenizer, tm._seeded(seed, Mistral3ForConditionalGeneration, config)


def tiny_vae(seed: int):
    """FLUX.2's VAE (FLUX 3's too), 8 channels wide, its batch norm's statistics not the identity, as a trained VAE's."""
    from diffusers import AutoencoderKLFlux2

    from ..loading import tiny_models as tm

    vae = tm._seeded(seed + 3, AutoencoderKLFlux2, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
                     latent_channels=32, sample_size=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 4)
        vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.num_features) ** 2 * 3)
    return vae


def _build_tiny(seed: int, pipeline: str):
    import diffusers
    from diffusers import Flux2Transformer2DModel, FlowMatchEulerDiscreteScheduler

    from ..loading import tiny_models as tm

    text_width, dev = 16, pipeline == "Flux2Pipeline"
    transformer = tm._transformer(seed, Flux2Transformer2DModel, in_channels=128, num_layers=tm.BLOCKS // 2,
                                  num_single_layers=tm.BLOCKS // 2, joint_attention_dim=3 * text_width,
                                  axes_dims_rope=(4, 4, 4, 4), guidance_embeds=dev)
    vae = tiny_vae(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256,
                                                max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
    tokenizer, text_encoder = (_tiny_mistral3 if dev else _tiny_text_encoder)(seed + 1, text_width)
    return getattr(diffusers, pipeline)(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                        transformer=transformer)


def build_tiny(seed: int):
    return _build_tiny(seed, "Flux2KleinPipeline")


def build_tiny_dev(seed: int):
    return _build_tiny(seed, "Flux2Pipeline")


def tiny_dev_inputs(**kwargs) -> dict:
    """[klein]'s inputs without negatives: FLUX.2 [dev] takes none."""
    return tiny_inputs(**{**kwargs, "negative": False})


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Latents as the pipeline takes them ([B, 128, H/16, W/16]) and 3 × 16 wide text embeddings."""
    gen = torch.Generator().manual_seed(seed)
    out = {"latents": torch.randn(batch, 128, height // 16, width // 16, generator=gen)}
    for prefix in ("", "negative_") if negative else ("",):
        out[prefix + "prompt_embeds"] = torch.randn(batch, text_tokens or 16, 48, generator=gen)
    return out


# -- single-file checkpoints: BFL's layout, with the FLUX.2 VAE file beside them -----------------------------
HEAD_DIM_AXES = 4  # FLUX.2's rotary embedding: four equal axes (t, h, w, l) over each head


def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    """FLUX.2 [dev] (a guidance embedder) or [klein] (4B, 9B; distilled, or `base` in the file name as BFL names
    the undistilled ones)."""
    hidden, in_channels = shape("img_in.weight")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    dev = "guidance_in.in_layer.weight" in shape
    variant = "flux2-dev" if dev else "flux2-klein-base" if shape.named("base") else "flux2-klein"
    return variant, {
        "guidance_embeds": dev,
        "in_channels": in_channels, "num_attention_heads": shape.heads(hidden, head_dim), "attention_head_dim": head_dim,
        "joint_attention_dim": shape("txt_in.weight")[1], "num_layers": shape.blocks(r"double_blocks\.(\d+)\."),
        "num_single_layers": shape.blocks(r"single_blocks\.(\d+)\."),
        "mlp_ratio": shape("double_blocks.0.img_mlp.2.weight")[1] / hidden,
        "timestep_guidance_channels": shape("time_in.in_layer.weight")[1],
        "axes_dims_rope": [head_dim // HEAD_DIM_AXES] * HEAD_DIM_AXES,
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers(state_dict)


def read_vae(shape: Shapes) -> dict:
    """The FLUX.2 VAE (flux2-vae.safetensors): its widths, blocks per level and latent channels."""
    levels = shape.blocks(r"encoder\.down\.(\d+)\.")
    return {"block_out_channels": [shape(f"encoder.down.{i}.block.0.conv2.weight")[0] for i in range(levels)],
            "layers_per_block": shape.blocks(r"encoder\.down\.0\.block\.(\d+)\."),
            "latent_channels": shape("decoder.conv_in.weight")[1],
            "down_block_types": ["DownEncoderBlock2D"] * levels, "up_block_types": ["UpDecoderBlock2D"] * levels}


def convert_vae(state_dict: dict, config) -> dict:
    """BFL's FLUX.2 VAE layout → AutoencoderKLFlux2: an ldm VAE (diffusers' own converter) whose quant convs sit
    inside the encoder and decoder, plus the batch-norm statistics the pipeline normalises latents with
    (diffusers' scripts/convert_flux2_to_diffusers.py)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    moved = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
    ldm, statistics = {}, {}
    for key, value in state_dict.items():
        prefix = next((p for p in moved if key.startswith(p)), None)
        if key in ("bn.running_mean", "bn.running_var"):
            statistics[key] = value
        elif prefix:
            ldm[moved[prefix] + key[len(prefix):]] = value
        else:
            ldm[key] = value
    return {**convert_ldm_vae_checkpoint(ldm, config), **statistics}


FLUX2 = FAMILIES.register(Family(
    name="flux2",
    pipelines={"Flux2KleinPipeline": xFuserFlux2KleinPipeline, "Flux2Pipeline": xFuserFlux2Pipeline},
    transformer="Flux2Transformer2DModel",
    # Flux.1's plan, except that the rotary ids are batched ([B, tokens, 4]) and the single blocks take [text; image]
    # joined (the transformer concatenates them between the two lists), with their own modulation computed once
    # per call; its patches do not flow across steps (no PatchFlow yet) and its blocks take a stream of one token.
    plan=dataclasses.replace(
        FLUX.plan,
        inputs={"": {**FLUX.plan.inputs[""], "img_ids": Split(dim=1, expected_dims=3),
                     "txt_ids": Split(dim=1, expected_dims=3, text=True)}},
        pipefusion=dataclasses.replace(
            FLUX.plan.pipefusion, stand_in=1, flow=None,
            joined={"single_transformer_blocks": JoinedStream(text="encoder_hidden_states",
                                                              inputs={"temb_mod": "single_stream_modulation"})}),
    ),
    single_file=SingleFile(
        marker="single_stream_modulation.lin.weight",
        title="FLUX.2",
        variants={
            "flux2-klein": Variant("flux2-klein", "FLUX.2 [klein]", "BFL keys single_stream_modulation.*, no guidance_in"),
            "flux2-klein-base": Variant("flux2-klein", "FLUX.2 [klein] base", "the same, `base` in the file name"),
            "flux2-dev": Variant("flux2-dev", "FLUX.2 [dev]", "BFL keys single_stream_modulation.*, with guidance_in"),
        },
        read=read_checkpoint,
        convert=convert_checkpoint,
        # BFL's / Comfy-Org's flux2-vae.safetensors: the pipeline's latents are denormalised with its batch norm
        vae=VaeFile(marker="bn.running_var", title="FLUX.2 VAE (flux2-vae.safetensors)", read=read_vae,
                    needed="its pipeline denormalises the latents it returns with that VAE's batch-norm statistics",
                    convert=convert_vae),
    ),
    tiny={"flux2-klein": TinyModel("Flux2KleinPipeline", build_tiny, tiny_inputs, guidance=4.0),
          "flux2-dev": TinyModel("Flux2Pipeline", build_tiny_dev, tiny_dev_inputs, guidance=4.0, cfg=False)},
    attention_layers={"Flux2Attention": TRANSFORMER_MODULE, "Flux2ParallelSelfAttention": TRANSFORMER_MODULE},
))
