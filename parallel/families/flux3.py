"""FLUX 3 [klein]: base (`Flux3ModularPipeline`, classifier-free guidance by its guider) and step-distilled
(`Flux3DistilledModularPipeline`, a flow map: each step also embeds the timestep it jumps to, no guidance). diffusers
runs FLUX 3 only as modular pipelines; the engine samples with their "denoise" blocks (pipeline/modular.py).

The transformer runs three token modes: the packed image tokens, optional reference-image tokens, the text. Each
first passes its own per-mode blocks (attending to itself only), then the text and the image modes are joined for
the single blocks, [text; image; references]. The plan splits the image tokens and their rotary ids
(`img_ids`, [tokens, 4]: one table for the batch) at the transformer's input, unevenly where they do not divide; the
per-token modulation is computed from the shard. The image per-mode blocks' attention runs USP over the image
alone; the text stays whole on every rank, its per-mode blocks run locally and it sits in front of the image shard in
the joint blocks. Reference images (its image-conditioned workflow: `image`, through its VAE encoder block) add their
tokens and ids, split likewise, after the image's. The guider calls the transformer once per branch (cond, then
uncond), each call named by the engine, so CFG parallel takes one branch per rank.

Latents: the FLUX.2 VAE's (diffusers' modular flux3 encoders/decoders: AutoencoderKLFlux2, latents 2×2-patchified
and normalised with its batch norm), [B, 128, H/16, W/16]: ComfyUI's Flux2 latent format, whose process_in/out is
the identity; the pipeline returns them so (no VAE involved), and its loop keeps them as tokens [B, H/16·W/16, 128].
ComfyUI 0.33.0 has no FLUX 3 nodes: xDiT Text Encode, xDiT Empty Latent and xDiT Sampler sample it.

Text: Qwen3-VL, hidden layers 4, 8, ..., 32 stacked (`joint_attention_dim` = 8 × its width), the prompt through its
chat template, right-padded to a multiple of 80 tokens with the padding attended: no mask.

Single files in BFL's layout (`early_stream_modulations.image.lin.weight`; `ref_time_in` in the distilled ones) load
with diffusers' own converter; every size reads from the shapes. LoRA: diffusers' Flux3 loader reads BFL's layout.
PipeFusion: not yet (see the plan's `no_pipefusion`).
"""

from __future__ import annotations

import torch

from ..layout.config import LayoutError
from ..loading.checkpoints.shapes import Shapes
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline.img2img import linear_sigmas
from ..model_executor.pipeline.modular import xFuserModularPipelineWrapper
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, Split
from .base import FAMILIES, Family, SingleFile, TinyModel, Variant, pictures
from .comfy_data import ComfyData
from .flux2 import CHAT_TEMPLATE, COMFY_FLUX2, tiny_vae

TRANSFORMER_MODULE = "diffusers.models.transformers.transformer_flux3"

# FLUX 3's LATENT is ComfyUI's Flux2 one: the same VAE (AutoencoderKLFlux2), 2×2-patchified and batch-norm
# normalised before the transformer (diffusers modular_pipelines/flux3/encoders.py Flux3VaeEncoderStep and
# decoders.py Flux3DecodeStep undo exactly what ComfyUI's Flux2 VAE encode does), so 128 channels at 1/16 size with
# process_in/out the identity; ComfyUI 0.33 has the class, older ones get flux2.COMFY_FLUX2 (its values' source there).
COMFY = ComfyData(
    latent_formats={128: "Flux2"}, tokens="loop", declared_formats={"Flux2": COMFY_FLUX2},
    expects="encode with xDiT Text Encode on this pool (FLUX 3: Qwen3-VL, eight hidden layers stacked); ComfyUI 0.33.0 "
            "has no FLUX 3 text encoder",
    empty_latent="xDiT Empty Latent (128 channels at 1/16 size), or EmptyFlux2LatentImage: FLUX 3 takes FLUX.2's latents",
)


class xFuserFlux3Pipeline(xFuserModularPipelineWrapper):
    """FLUX 3 [klein] base: `guidance_scale` is its guider's (classifier-free guidance with the negative embeddings,
    two transformer calls per step; 1 turns it off). Reference images (`image`, [N, 3, H, W] in [0, 1], shared by
    the batch) reach its VAE encoder block as the 8-bit PIL images it takes, each sized by its own rules (one kept
    whole under 4 MP, several under 1 MP each); their tokens follow the image's in the joint blocks, split apart
    from them."""

    default_sigmas = staticmethod(linear_sigmas)  # Flux3SetTimestepsStep: linspace(1, 1/steps, steps), shifted 6.93
    comfy = COMFY
    latent_patch = 2  # tokens are 2×2 VAE latent pixels (the patchified latents' pixels)
    embedding_sizes = {"prompt_embeds": "joint_attention_dim", "negative_prompt_embeds": "joint_attention_dim"}
    tensor_inputs = shared_inputs = ("image",)
    sampling_blocks = ("vae_encoder", "denoise")

    def run_pipeline(self, arguments):
        if isinstance(arguments.get("image"), torch.Tensor):
            arguments = {**arguments, "image": _references(arguments["image"])}
        return super().run_pipeline(arguments)

    def reference_tokens(self, image) -> int:
        """Tokens the references add, each as the pipeline's image processor sizes it."""
        if image is None:
            return 0
        images = _references(image) if isinstance(image, torch.Tensor) else list(image)
        mode, scale = ("fill" if len(images) == 1 else "crop"), self.latent_scale()
        sizes = [self.module.image_processor.preprocess(picture, resize_mode=mode)[0].shape[-2:] for picture in images]
        return sum((height // scale) * (width // scale) for height, width in sizes)

    def check_layout(self, kwargs, batch: int) -> int:
        """The references' tokens split apart from the image's (each evenly: one uneven split per call)."""
        references, sp = self.reference_tokens(kwargs.get("image")), self.parallel_config.sp_degree
        image = self.image_tokens(kwargs["height"], kwargs["width"])
        if references and (image % sp or references % sp):
            raise LayoutError(f"with reference images, FLUX 3's {image} image tokens and {references} reference tokens "
                              f"must each divide by the sequence-parallel degree {sp}; choose sizes whose tokens "
                              "(pixels / 16 per side) divide, or lower the degree")
        return super().check_layout(kwargs, batch)

    def latent_scale(self) -> int:
        return self.module.vae_scale_factor * 2  # the LATENT is the VAE's latents 2×2-patchified: 1/16 size

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        scale = self.latent_scale()
        return (batch, self.module.transformer.config.in_channels, height // scale, width // scale)

    def noise_channels(self) -> int:
        return self.module.transformer.config.in_channels

    def cfg_parallel_hint(self, kwargs) -> str:
        return ("CFG parallel on FLUX 3 [klein] needs its guider's guidance: guidance_scale above 1 (got "
                f"{kwargs.get('guidance_scale')}) and negative prompt embeddings; add both or turn CFG parallel off.")

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """The pipeline's own text encoder block's encoding (its chat template, its padding, its stacked layers)."""
        step = self.module._blocks.sub_blocks["text_encoder"]
        embeds = step._get_qwen3_vl_prompt_embeds(self.module.text_encoder, self.module.tokenizer, prompt,
                                                  device=self.module.transformer.device, pad_multiple=step.pad_multiple)
        return {"prompt_embeds": embeds}

    def initial_noise(self, generator: torch.Generator, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Flux3PrepareLatentsStep's draw: [1, 128, H/16, W/16] in float32, then cast."""
        from diffusers.utils.torch_utils import randn_tensor

        scale = self.latent_scale()
        shape = (1, self.noise_channels(), height // scale, width // scale)
        return randn_tensor(shape, generator=generator, dtype=torch.float32).to(dtype)


class xFuserFlux3DistilledPipeline(xFuserFlux3Pipeline):
    """FLUX 3 [klein] step-distilled: no guider, no negative prompt; `guidance_scale` changes nothing."""

    def cfg_parallel_hint(self, kwargs) -> str:
        return "this FLUX 3 [klein] model is step-distilled: it runs one branch, without guidance; turn CFG parallel off."


def _references(pixels: torch.Tensor) -> list:
    if pixels.ndim != 4 or pixels.shape[1] != 3:
        raise ValueError(f"image has shape {list(pixels.shape)}; FLUX 3 takes reference images as [N, 3, H, W] in [0, 1]")
    return pictures(pixels)


# -- tiny built-in models ---------------------------------------------------------------------------------
TEXT_WIDTH, TEXT_LAYERS = 8, 32  # the pipeline stacks hidden states 4, 8, ..., 32: joint_attention_dim 64


def _tiny_text_encoder(seed: int):
    """Qwen3-VL, 32 layers 8 wide, on the tiny models' byte-level tokenizer with Qwen's vision tokens, and its
    processor (the pipeline's `tokenizer`) with a chat template for plain-text messages; for images only where
    torchvision is missing (vl_processors)."""
    from transformers import (Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                              Qwen3VLProcessor)
    from transformers.utils import is_torchvision_available

    from ..loading import tiny_models as tm
    from ..loading.vl_processors import images_only

    tokenizer, ids, vision_ids = tm._vl_tokenizer()
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH, num_hidden_layers=TEXT_LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer), **ids,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=TEXT_WIDTH,
                           deepstack_visual_indexes=[]), **ids, **vision_ids)
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    if is_torchvision_available():
        from transformers import Qwen3VLVideoProcessor

        processor = Qwen3VLProcessor(images, tokenizer, Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    else:
        processor = images_only(Qwen3VLProcessor)(images, tokenizer, chat_template=CHAT_TEMPLATE)
    return processor, tm._seeded(seed, Qwen3VLForConditionalGeneration, config)


def _build_tiny(seed: int, distilled: bool):
    from diffusers import Flux3DistilledModularPipeline, Flux3ModularPipeline, Flux3Transformer2DModel

    from ..loading import tiny_models as tm

    transformer = tm._transformer(seed, Flux3Transformer2DModel, in_channels=128, cond_in_channels=128,
                                  num_layers=tm.BLOCKS // 2, num_single_layers=tm.BLOCKS // 2,
                                  joint_attention_dim=TEXT_LAYERS // 4 * TEXT_WIDTH, axes_dims_rope=(4, 4, 4, 4),
                                  flow_map=distilled)
    vae = tiny_vae(seed)
    processor, text_encoder = _tiny_text_encoder(seed + 1)
    pipeline = (Flux3DistilledModularPipeline if distilled else Flux3ModularPipeline)()
    pipeline.update_components(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=processor)
    return pipeline


def build_tiny(seed: int):
    return _build_tiny(seed, distilled=False)


def build_tiny_distilled(seed: int):
    return _build_tiny(seed, distilled=True)


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Latents as the pipeline takes them ([B, 128, H/16, W/16]) and 64-wide text embeddings; the negative 5 tokens
    shorter than the positive (the guider's two calls then see texts of uneven lengths)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or 16
    out = {"latents": torch.randn(batch, 128, height // 16, width // 16, generator=gen),
           "prompt_embeds": torch.randn(batch, tokens, TEXT_LAYERS // 4 * TEXT_WIDTH, generator=gen)}
    if negative:
        width = TEXT_LAYERS // 4 * TEXT_WIDTH
        out["negative_prompt_embeds"] = torch.randn(batch, max(1, tokens - 5), width, generator=gen)
    return out


def tiny_distilled_inputs(**kwargs) -> dict:
    """The base model's inputs without negatives: the distilled model takes none."""
    return tiny_inputs(**{**kwargs, "negative": False})


# -- single-file checkpoints: BFL's layout ----------------------------------------------------------------
HEAD_DIM_AXES = 4  # FLUX 3's rotary embedding: four equal axes (t, h, w, l) over each head


def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    """FLUX 3 [klein], base or step-distilled (a second timestep embedder, `ref_time_in`); every size from the shapes."""
    hidden, in_channels = shape("emb_in.image.weight")
    head_dim = shape("single_blocks.0.norm.query_norm.scale")[0]
    distilled = "ref_time_in.in_layer.weight" in shape
    return ("flux3-klein-distilled" if distilled else "flux3-klein"), {
        "flow_map": distilled, "in_channels": in_channels, "cond_in_channels": shape("emb_in.image_cond.weight")[1],
        "num_attention_heads": shape.heads(hidden, head_dim), "attention_head_dim": head_dim,
        "joint_attention_dim": shape("txt_in.weight")[1], "timestep_channels": shape("time_in.in_layer.weight")[1],
        "num_layers": shape.blocks(r"txt_mode_blocks\.(\d+)\."),
        "num_single_layers": shape.blocks(r"single_blocks\.(\d+)\."),
        "mlp_ratio": shape("single_blocks.0.mlp_out.weight")[1] / hidden,
        "axes_dims_rope": [head_dim // HEAD_DIM_AXES] * HEAD_DIM_AXES,
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers

    return convert_flux3_transformer_checkpoint_to_diffusers(state_dict)


FLUX3 = FAMILIES.register(Family(
    name="flux3",
    pipelines={"Flux3ModularPipeline": xFuserFlux3Pipeline,
               "Flux3DistilledModularPipeline": xFuserFlux3DistilledPipeline},
    transformer="Flux3Transformer2DModel",
    plan=ParallelPlan(
        # the image tokens and their ids split at the input; reference tokens and theirs likewise (each evenly)
        inputs={"": {"hidden_states": Split(dim=1, expected_dims=3), "img_ids": Split(dim=0, expected_dims=2),
                     "image_cond_hidden_states": Split(dim=1, expected_dims=3),
                     "image_cond_ids": Split(dim=0, expected_dims=2)}},
        outputs={"proj_out": Gather(dim=1, expected_dims=3)},
        # the image modes' own blocks attend within their shards' union; the joint blocks put the whole text first;
        # the text's own blocks (txt_mode_blocks) run locally on the replicated text
        attention={"mode_blocks.*.attn": TextLayout.NONE, "single_transformer_blocks.*.attn": TextLayout.PREFIX},
        cfg=CfgMode.SEQUENTIAL, cfg_branches=("cond", "uncond"),  # the guider's order, named by the engine
        uneven_tokens=True,
        no_pipefusion=("its per-mode blocks (the text's, the image's, the references', each attending to itself) run "
                       "before the joint blocks and carry one stream each, which PipeFusion's carried streams do "
                       "not describe yet"),
    ),
    single_file=SingleFile(
        marker="early_stream_modulations.image.lin.weight",
        title="FLUX 3",
        variants={
            "flux3-klein": Variant("flux3", "FLUX 3 [klein]", "BFL keys early_stream_modulations.*, no ref_time_in"),
            "flux3-klein-distilled": Variant("flux3-distilled", "FLUX 3 [klein] distilled",
                                             "BFL keys early_stream_modulations.*, with ref_time_in"),
        },
        read=read_checkpoint,
        convert=convert_checkpoint,
    ),
    tiny={"flux3": TinyModel("Flux3ModularPipeline", build_tiny, tiny_inputs, guidance=4.0),
          "flux3-distilled": TinyModel("Flux3DistilledModularPipeline", build_tiny_distilled, tiny_distilled_inputs,
                                       guidance=4.0, cfg=False)},
    attention_layers={"Flux3Attention": TRANSFORMER_MODULE},
))
