"""ComfyUI's scaled fp8 checkpoints, read as ComfyUI's own loader reads them (comfy/ops.py):

- a `scaled_fp8` marker tensor: every `<layer>.weight` with a `<layer>.scale_weight` is fp8 and means
  stored · scale_weight (`<layer>.scale_input` scales activations for fp8 matmuls; a loader that
  dequantizes the weights has no use for it);
- ComfyUI's per-layer quantization metadata: `<layer>.comfy_quant` (UTF-8 JSON as uint8, e.g.
  {"format": "float8_e4m3fn"}) with `<layer>.weight_scale` (and `input_scale`), likewise stored · weight_scale.

`read` separates the weights from their scales; the weights then stay fp8 in memory (fp8.py), or, where
the layers must be plain tensors (--shard-weights), are dequantized here before the family's converter
renames and splits them. The int8 files of the 2026 templates (`*_int8`: comfy_quant `int8_tensorwise`, stored ·
weight_scale, one number or one per row, the ConvRot variant's columns turned by a Hadamard matrix per group) are
dequantized as `read` takes them, to the compute dtype, as ComfyUI computes them where it has no int8 matmul.
Block-scaled formats of the newer metadata (nvfp4, mxfp8, int4 ...) are refused with their name. A file that is broken would otherwise load silently wrong (a weight read unscaled is thousands of
times too large), so every one is refused in one line naming the file and the tensor: an fp8 weight of a
`scaled_fp8` file without its `scale_weight`, a `comfy_quant` layer without its `weight_scale`, a marker with no
scales at all, and scales without a marker (ComfyUI would ignore them).
"""

from __future__ import annotations

import json
import math

import torch

MARKER = "scaled_fp8"
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
INT8_FORMATS = ("int8_tensorwise",)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALES = (".scale_weight", ".weight_scale")
_DROPPED = (".scale_input", ".input_scale", ".comfy_quant")


def is_scaled(names) -> bool:
    return MARKER in names or any(name.endswith(".comfy_quant") for name in names)


def comfy_fast(state: dict[str, torch.Tensor]) -> bool:
    """Whether ComfyUI multiplies this file's fp8 layers in fp8 where the card can (fp8_matmul.py's default): a
    `scaled_fp8` marker other than its 2-element "no fast matmul" one (comfy/model_detection.py), or per-layer
    fp8 metadata without `full_precision_matrix_mult` (comfy/ops.py's mixed-precision layers)."""
    if MARKER in state:
        return state[MARKER].numel() != 2
    layouts = [json.loads(bytes(state[n].to(torch.uint8).tolist()).decode()) for n in state if n.endswith(".comfy_quant")]
    return any(layout.get("format") in FP8_FORMATS and not layout.get("full_precision_matrix_mult") for layout in layouts)


def read(state: dict[str, torch.Tensor], path, dtype: torch.dtype = torch.float32
         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights without the marker and scale tensors (int8 layers dequantized to `dtype`), and each fp8
    weight's scale (none for a file that is not scaled); raises for a broken one (see the module docstring)."""
    scale_names = [n for n in state if n.endswith(_SCALES)]
    if not is_scaled(state):
        if scale_names:
            raise ValueError(f"{path}: tensor {scale_names[0]} scales an fp8 weight, but the file has no {MARKER} marker "
                             "nor comfy_quant metadata, so its weights cannot be read as ComfyUI would: the file is damaged "
                             "or was written by a tool this pack does not know; use another copy")
        return state, {}
    if MARKER in state:
        if not any(n.endswith(".scale_weight") for n in scale_names):
            raise ValueError(f"{path}: the file is marked {MARKER} but holds no tensor *.scale_weight: its fp8 weights "
                             "would be read unscaled; the file is damaged, use another copy")
        unscaled = next((n for n, t in state.items() if n.endswith(".weight") and t.dtype in FP8_DTYPES and
                         n.removesuffix(".weight") + ".scale_weight" not in state and not _per_layer(state, n)), None)
        if unscaled is not None:
            layer = unscaled.removesuffix(".weight")
            raise ValueError(f"{path}: tensor {unscaled} is fp8 in a {MARKER} file but has no {layer}.scale_weight, so "
                             "it would be read unscaled: the file is damaged, use another copy")
    layouts = {}  # int8 layers: their comfy_quant metadata
    for name in [n for n in state if n.endswith(".comfy_quant")]:
        layer = name.removesuffix(".comfy_quant")
        layout = json.loads(bytes(state[name].to(torch.uint8).tolist()).decode())
        if layout.get("format") not in FP8_FORMATS + INT8_FORMATS:
            raise ValueError(f"{path}: layer {layer} is stored as {layout.get('format')!r}, "
                             f"a format this pack does not read (it reads {', '.join(FP8_FORMATS + INT8_FORMATS)}); "
                             "use an fp8, int8, bf16 or GGUF file of the model")
        if f"{layer}.weight_scale" not in state:
            raise ValueError(f"{path}: layer {layer} is {layout['format']} but has no {layer}.weight_scale: the file "
                             "is damaged or was written by a tool this pack does not know; use another copy")
        if layout["format"] in INT8_FORMATS:
            layouts[layer] = layout
    weights = {name: tensor for name, tensor in state.items() if not (name == MARKER or name.endswith(_SCALES + _DROPPED))}
    for layer, layout in layouts.items():
        weights[f"{layer}.weight"] = int8_weight(state[f"{layer}.weight"], state[f"{layer}.weight_scale"], layout, dtype)
    scales = {}
    for name in weights:
        layer = name.removesuffix(".weight")
        scale = next((state[layer + s] for s in _SCALES if name.endswith(".weight") and layer + s in state), None)
        if scale is not None and layer not in layouts:
            scales[name] = scale.to(torch.float32)
    return weights, scales


def int8_weight(stored: torch.Tensor, scale: torch.Tensor, layout: dict, dtype: torch.dtype) -> torch.Tensor:
    """An int8_tensorwise layer's weight: stored · scale (fp32), and for a ConvRot layer each group of its input
    columns turned back by the normalised Hadamard matrix it was turned by (its own inverse); then `dtype`."""
    weight = stored.to(torch.float32) * scale.to(torch.float32)
    params = layout.get("params") if isinstance(layout.get("params"), dict) else {}
    if layout.get("convrot", params.get("convrot", False)):
        group = int(layout.get("convrot_groupsize", params.get("convrot_groupsize", 256)))
        rows, columns = weight.shape
        weight = (weight.reshape(rows, columns // group, group) @ hadamard(group)).reshape(rows, columns)
    return weight.to(dtype)


def hadamard(size: int) -> torch.Tensor:
    """ConvRot's rotation of a group of `size` (a power of 4) columns: the regular Hadamard matrix, Kronecker powers
    of the 4 × 4 one whose rows each hold one -1, normalised (orthogonal and symmetric: its own inverse)."""
    if size < 4 or 4 ** round(math.log(size, 4)) != size:
        raise ValueError(f"a ConvRot group of {size} columns: ComfyUI's int8 layers rotate groups of a power of 4")
    four = torch.ones(4, 4) - 2 * torch.eye(4).flip(1)
    matrix = four
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, four)
    return matrix / size ** 0.5


def _per_layer(state: dict, weight: str) -> bool:
    """Whether the weight's layer carries its own quantization metadata (comfy_quant, checked apart)."""
    return weight.removesuffix(".weight") + ".comfy_quant" in state


def dequantize(weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every scaled weight as stored · scale (fp32)."""
    return {name: tensor if name not in scales else tensor.to(torch.float32) * scales[name]
            for name, tensor in weights.items()}
