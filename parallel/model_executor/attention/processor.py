"""diffusers' classic `Attention` layer (PixArt, SD3): its processors call F.scaled_dot_product_attention."""

from __future__ import annotations

import types

from diffusers.models.attention_processor import Attention

from ..register import xFuserLayerWrappersRegister
from .seam import routed, xFuserAttentionBaseWrapper


class _RoutedFunctional(types.ModuleType):
    """torch.nn.functional as seen from diffusers' attention_processor module, with SDPA rerouted."""

    def __init__(self, functional):
        super().__init__(functional.__name__)
        self.scaled_dot_product_attention = routed(functional.scaled_dot_product_attention, tokens_dim=2)
        self._functional = functional

    def __getattr__(self, name):
        return getattr(self._functional, name)


@xFuserLayerWrappersRegister.register(Attention)
class xFuserAttentionWrapper(xFuserAttentionBaseWrapper):
    call_site = ("diffusers.models.attention_processor", "F")

    @staticmethod
    def reroute(original):
        return _RoutedFunctional(original)
