"""Model wrappers are nn.Modules, so pipelines keep treating the wrapped model as a model."""

from __future__ import annotations

from typing import Any

import torch

from ..base_wrapper import xFuserBaseWrapper


class xFuserModelBaseWrapper(torch.nn.Module, xFuserBaseWrapper):
    def __init__(self, module: torch.nn.Module):
        torch.nn.Module.__init__(self)
        self.module = module

    def __getattr__(self, name: str) -> Any:
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(self._modules["module"], name)
