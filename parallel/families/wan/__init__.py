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

from ...loading.checkpoints.shapes import Shapes
from ...model_executor.attention import TextLayout
from ...model_executor.plans import CfgMode, Gather, ParallelPlan, PipeFusionPlan, Split, TokenRows
from ..base import FAMILIES, ExpertPair, Family, SingleFile, Variant, VaeFile
from .pipelines import xFuserWanImageToVideoPipeline, xFuserWanPipeline
from .tiny import TINY_CHANNELS, TINY_CHANNELS_5B, _tiny


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
