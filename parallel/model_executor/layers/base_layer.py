"""Layer wrappers: parallel behaviour attached to one diffusers layer, in place.

A layer wrapper hooks the original module instead of replacing it in the model tree, so parameter
names (checkpoints, LoRA adapters) and the transformer's own forward stay exactly diffusers'.
"""

from __future__ import annotations

import torch

from ..base_wrapper import xFuserBaseWrapper


class xFuserLayerBaseWrapper(xFuserBaseWrapper):
    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def remove(self) -> None:
        """Detach from the layer, leaving it exactly as diffusers built it."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
