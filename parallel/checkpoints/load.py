"""A diffusers pipeline from a single-file transformer checkpoint and the configs shipped in parallel/configs.

The transformer is converted with diffusers' own single-file converters (Flux, SD3) or a port of diffusers'
PixArt conversion script (diffusers has no PixArt single-file loader), checked against the config the
detection derived, and loaded with `from_single_file(..., config=<shipped folder>, local_files_only=True)`:
nothing comes from a model hub. The pipeline has the transformer and the shipped scheduler; VAE and text
encoders are None, because the pool samples from ComfyUI's embeddings and latents.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import diffusers
import torch
from accelerate import init_empty_weights
from diffusers.loaders.single_file_model import FromOriginalModelMixin
from diffusers.loaders.single_file_utils import (
    convert_flux_transformer_checkpoint_to_diffusers,
    convert_sd3_transformer_checkpoint_to_diffusers,
)

from .detect import CheckpointFile, Detected, detect_checkpoint

log = logging.getLogger(__name__)

# diffusers' Flux converter splits the single blocks' fused linear1 (q | k | v | mlp) at Flux.1's width:
# inner_dim = 3072, mlp 4 x 3072.
FLUX1_WIDTH = 3072


def _flux_to_diffusers(state_dict: dict, config: dict) -> dict:
    """diffusers' converter. A narrower Flux (the test models) gets its fused linear1 rows padded to the split
    diffusers expects and the pieces cut back after; Flux.1 checkpoints pass through untouched."""
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


def _sd3_to_diffusers(state_dict: dict, config: dict) -> dict:
    return convert_sd3_transformer_checkpoint_to_diffusers(state_dict)


def _pixart_to_diffusers(state_dict: dict, config: dict) -> dict:
    """PixArt-α/Σ original keys → diffusers names (the layout diffusers' PixArt conversion script documents)."""
    out = {}

    def move(src: str, dst: str) -> None:
        for kind in ("weight", "bias"):
            out[f"{dst}.{kind}"] = state_dict.pop(f"{src}.{kind}")

    def split(src: str, *dsts: str) -> None:  # fused q|k|v or k|v rows
        for kind in ("weight", "bias"):
            for dst, piece in zip(dsts, torch.chunk(state_dict.pop(f"{src}.{kind}"), len(dsts), dim=0)):
                out[f"{dst}.{kind}"] = piece

    move("x_embedder.proj", "pos_embed.proj")
    move("y_embedder.y_proj.fc1", "caption_projection.linear_1")
    move("y_embedder.y_proj.fc2", "caption_projection.linear_2")
    emb = "adaln_single.emb."
    move("t_embedder.mlp.0", emb + "timestep_embedder.linear_1")
    move("t_embedder.mlp.2", emb + "timestep_embedder.linear_2")
    if config["use_additional_conditions"]:  # PixArt-α 1024-MS micro-conditions: resolution and aspect ratio
        for src, dst in (("csize_embedder", "resolution_embedder"), ("ar_embedder", "aspect_ratio_embedder")):
            move(f"{src}.mlp.0", f"{emb}{dst}.linear_1")
            move(f"{src}.mlp.2", f"{emb}{dst}.linear_2")
    move("t_block.1", "adaln_single.linear")
    for i in range(config["num_layers"]):
        src, dst = f"blocks.{i}.", f"transformer_blocks.{i}."
        out[dst + "scale_shift_table"] = state_dict.pop(src + "scale_shift_table")
        split(src + "attn.qkv", dst + "attn1.to_q", dst + "attn1.to_k", dst + "attn1.to_v")
        move(src + "attn.proj", dst + "attn1.to_out.0")
        move(src + "cross_attn.q_linear", dst + "attn2.to_q")
        split(src + "cross_attn.kv_linear", dst + "attn2.to_k", dst + "attn2.to_v")
        move(src + "cross_attn.proj", dst + "attn2.to_out.0")
        move(src + "mlp.fc1", dst + "ff.net.0.proj")
        move(src + "mlp.fc2", dst + "ff.net.2")
    move("final_layer.linear", "proj_out")
    out["scale_shift_table"] = state_dict.pop("final_layer.scale_shift_table")
    return out  # left behind on purpose: y_embedder.y_embedding (training's null caption), pos_embed (recomputed)


CONVERTERS = {"flux": _flux_to_diffusers, "sd3": _sd3_to_diffusers,
              "pixart-alpha": _pixart_to_diffusers, "pixart-sigma": _pixart_to_diffusers}


def _weights_dtype(state_dict: dict) -> torch.dtype:
    """The dtype most of the weights are stored in; fp8 storage computes in bf16."""
    counts = Counter()
    for tensor in state_dict.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] += tensor.numel()
    dtype = counts.most_common(1)[0][0] if counts else torch.float32
    return torch.bfloat16 if dtype.itemsize == 1 else dtype


def _check_fits(model: torch.nn.Module, state_dict: dict, detected: Detected) -> None:
    """One error naming what differs between the converted weights and the model the config describes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    wrong = [f"{k} {tuple(state_dict[k].shape)} (expected {expected[k]})"
             for k in sorted(expected.keys() & state_dict.keys()) if tuple(state_dict[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        found = (("missing", missing), ("unexpected", unexpected), ("of the wrong shape", wrong))
        problems = [f"{len(v)} {what}: {v[:4]}{' ...' if len(v) > 4 else ''}" for what, v in found if v]
        raise ValueError(f"{detected.path} does not fit the {detected.describe()} transformer: "
                         f"{'; '.join(problems)}. The file is damaged or a variant this pack does not support")


def load_transformer(detected: Detected, checkpoint: CheckpointFile, index: dict, dtype: torch.dtype | None):
    cls = getattr(diffusers, index["transformer"][1])
    config = {**cls.load_config(detected.config_dir, subfolder="transformer", local_files_only=True),
              **detected.overrides}
    original = checkpoint.state_dict()
    dtype = dtype or _weights_dtype(original)
    try:
        state_dict = CONVERTERS[detected.family](original, config)
    except KeyError as error:
        raise ValueError(f"{detected.path} looks like {detected.describe()} but lacks tensor {error}: the file is "
                         "incomplete or a variant this pack does not support") from None
    except (ValueError, RuntimeError) as error:  # fused tensors that do not split as the shapes say
        raise ValueError(f"{detected.path} does not convert as {detected.describe()}: {error}") from None
    with init_empty_weights():
        model = cls.from_config(config)
    _check_fits(model, state_dict, detected)
    if issubclass(cls, FromOriginalModelMixin):
        return cls.from_single_file(state_dict, config=str(detected.config_dir), subfolder="transformer",
                                    local_files_only=True, torch_dtype=dtype, **detected.overrides)
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()


def load_single_file_pipeline(path: str | Path, *, dtype: torch.dtype | None = None) -> diffusers.DiffusionPipeline:
    """The detected family's diffusers pipeline around the file's transformer (dtype None: as stored)."""
    checkpoint = CheckpointFile(path)
    detected = detect_checkpoint(checkpoint)
    log.info("single-file checkpoint %s: %s", path, detected.describe())
    index = json.loads((detected.config_dir / "model_index.json").read_text())
    transformer = load_transformer(detected, checkpoint, index, dtype)
    scheduler = getattr(diffusers, index["scheduler"][1]).from_pretrained(
        detected.config_dir, subfolder="scheduler", local_files_only=True)
    pipeline_cls = getattr(diffusers, index["_class_name"])
    modules, _ = pipeline_cls._get_signature_keys(pipeline_cls)
    absent = {name: None for name in modules if name not in ("transformer", "scheduler")}
    pipeline = pipeline_cls(**absent, transformer=transformer, scheduler=scheduler)
    pipeline.register_to_config(_name_or_path=str(path))
    return pipeline
