"""LoRA layouts diffusers does not convert itself.

BFL's own Flux LoRA layout (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`, fused
q/k/v) is not recognised by diffusers' Flux loader (it converts Kohya, XLabs and BFL *control*
LoRAs). A LoRA on a fused layer has one A and a stacked B, so it splits exactly into per-layer
LoRAs: each part keeps A and takes its rows of B.
"""

from __future__ import annotations

import re

import torch

_FLUX_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
    "img_mod.lin": ("norm1.linear",),
    "txt_mod.lin": ("norm1_context.linear",),
}
_FLUX_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}
_LAYER = re.compile(r"^diffusion_model\.(double_blocks|single_blocks)\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def is_bfl_flux_lora(weights: dict[str, torch.Tensor]) -> bool:
    return any(_LAYER.match(key) for key in weights)


def bfl_flux_to_diffusers(weights: dict[str, torch.Tensor], inner_dim: int) -> dict[str, torch.Tensor]:
    """`transformer.`-prefixed PEFT keys for a BFL-layout Flux LoRA of the blocks."""
    out, unknown = {}, []
    for key, value in weights.items():
        match = _LAYER.match(key)
        table = (_FLUX_DOUBLE if match and match[1] == "double_blocks" else _FLUX_SINGLE) if match else {}
        if not match or match[3] not in table:
            unknown.append(key)
            continue
        kind, index, layer, ab = match.groups()
        block = f"transformer.{'transformer_blocks' if kind == 'double_blocks' else 'single_transformer_blocks'}.{index}"
        targets = table[layer]
        if ab == "A" or len(targets) == 1:
            parts = [value] * len(targets)
        else:  # fused output rows: q, k, v are inner_dim each; the rest is the MLP input projection
            sizes = [inner_dim] * 3 + ([value.shape[0] - 3 * inner_dim] if len(targets) == 4 else [])
            parts = list(value.split(sizes))
        for target, part in zip(targets, parts):
            out[f"{block}.{target}.lora_{ab}.weight"] = part.contiguous()
    if unknown:
        raise ValueError(f"BFL Flux LoRA has layers this loader does not map, e.g. {unknown[0]}")
    return out
