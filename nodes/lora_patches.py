"""ComfyUI's LoRA loaders on a pool's MODEL: the patches they add become a LoRA the pool applies.

LoraLoaderModelOnly and LoraLoader match a LoRA file's keys against ComfyUI's names for the model's weights
(comfy.lora.model_lora_keys_unet, ComfyUI's own key maps) and hand the MODEL one `lora` patch per weight: the
up and down matrices, alpha, and where the file names a slice of a fused weight (diffusers' to_q of Flux's
qkv), the slice. The pool's transformer is diffusers', so each patch is renamed with the inverse of ComfyUI's
own diffusers → ComfyUI key map (a fused patch split into its slices, the down matrix shared), alpha / rank
folded into the up matrix, and written as a diffusers (PEFT) LoRA file named by its content in a private
folder: the pool loads it once and stacks it at the loader's strength, and a repeated prompt sends nothing new.
Patches that are not LoRA (LoHa, LoKr, DoRA, model merges) are refused by the node that adds them.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from functools import cache
from pathlib import Path

import torch
import comfy.lora
from safetensors.torch import save_file


class UnsupportedPatch(ValueError):
    """A model patch the pool cannot apply (its transformer runs on the pool, not in ComfyUI)."""


@cache
def _folder() -> Path:
    """A folder only this user reads, for the LoRAs this ComfyUI process hands its pools."""
    return Path(tempfile.mkdtemp(prefix="xdit-loras-"))


def _diffusers_names(model) -> dict[tuple[str, tuple | None], str]:
    """(ComfyUI weight name, slice) → the diffusers module it is, from ComfyUI's own key map for the model."""
    names = {}
    for lora_key, target in comfy.lora.model_lora_keys_unet(model, {}).items():
        if lora_key.startswith("transformer."):
            key, offset = (target, None) if isinstance(target, str) else target[:2]
            names[key, offset] = lora_key.removeprefix("transformer.")
    return names


def peft_lora(model, patches: dict) -> dict[str, torch.Tensor]:
    """The patches ComfyUI's LoRA loader made for `model` (key or (key, offset) → adapter) as a diffusers LoRA."""
    names = _diffusers_names(model)
    split: dict[str, list[tuple[tuple, str]]] = {}
    for (key, offset), name in names.items():
        if offset is not None:
            split.setdefault(key, []).append((offset, name))
    lora = {}
    for target, adapter in patches.items():
        key, offset = (target, None) if isinstance(target, str) else target[:2]
        if getattr(adapter, "name", None) != "lora" or any(w is not None for w in adapter.weights[3:]):
            kind = getattr(adapter, "name", type(adapter).__name__)
            raise UnsupportedPatch(f"xDiT: this patch of {key} is ComfyUI's `{kind}` kind, which the pool cannot "
                                   "apply: it applies plain LoRA files (lora_up/lora_down, no DoRA, LoHa, LoKr) and no "
                                   "model merges; load a plain LoRA, or sample with ComfyUI's own model")
        up, down, alpha = adapter.weights[:3]
        up = up.float() * (float(alpha) / down.shape[0] if alpha is not None else 1.0)
        if offset is None and (key, None) not in names and key in split:
            parts = [(slice(o[1], o[1] + o[2]), name) for o, name in sorted(split[key])]  # a fused weight, whole
        else:
            name = names.get((key, offset)) or key.removeprefix("diffusion_model.").removesuffix(".weight")
            parts = [(slice(None), name)]
        for rows, name in parts:
            lora[f"transformer.{name}.lora_A.weight"] = down.float().contiguous()
            lora[f"transformer.{name}.lora_B.weight"] = up[rows].contiguous()
    return lora


def lora_file(lora: dict[str, torch.Tensor]) -> str:
    """The LoRA written once, named by its content: the same patches give the same file, which the pool keeps."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(lora):
        digest.update(name.encode())
        digest.update(lora[name].numpy().tobytes())
    path = _folder() / f"{digest.hexdigest()}.safetensors"
    if not path.is_file():
        partial = path.with_suffix(".partial")
        save_file(lora, partial)
        os.replace(partial, path)
    return str(path)
