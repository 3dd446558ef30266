"""HunyuanVideo 1.5's single files: Tencent's layout (`double_blocks.N.img_attn_qkv`, `txt_in.individual_token_refiner`,
`byt5_in`, `vision_in`, `cond_type_embedding`), as Comfy-Org repackages it (`hunyuanvideo1.5_720p_t2v_fp16.safetensors`),
the q, k and v of its attentions fused or apart, its q/k norms `.weight` or `.scale` (ComfyUI reads all of these).

diffusers has no single-file converter for it: the names map one to one (diffusers' scripts/convert_hunyuan_video1_5_to_
diffusers.py is the reference), fused q/k/v split in three, the final layer's modulation halves swapped (shift, scale →
scale, shift). The weights show every size; 480p or 720p (the image-to-video bucket size and the scheduler's shift)
and text- or image-to-video (the pipeline) come from the file's name, as Comfy-Org names them.
"""

from __future__ import annotations

import re

import torch

from ..loading.checkpoints.shapes import Shapes
from .base import SingleFile, Variant

HEAD_DIM = 128  # every released HunyuanVideo (ComfyUI fixes it too)
_NAMES = [  # Tencent's name (regex) → diffusers' name ({} the block index)
    (r"img_in\.proj", "x_embedder.proj"),
    (r"time_in\.mlp\.0", "time_embed.timestep_embedder.linear_1"),
    (r"time_in\.mlp\.2", "time_embed.timestep_embedder.linear_2"),
    (r"txt_in\.t_embedder\.mlp\.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
    (r"txt_in\.t_embedder\.mlp\.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
    (r"txt_in\.c_embedder\.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1"),
    (r"txt_in\.c_embedder\.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2"),
    (r"txt_in\.input_embedder", "context_embedder.proj_in"),
    (r"byt5_in\.layernorm", "context_embedder_2.norm"),
    *((rf"byt5_in\.fc{i}", f"context_embedder_2.linear_{i}") for i in (1, 2, 3)),
    *((rf"vision_in\.proj\.{i}", f"image_embedder.{name}")
      for i, name in ((0, "norm_in"), (1, "linear_1"), (3, "linear_2"), (4, "norm_out"))),
    (r"cond_type_embedding", "cond_type_embed"),
    (r"final_layer\.linear", "proj_out"),
]
_REFINER = [(r"norm1", "norm1"), (r"norm2", "norm2"), (r"self_attn_proj", "attn.to_out.0"), (r"mlp\.fc1", "ff.net.0.proj"),
            (r"mlp\.fc2", "ff.net.2"), (r"adaLN_modulation\.1", "norm_out.linear")]
_DOUBLE = [(r"img_mod\.linear", "norm1.linear"), (r"txt_mod\.linear", "norm1_context.linear"),
           (r"img_attn_q_norm", "attn.norm_q"), (r"img_attn_k_norm", "attn.norm_k"), (r"img_attn_proj", "attn.to_out.0"),
           (r"txt_attn_q_norm", "attn.norm_added_q"), (r"txt_attn_k_norm", "attn.norm_added_k"),
           (r"txt_attn_proj", "attn.to_add_out"), (r"img_mlp\.fc1", "ff.net.0.proj"), (r"img_mlp\.fc2", "ff.net.2"),
           (r"txt_mlp\.fc1", "ff_context.net.0.proj"), (r"txt_mlp\.fc2", "ff_context.net.2"),
           *((rf"img_attn_{x}", f"attn.to_{x}") for x in "qkv"),
           *((rf"txt_attn_{x}", f"attn.add_{x}_proj") for x in "qkv")]
_FUSED = {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
          "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def read_checkpoint(shape: Shapes) -> tuple[str, dict]:
    """The variant and the config values the weights pin down (sizes, depths, widths): the shipped config of the
    variant the name says supplies the rest (target size, task type, the scheduler's shift)."""
    hidden, in_channels, patch_t, patch, _ = shape("img_in.proj.weight")
    if "vision_in.proj.0.weight" not in shape or "byt5_in.fc1.weight" not in shape:
        raise shape.error("a HunyuanVideo transformer without HunyuanVideo 1.5's glyph and vision inputs (HunyuanVideo "
                          "1.0?), which this pack does not load; use HunyuanVideo 1.5")
    out_channels = shape("final_layer.linear.weight")[0] // (patch_t * patch * patch)
    if "time_r_in.mlp.0.weight" in shape or in_channels != 2 * out_channels + 1:  # not noise, image, mask
        raise shape.error("a HunyuanVideo 1.5 step-distilled or super-resolution transformer (a second timestep, "
                          f"`time_r_in`, or {in_channels} input channels), which this pack does not load yet; use the "
                          "480p / 720p text- or image-to-video file")
    task = "i2v" if shape.named("i2v") else "t2v"
    return f"hunyuanvideo1.5-{'720p' if shape.named('720p') else '480p'}-{task}", {
        "in_channels": in_channels, "out_channels": out_channels,
        "patch_size": patch, "patch_size_t": patch_t, "attention_head_dim": HEAD_DIM,
        "num_attention_heads": shape.heads(hidden, HEAD_DIM), "num_layers": shape.blocks(r"double_blocks\.(\d+)\."),
        "num_refiner_layers": shape.blocks(r"txt_in\.individual_token_refiner\.blocks\.(\d+)\."),
        "mlp_ratio": shape("double_blocks.0.img_mlp.fc1.weight")[0] / hidden,
        "text_embed_dim": shape("txt_in.input_embedder.weight")[1], "text_embed_2_dim": shape("byt5_in.fc1.weight")[1],
        "image_embed_dim": shape("vision_in.proj.0.weight")[0],
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    """Tencent's names → diffusers' (popping each tensor as it goes, so a large file is not held twice); a tensor
    without a name here is refused rather than dropped, since strict loading would only report it as missing."""
    out = {}
    for key in list(state_dict):
        stem, kind = key.rsplit(".", 1)
        kind = "weight" if kind == "scale" else kind  # ComfyUI's q/k norm name
        value = state_dict.pop(key)
        if stem == "final_layer.adaLN_modulation.1":  # (shift, scale) → diffusers' (scale, shift)
            shift, scale = value.chunk(2)
            out[f"norm_out.linear.{kind}"] = torch.cat([scale, shift])
            continue
        prefix, tables = "", [_NAMES]
        if match := re.fullmatch(r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.(.+)", stem):
            prefix, stem, tables = f"context_embedder.token_refiner.refiner_blocks.{match[1]}.", match[2], [_REFINER]
        elif match := re.fullmatch(r"double_blocks\.(\d+)\.(.+)", stem):
            prefix, stem, tables = f"transformer_blocks.{match[1]}.", match[2], [_DOUBLE]
        if stem in _FUSED:
            for name, part in zip(_FUSED[stem], value.chunk(3)):
                out[f"{prefix}{name}.{kind}"] = part
            continue
        target = next((name for table in tables for pattern, name in table if re.fullmatch(pattern, stem)), None)
        if target is None:
            raise ValueError(f"HunyuanVideo 1.5 tensor {key} has no diffusers name: a variant this pack does not load")
        out[f"{prefix}{target}.{kind}"] = value
    return out


def _variants() -> dict[str, Variant]:
    """480p / 720p × t2v / i2v: one shape, told apart by Comfy-Org's file names (the bucket size, the shift, the
    pipeline differ)."""
    titles = {"t2v": "text-to-video", "i2v": "image-to-video"}
    return {f"hunyuanvideo1.5-{size}-{task}": Variant(
        "hunyuanvideo15" if task == "t2v" else "hunyuanvideo15-i2v", f"HunyuanVideo 1.5 {size} {titles[task]}",
        f"Tencent keys double_blocks.*, cond_type_embedding{', `720p`' if size == '720p' else ''}"
        f"{', `i2v`' if task == 'i2v' else ''} in the file name")
        for size in ("480p", "720p") for task in ("t2v", "i2v")}


SINGLE_FILE = SingleFile(marker="cond_type_embedding.weight", title="HunyuanVideo 1.5", variants=_variants(),
                         read=read_checkpoint, convert=convert_checkpoint)
