"""ComfyUI's scaled fp8 checkpoints, read as ComfyUI's own loader reads them (comfy/ops.py):

- a `scaled_fp8` marker tensor: every `<layer>.weight` with a `<layer>.scale_weight` is fp8 and means
  stored · scale_weight (`<layer>.scale_input` scales activations for fp8 matmuls; a loader that
  dequantizes the weights has no use for it);
- ComfyUI's per-layer quantization metadata: `<layer>.comfy_quant` (UTF-8 JSON as uint8, e.g.
  {"format": "float8_e4m3fn"}) with `<layer>.weight_scale` (and `input_scale`), likewise stored · weight_scale.

The weights are dequantized here, before the family's converter renames and splits them, and then load in
the compute dtype (bf16 unless --dtype says otherwise): the pool holds them as bf16, not fp8. Block-scaled
formats of the newer metadata (nvfp4, mxfp8, ...) are refused with their name.
"""

from __future__ import annotations

import json

import torch

MARKER = "scaled_fp8"
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
_SCALES = (".scale_weight", ".weight_scale")
_DROPPED = (".scale_input", ".input_scale", ".comfy_quant")


def is_scaled(names) -> bool:
    return MARKER in names or any(name.endswith(".comfy_quant") for name in names)


def dequantize(state: dict[str, torch.Tensor], path) -> dict[str, torch.Tensor]:
    """The state dict with every scaled weight as stored · scale (fp32) and the scale tensors gone."""
    for name in [n for n in state if n.endswith(".comfy_quant")]:
        layout = json.loads(bytes(state[name].to(torch.uint8).tolist()).decode())
        if layout.get("format") not in FP8_FORMATS:
            raise ValueError(f"{path}: layer {name.removesuffix('.comfy_quant')} is stored as {layout.get('format')!r}, "
                             f"a format this pack does not read (it reads {', '.join(FP8_FORMATS)}); use an fp8, "
                             "bf16 or GGUF file of the model")
    out = {}
    for name, tensor in state.items():
        if name == MARKER or name.endswith(_SCALES + _DROPPED):
            continue
        scale = next((state[name.removesuffix(".weight") + s] for s in _SCALES
                      if name.endswith(".weight") and name.removesuffix(".weight") + s in state), None)
        out[name] = tensor if scale is None else tensor.to(torch.float32) * scale.to(torch.float32)
    return out
