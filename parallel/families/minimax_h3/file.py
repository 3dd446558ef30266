"""MiniMax-H3's single files: the layout Comfy-Org publishes (`video_patch_proj`, `audio_patch_proj`, `blocks.N.attn.
qkv_proj` with q, k and v stacked, `final_layer.video_out`), which ComfyUI's own MiniMaxH3 model reads. diffusers
converts it (`convert_minimax_h3_transformer_checkpoint_to_diffusers`, its "stacked" rows: every published single file's
order); the weights show every size. The templates' pruned files (`adaln_t_table` [grid, k] in place of the time
embedder: the curve form, ComfyUI's `adaln_curve_grid`) load too: their table goes through the converter beside the
other weights, and `adapt` swaps diffusers' time embedding and adaln modules for the curve form's (curve_form.py).
"""

from __future__ import annotations

from ..base import SingleFile, Variant

TABLE = "adaln_t_table"


def read_checkpoint(shape) -> tuple[str, dict]:
    head = shape("blocks.0.attn.q_norm.weight")[0]
    if TABLE in shape:  # the curve form: the adaln linears take the table's k coordinates; no time embedder to size
        time = {"time_embed_dim": shape(TABLE)[1]}
    else:
        time = {"freq_dim": shape("time_embedder.proj_in.weight")[1],
                "time_embed_hidden_dim": shape("time_embedder.proj_in.weight")[0],
                "time_embed_dim": shape("time_embedder.proj_out.weight")[0]}
    return "minimax-h3", {
        "hidden_size": shape("video_patch_proj.weight")[0], "attention_head_dim": head,
        "num_attention_heads": shape("blocks.0.attn.qkv_proj.weight")[0] // (3 * head),
        "num_layers": shape.blocks(r"blocks\.(\d+)\."), "num_refiner_layers": shape.blocks(r"token_refiner\.blocks\.(\d+)\."),
        "ffn_dim": shape("blocks.0.mlp.fc1.weight")[0] // 2, "in_channels": shape("final_layer.video_out.weight")[0] // 4,
        "audio_in_channels": shape("final_layer.audio_out.weight")[0], "text_dim": shape("condition_proj.weight")[1],
        "rope_freq_dim": shape("rope.inv_freq")[0], **time,
    }


def convert_checkpoint(state_dict: dict, config: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    table = state_dict.pop(TABLE, None)  # diffusers' converter refuses it; the curve form's module holds it
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(state_dict, config, qkv_layout="stacked")
    return converted if table is None else {**converted, f"time_embedder.{TABLE}": table}


def adapt_model(model, state_dict: dict) -> bool:
    from .curve_form import use_curve_form

    return use_curve_form(model, state_dict)


SINGLE_FILE = SingleFile(
    marker="audio_patch_proj.weight", title="MiniMax-H3",
    variants={"minimax-h3": Variant("minimax-h3", "MiniMax-H3 text to video with sound",
                                    "Comfy-Org keys video_patch_proj, audio_patch_proj, blocks.*.attn.qkv_proj")},
    read=read_checkpoint, convert=convert_checkpoint, adapt=adapt_model)
