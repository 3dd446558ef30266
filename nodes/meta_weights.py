"""What ComfyUI's model code reads off a diffusion model that lives on the pool: its weights' shapes and its
config values.

ComfyUI's model classes look at their diffusion model outside its forward (WAN21.concat_cond reads
`patch_embedding.weight.shape[1]` to count a concat latent's channels, Flux's `img_in.weight` and `patch_size`).
PoolTransformer answers such reads from the file's weight names (meta tensors: shapes only) and from the
unet_config ComfyUI detected, so those model classes run unchanged.
"""

from __future__ import annotations

import torch


class MetaWeights:
    """The weights under `prefix` as attributes: a full name gives a meta tensor of its shape, a partial one the
    weights below it."""

    def __init__(self, shapes: dict[str, torch.Size], prefix: str):
        self._shapes, self._prefix = shapes, prefix

    def __getattr__(self, name: str):
        return lookup(self._shapes, f"{self._prefix}.{name}")

    def __getitem__(self, index: int):  # ModuleList children: blocks[0]
        return lookup(self._shapes, f"{self._prefix}.{index}")


def lookup(shapes: dict[str, torch.Size], name: str):
    if name in shapes:
        return torch.empty(shapes[name], device="meta")
    if any(key.startswith(name + ".") for key in shapes):
        return MetaWeights(shapes, name)
    raise AttributeError(f"the pool's model file has no weights named {name!r}")
