"""Wan 2.1 / 2.2 text- and image-to-video: 5-D latents [B, C, T', H/8, W/8] (TI2V 5B: 48 channels, H/16),
one token per latent frame × 2×2 latent pixels.

The plan, as diffusers' own `_cp_plan` for WanTransformer3DModel: the rotary embedding (cos, sin) is
split on the token axis, the patch-embedded tokens are split where they enter the first block, and
proj_out gathers; Wan 2.2 TI2V's per-token timesteps ([B, S]) are split alike, so its per-token
modulation matches. Self-attention runs USP; cross-attention to the text (and Wan 2.1 I2V's image
tokens) stays local; CFG arrives as two calls. A video's token count rarely divides by the
sequence-parallel degree: the plan splits it unevenly (token_split.py), so only a video with fewer
tokens than ranks is refused. Wan 2.2 A14B's second (low-noise) expert, `transformer_2`, is wrapped
like the first. PipeFusion patches are whole token rows of the (frames × rows × columns) sequence,
with the rotary table and TI2V's per-token modulation sliced alike; each expert warms up its own
stale K/V when it takes over.

ComfyUI keeps Wan latents in its Wan21 (16 channels, ×8) and Wan22 (48 channels, ×16) formats.

Single files: Wan's original layout (`blocks.N.self_attn.q`, `patch_embedding`, `head.head`), as Comfy-Org
repackages it (`wan2.1_t2v_1.3B_fp16.safetensors`, `wan2.2_ti2v_5B_fp16.safetensors`; fp8, scaled fp8 and
GGUF through the same path), converted by diffusers' own converter. The head size is 128 in every Wan (the
weights cannot show it: q/k norms span all heads). Text-to-video 2.1 and TI2V 5B load, and Wan 2.2 T2V A14B
from its two expert files (`..._high_noise_...` / `..._low_noise_...`, either one chosen, the other beside it),
with Wan 2.2's own settings for it (wan/configs/wan_t2v_A14B.py: boundary 0.875, sample_shift 12.0).
Image-to-video loads from files too, with the VAE file beside it (`--vae wan_2.1_vae.safetensors`, the one
ComfyUI users keep in models/vae): Wan 2.2 I2V A14B from its two expert files (wan_i2v_A14B.py: boundary 0.9,
sample_shift 5.0) and Wan 2.1 I2V 14B (wan_i2v_14B.py: sample_shift 5.0), whose CLIP vision features arrive as
`image_embeds` (ComfyUI's CLIPVisionEncode output) since a file pool has no image encoder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any

import torch

from ..call_parameters import CallParameter
from ..checkpoints.shapes import Shapes
from ..config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipelines import xFuserPipelineBaseWrapper
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, PipeFusionPlan, Split, TokenRows
from .base import FAMILIES, ComfyData, ExpertPair, Family, SingleFile, TinyModel, Variant, VaeFile, replaced

DEFAULT_FRAMES = 81  # WanPipeline.__call__'s default num_frames
PROMPT_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length: what a text prompt is padded to


class xFuserWanPipeline(xFuserPipelineBaseWrapper):
    comfy = ComfyData(
        latent_formats={16: "Wan21", 48: "Wan22"}, temporal=4,
        expects="encode with xDiT Text Encode on this pool, or Wan's UMT5-XXL CLIP loader (4096 wide, 512 tokens)",
        empty_latent="EmptyHunyuanLatentVideo (Wan 2.1 / 2.2 A14B) or a Wan latent node",
    )
    embedding_sizes = {"prompt_embeds": "text_dim", "negative_prompt_embeds": "text_dim"}
    call_parameters = {
        "num_frames": CallParameter(int, "video frames, 4k+1 (default: as many as the latents hold)", 1, 10_000),
        "guidance_scale_2": CallParameter(float, "Wan 2.2 A14B: guidance of the low-noise expert (default: guidance_scale)",
                                          0.0, 100.0),
    }

    def _config(self):
        transformer = self.module.transformer if self.module.transformer is not None else self.module.transformer_2
        return transformer.config

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """As `WanPipeline(prompt=...)` encodes it: UMT5, padded with zeros to 512 tokens."""
        embeds, _ = self.module.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=PROMPT_TOKENS)
        return {"prompt_embeds": embeds}

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        """Given latents define the frames: image-to-video builds its condition for num_frames frames."""
        latents = kwargs.get("latents")
        if kwargs.get("num_frames") is None and isinstance(latents, torch.Tensor) and latents.ndim == 5:
            kwargs = {**kwargs, "num_frames": (latents.shape[2] - 1) * self.module.vae_scale_factor_temporal + 1}
        return super().prepare(kwargs, check_layout)

    # -- shapes -------------------------------------------------------------------------------------
    def latent_frames(self, kwargs: dict[str, Any]) -> int:
        """T' of the latents: from `latents` if given (the pipeline then ignores num_frames), else from
        num_frames rounded as the pipeline rounds it (to 4k + 1)."""
        temporal = self.module.vae_scale_factor_temporal
        frames = kwargs.get("num_frames")
        if frames is not None:
            if frames % temporal != 1:
                frames = frames // temporal * temporal + 1
            frames = (max(frames, 1) - 1) // temporal + 1
        latents = kwargs.get("latents")
        if isinstance(latents, torch.Tensor) and latents.ndim == 5:
            if frames is not None and latents.shape[2] != frames:
                raise ValueError(
                    f"latents have {latents.shape[2]} latent frames but num_frames {kwargs['num_frames']} needs {frames}; "
                    f"pass num_frames {(latents.shape[2] - 1) * temporal + 1} or leave it out"
                )
            return latents.shape[2]
        return frames if frames is not None else (DEFAULT_FRAMES - 1) // temporal + 1

    def image_tokens(self, height: int, width: int) -> int:
        """Tokens of one latent frame."""
        _, patch_h, patch_w = self._config().patch_size
        return self.grid_tokens(height, width, self.module.vae_scale_factor_spatial, patch_h, patch_w)

    def token_rows(self, kwargs: dict[str, Any]) -> int:
        _, patch_h, _ = self._config().patch_size
        frames = self.latent_frames(kwargs) // self._config().patch_size[0]
        return frames * (kwargs["height"] // (self.module.vae_scale_factor_spatial * patch_h))

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        return self.latent_frames(kwargs) // self._config().patch_size[0] * self.image_tokens(kwargs["height"], kwargs["width"])

    def expected_latents_shape(self, batch: int, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        scale = self.module.vae_scale_factor_spatial
        return (batch, self._config().out_channels, frames, height // scale, width // scale)

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        latents = kwargs.get("latents")
        expected = self.expected_latents_shape(batch, kwargs["height"], kwargs["width"], self.latent_frames(kwargs))
        if isinstance(latents, torch.Tensor) and tuple(latents.shape) != expected:
            raise ValueError(
                f"latents have shape {list(latents.shape)} but {type(self.module).__name__} at "
                f"{kwargs['height']}x{kwargs['width']} needs [batch, channels, latent frames, height/8, width/8] = "
                f"{list(expected)}; send latents of that shape."
            )
        super().check_inputs({k: v for k, v in kwargs.items() if k != "latents"}, batch)

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        c = self.parallel_config
        tokens = self.sequence_tokens(kwargs)
        if tokens < c.sp_degree:
            raise LayoutError(
                f"{self.latent_frames(kwargs)} latent frames at {kwargs['height']}x{kwargs['width']} give {tokens} video "
                f"tokens, fewer than the sequence-parallel degree {c.sp_degree} (ring {c.ring_degree} × ulysses "
                f"{c.ulysses_degree}); lower the degrees or sample a larger video."
            )
        return super().check_layout(kwargs, batch)


class xFuserWanImageToVideoPipeline(xFuserWanPipeline):
    """Wan image-to-video: the transformer also takes the first frame's VAE latents and a frame mask
    (36 input channels for 16 output channels); every rank encodes the image with its own VAE, or takes
    that encoding as given (`image_latents`: ComfyUI's WanImageToVideo encodes [start image, gray frames]
    with ComfyUI's VAE), which the pipeline then normalises and masks as its own. Wan 2.1 I2V also
    cross-attends to the start image's CLIP vision features: its image encoder computes them, or they are
    given (`image_embeds`, [1, 257, 1280]: ComfyUI's CLIPVisionEncode), as a single-file pool needs."""

    tensor_inputs = ("image", "image_latents", "image_embeds")
    comfy = dataclasses.replace(xFuserWanPipeline.comfy, concat_latents="image_latents", clip_vision="image_embeds")

    def input_widths(self) -> dict[str, int]:
        image_dim = self.module.transformer.config.image_dim  # Wan 2.1 I2V only
        return {**super().input_widths(), **({"image_embeds": int(image_dim)} if image_dim else {})}

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        given, embeds = kwargs.get("image_latents"), kwargs.get("image_embeds")
        if kwargs.get("image") is None and given is None:
            raise ValueError(f"{type(self.module).__name__} needs `image`, the first frame to animate, or `image_latents`, "
                             "its VAE encoding with the frames after it")
        image_dim, encoder = self.module.transformer.config.image_dim, getattr(self.module, "image_encoder", None)
        if image_dim is None and embeds is not None:
            raise ValueError("`image_embeds` (CLIP vision features) go to Wan 2.1 I2V only; this model does not take them")
        if image_dim is not None and embeds is None and (given is not None or encoder is None):
            raise ValueError(f"this {type(self.module).__name__} (Wan 2.1 I2V) cross-attends to the start image's CLIP "
                             "vision features: send `image_embeds` (ComfyUI's CLIPVisionEncode of the start image)"
                             + ("" if encoder is None else ", or `image` alone"))
        if embeds is not None and (embeds.ndim != 3 or embeds.shape[0] != 1 or embeds.shape[-1] != image_dim):
            raise ValueError(f"image_embeds have shape {list(embeds.shape)}; Wan 2.1 I2V takes one image's CLIP vision "
                             f"hidden states, [1, tokens, {image_dim}]")
        if given is not None:
            scale = self.module.vae_scale_factor_spatial
            expected = (batch, self.module.vae.config.z_dim, self.latent_frames(kwargs),
                        kwargs["height"] // scale, kwargs["width"] // scale)
            if tuple(given.shape) != expected:
                raise ValueError(f"image_latents have shape {list(given.shape)} but this video needs {list(expected)} "
                                 "(the VAE encoding of the start image and the frames after it)")
        super().check_inputs(kwargs, batch)

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        if kwargs.get("image_latents") is not None and kwargs.get("image") is None:  # stands in for the encoded image
            latents = kwargs["image_latents"]
            kwargs = {**kwargs, "image": latents.new_zeros(latents.shape[0], 3, kwargs["height"], kwargs["width"])}
        return super().prepare(kwargs, check_layout)

    def call_context(self, kwargs: dict[str, Any]):
        """The pipeline's VAE encode of the condition video answers with the given encoding, and its CLIP
        vision encode of the start image with the given features."""
        given, embeds = kwargs.pop("image_latents", None), kwargs.pop("image_embeds", None)
        stack = contextlib.ExitStack()
        if given is not None:
            stack.enter_context(_encoded_as(self.module.vae, given))
        if embeds is not None:
            stack.enter_context(replaced(self.module, "encode_image", lambda *args, **kwargs: embeds))
        return stack


def _encoded_as(vae, latents: torch.Tensor):
    """The VAE's encode answers with `latents` (on their own device: the pipeline moves them on)."""
    def encode(video, *args, **kwargs):
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: latents.to(dtype=video.dtype)))

    return replaced(vae, "encode", encode)


# -- tiny built-in models --------------------------------------------------------------------------------
# `wan`:      Wan 2.1 T2V style: one transformer, UMT5 text encoder, AutoencoderKLWan (16 latent channels,
#             ×8 spatial and ×4 temporal compression), UniPC with flow sigmas (the real checkpoints' scheduler).
# `wan22`:    Wan 2.2 T2V A14B style: the same, plus a second low-noise expert `transformer_2` that takes
#             over below `boundary_ratio` × 1000 timesteps.
# `wan22-5b`: Wan 2.2 TI2V 5B style: one transformer on 48 latent channels from a ×16 VAE, with one
#             timestep per token (`expand_timesteps`).
# `wan22-i2v`: Wan 2.2 I2V A14B style (WanImageToVideoPipeline): two experts whose input is the noise,
#             a frame mask and the VAE-encoded first frame (16 + 4 + 16 = 36 channels); no CLIP image encoder.
TINY_CHANNELS, TINY_CHANNELS_5B = 16, 48
BOUNDARY_RATIO = 0.875  # Wan 2.2 T2V A14B: the high-noise expert runs while t >= 875
I2V_BOUNDARY_RATIO = 0.9  # Wan 2.2 I2V A14B
FLOW_SHIFT = 3.0  # Wan 2.1 480p
# ComfyUI's Wan22 latent format (comfy/latent_formats.py), as the real Wan 2.2 VAE config has it.
WAN22_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]


def tiny_umt5(seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    from .. import tiny_models as tm

    tok = tm._t5_tokenizer()
    cfg = UMT5Config(vocab_size=len(tok), d_model=tm.T5_DIM, d_kv=8, d_ff=tm.T5_DIM, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=32,
                     feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return tok, tm._seeded(seed, UMT5EncoderModel, cfg)


def tiny_vae(seed: int, wan22: bool = False):
    """Wan 2.1: 3 downsamples (×8), two of them temporal (×4); latents_mean/std default to Wan 2.1's.
    Wan 2.2's residual VAE: 2×2 pixel patches, then ×8 → ×16 spatial, ×4 temporal, 48 channels."""
    from diffusers import AutoencoderKLWan

    from .. import tiny_models as tm

    if not wan22:
        return tm._seeded(seed, AutoencoderKLWan, base_dim=8, z_dim=TINY_CHANNELS, dim_mult=[1, 1, 1, 1],
                          num_res_blocks=1, temperal_downsample=[False, True, True])
    return tm._seeded(seed, AutoencoderKLWan, base_dim=8, decoder_base_dim=8, z_dim=TINY_CHANNELS_5B,
                      dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                      is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                      latents_mean=WAN22_MEAN, latents_std=WAN22_STD)


def _tiny_transformer(seed: int, in_channels: int = TINY_CHANNELS, out_channels: int = TINY_CHANNELS):
    from diffusers import WanTransformer3DModel

    from .. import tiny_models as tm

    return tm._transformer(seed, WanTransformer3DModel, patch_size=(1, 2, 2), in_channels=in_channels,
                           out_channels=out_channels, text_dim=tm.T5_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
                           cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64)


def tiny_scheduler():
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=FLOW_SHIFT,
                                   num_train_timesteps=1000)


def _tiny(model: str) -> TinyModel:
    def build(seed: int):
        from diffusers import WanImageToVideoPipeline, WanPipeline

        tok, umt5 = tiny_umt5(seed + 1)
        if model == "wan22-5b":
            return WanPipeline(tokenizer=tok, text_encoder=umt5, vae=tiny_vae(seed + 2, wan22=True),
                               scheduler=tiny_scheduler(), expand_timesteps=True,
                               transformer=_tiny_transformer(seed, TINY_CHANNELS_5B, TINY_CHANNELS_5B))
        if model == "wan22-i2v":
            condition = TINY_CHANNELS + 4 + TINY_CHANNELS  # noise, first-frame mask (4 frames per latent), image
            return WanImageToVideoPipeline(
                tokenizer=tok, text_encoder=umt5, vae=tiny_vae(seed + 2), scheduler=tiny_scheduler(),
                transformer=_tiny_transformer(seed, condition), transformer_2=_tiny_transformer(seed + 3, condition),
                boundary_ratio=I2V_BOUNDARY_RATIO,
            )
        two_experts = model == "wan22"
        return WanPipeline(
            tokenizer=tok, text_encoder=umt5, vae=tiny_vae(seed + 2), scheduler=tiny_scheduler(),
            transformer=_tiny_transformer(seed),
            transformer_2=_tiny_transformer(seed + 3) if two_experts else None,
            boundary_ratio=BOUNDARY_RATIO if two_experts else None,
        )

    def inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
               num_frames: int) -> dict[str, torch.Tensor]:
        """Image-to-video also gets `image`: one first frame [1, 3, H, W] in [0, 1] (the pipeline repeats it
        over the batch; one image per sample is not what WanImageToVideoPipeline supports)."""
        from .. import tiny_models as tm

        gen = torch.Generator().manual_seed(seed)
        channels, scale = (TINY_CHANNELS_5B, 16) if model == "wan22-5b" else (TINY_CHANNELS, 8)
        shape = (batch, channels, (num_frames - 1) // 4 + 1, height // scale, width // scale)
        out = {"latents": torch.randn(shape, generator=gen)}
        if model == "wan22-i2v":
            out["image"] = torch.rand(1, 3, height, width, generator=gen)
        tokens = text_tokens or tm.TEXT_TOKENS
        for prefix in ("", "negative_") if negative else ("",):
            # As UMT5 prompts arrive: real tokens, then zeros up to the padded length.
            embeds = torch.randn(batch, tokens, tm.T5_DIM, generator=gen)
            embeds[:, tokens * 3 // 4 :] = 0
            out[prefix + "prompt_embeds"] = embeds
        return out

    return TinyModel("WanImageToVideoPipeline" if model == "wan22-i2v" else "WanPipeline", build, inputs)


# -- single-file checkpoints: Wan's original layout ----------------------------------------------------------
WAN_HEAD_DIM = 128


def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    dim, in_channels = shape("patch_embedding.weight")[:2]
    patch = list(shape("patch_embedding.weight")[2:])
    out_channels = shape("head.head.weight")[0] // (patch[0] * patch[1] * patch[2])
    if "img_emb.emb_pos" in shape:
        raise shape.error("a Wan 2.1 first-last-frame (FLF2V) transformer, which does not load yet: use Wan 2.1 I2V, "
                          "or Wan 2.2 I2V A14B")
    overrides = {
        "in_channels": in_channels, "out_channels": out_channels, "patch_size": patch,
        "num_attention_heads": shape.heads(dim, WAN_HEAD_DIM), "attention_head_dim": WAN_HEAD_DIM,
        "ffn_dim": shape("blocks.0.ffn.0.weight")[0], "num_layers": shape.blocks(r"blocks\.(\d+)\."),
        "text_dim": shape("text_embedding.0.weight")[1], "freq_dim": shape("time_embedding.0.weight")[1],
    }
    if "img_emb.proj.0.weight" in shape:  # Wan 2.1 I2V: CLIP vision features, cross-attended through k_img/v_img
        return "wan2.1-i2v-14b", {**overrides, "image_dim": shape("img_emb.proj.0.weight")[0],
                                  "added_kv_proj_dim": shape("blocks.0.cross_attn.k_img.weight")[1]}
    if in_channels != out_channels:  # noise, frame mask and start-image latents in: Wan 2.2 I2V A14B's experts
        return "wan2.2-i2v-a14b", overrides
    variant = "wan2.2-ti2v-5b" if in_channels == TINY_CHANNELS_5B else "wan2.1-t2v-14b" if dim >= 5120 else "wan2.1-t2v-1.3b"
    return variant, overrides


def read_vae(shape: Shapes) -> dict:
    """Wan 2.1's VAE (16 latent channels; Wan 2.2 A14B uses it too): its width and latent channels."""
    z_dim = shape("conv2.weight")[0]
    if z_dim != TINY_CHANNELS:
        raise shape.error(f"a Wan VAE with {z_dim} latent channels (the Wan 2.2 VAE of TI2V 5B?): only the Wan 2.1 VAE "
                          "(16 channels, wan_2.1_vae.safetensors) loads from a file; use a diffusers folder for TI2V 5B")
    return {"base_dim": shape("encoder.conv1.weight")[0], "z_dim": z_dim}


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(state_dict)


WAN = FAMILIES.register(Family(
    name="wan",
    pipelines={"WanPipeline": xFuserWanPipeline, "WanImageToVideoPipeline": xFuserWanImageToVideoPipeline},
    transformer="WanTransformer3DModel",
    plan=ParallelPlan(
        inputs={"": {"timestep": Split(dim=1, ndim=2)}, "blocks.0": {"hidden_states": Split(dim=1, expected_dims=3)}},
        outputs={"rope": Split(dim=1, items=(0, 1), expected_dims=4), "proj_out": Gather(dim=1, expected_dims=3)},
        attention={"blocks.*.attn1": TextLayout.NONE},
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
        # Each patch is whole token rows of the (frames × rows × columns) sequence; its rotary table
        # ([1, S, 1, D]) and Wan 2.2 TI2V's per-token modulation ([B, S, 6, D]) are sliced with it.
        pipefusion=PipeFusionPlan(
            blocks=("blocks",),
            token_inputs={"rotary_emb": TokenRows(dim=1), "temb": TokenRows(dim=1, ndim=4)},
        ),
        output_channels="out_channels",
    ),
    single_file=SingleFile(
        marker="blocks.0.self_attn.q.weight",
        title="Wan",
        variants={
            "wan2.1-t2v-1.3b": Variant("wan", "Wan 2.1 T2V 1.3B", "Wan keys blocks.*.self_attn.*, 16 channels, width below 5120"),
            "wan2.1-t2v-14b": Variant("wan", "Wan 2.1 T2V 14B", "Wan keys blocks.*.self_attn.*, 16 channels, width 5120"),
            "wan2.2-ti2v-5b": Variant("wan22-5b", "Wan 2.2 TI2V 5B", "Wan keys blocks.*.self_attn.*, 48 channels"),
            "wan2.2-t2v-a14b": Variant("wan22", "Wan 2.2 T2V A14B", "two Wan T2V files named high_noise / low_noise "
                                       "(or HIGH / LOW), side by side"),
            "wan2.2-i2v-a14b": Variant("wan22-i2v", "Wan 2.2 I2V A14B", "two Wan files of 36 input channels named "
                                       "high_noise / low_noise (or HIGH / LOW), side by side, and --vae"),
            "wan2.1-i2v-14b": Variant("wan21-i2v", "Wan 2.1 I2V 14B", "Wan keys with img_emb.* (CLIP vision), and --vae"),
        },
        read=read_checkpoint,
        convert=convert_checkpoint,
        # Comfy-Org's and city96's `wan2.2_t2v_{high,low}_noise_14B_*`, Kijai's `Wan2_2-T2V-A14B_{HIGH,LOW}_*`.
        experts=ExpertPair(words=(("high_noise", "low_noise"), ("HIGH", "LOW")),
                           variants={"wan2.1-t2v-14b": "wan2.2-t2v-a14b", "wan2.1-t2v-1.3b": "wan2.2-t2v-a14b",
                                     "wan2.2-i2v-a14b": "wan2.2-i2v-a14b"}),
        # ComfyUI's wan_2.1_vae.safetensors (Wan's own layout), for image-to-video and decoding on the pool
        vae=VaeFile(marker="decoder.upsamples.0.residual.0.gamma", title="Wan 2.1 VAE (wan_2.1_vae.safetensors)",
                    read=read_vae, needed="its pipeline encodes the start image with it"),
    ),
    tiny={model: _tiny(model) for model in ("wan", "wan22", "wan22-5b", "wan22-i2v")},
    # Its cross-attention (attn2) is the same class but the plan never selects it.
    attention_layers={"WanAttention": "diffusers.models.transformers.transformer_wan"},
))
