"""Single files too large to hold twice in a test's memory, written one tensor at a time.

ComfyUI recognises Z-Image only at its released width (dim 3840, 30 heads of 128): one main layer and its two
refiner pairs are ~0.9 B parameters, 3.6 GB in float32. The names and shapes are diffusers' model built on the meta
device and mapped to the released layout (original_layouts.z_image_to_original, which runs on meta tensors too);
each tensor is then drawn from its own seed and streamed into the safetensors file.

Qwen-Image likewise only at its released widths (24 heads of 128, text 3584 wide): one block is a 1.5 GB file,
written whole with its diffusers folder (write_qwen_image).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

QWEN = "tiny-qwen-image-comfy"
Z_IMAGE_TEXT = 64  # cap_feat_dim: ComfyUI reads it from the file, so the test conditioning can be this narrow


def z_image_config() -> dict:
    """Z-Image Turbo's widths (as ComfyUI fixes them for dim 3840) at one main layer."""
    return {"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 3840, "n_layers": 1,
            "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "cap_feat_dim": Z_IMAGE_TEXT, "axes_dims": [32, 48, 48],
            "rope_theta": 256.0, "t_scale": 1000.0}


def write_z_image(path: Path, seed: int = 3) -> Path:
    """The Z-Image file in ComfyUI's layout at `path` (kept if already there: built once per run)."""
    if path.exists():
        return path
    from diffusers import ZImageTransformer2DModel

    from original_layouts import z_image_to_original

    with torch.device("meta"):
        meta = z_image_to_original(ZImageTransformer2DModel(**z_image_config()).state_dict())
    names = sorted(meta)
    header, offset = {}, 0
    for name in names:
        size = meta[name].numel() * 4
        header[name] = {"dtype": "F32", "shape": list(meta[name].shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for index, name in enumerate(names):
            out.write(_draw(name, meta[name].shape, seed * 100_003 + index).numpy().data)
    partial.rename(path)
    return path


def _draw(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """A weight of an O(1) network: norms near 1, biases small, matrices at 1/√fan-in (the output layer at a quarter
    of that, so the velocity is O(1) as a trained model's is), pad tokens unit normal."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g)
    if name.endswith("final_layer.linear.weight"):
        return values / (4 * shape[1] ** 0.5)
    if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "cap_embedder.0" in name:
        return 1 + 0.1 * values
    if name.endswith("bias"):
        return 0.02 * values
    if len(shape) == 2 and "pad_token" not in name:
        return values / shape[1] ** 0.5
    return values


def write_qwen_image(folder: Path) -> Path:
    """A Qwen-Image of ComfyUI's own width (ComfyUI reads only its depth and input channels from a file: 24 heads of
    128, text 3584 wide) with one block, in `folder` as ComfyUI's models folders hold it: a diffusers folder
    (diffusers/QWEN) and a Comfy-Org single file (diffusion_models/QWEN.safetensors)."""
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import save_file

    from original_layouts import original_layout
    from parallel.families.qwenimage.tiny import tiny_text_encoder
    from parallel.loading import tiny_models

    pipe = tiny_models.build_tiny_pipeline("qwen-image", seed=4)
    transformer = tiny_models._peak_attention(
        tiny_models._seeded(4, QwenImageTransformer2DModel, num_layers=1), tiny_models.QK_SCALE)
    tokenizer, text_encoder = tiny_text_encoder(5, 3584, heads=28, kv_heads=4)
    pipe = type(pipe)(**{**pipe.components, "transformer": transformer, "tokenizer": tokenizer,
                         "text_encoder": text_encoder})
    pipe.save_pretrained(folder / "diffusers" / QWEN, safe_serialization=True)
    weights = original_layout("qwen-image", transformer)
    (folder / "diffusion_models").mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "diffusion_models" / f"{QWEN}.safetensors")
    return folder
