"""Attention layers whose processors call diffusers' `dispatch_attention_fn` ([B, S, H, D] layout)."""

from __future__ import annotations

from diffusers.models.transformers.transformer_flux import FluxAttention
from diffusers.models.transformers.transformer_wan import WanAttention

from ..register import xFuserLayerWrappersRegister
from .attention_seam import routed, xFuserAttentionBaseWrapper


class _DispatchAttentionWrapper(xFuserAttentionBaseWrapper):
    """Processors that call `dispatch_attention_fn` with [B, S, H, D] tensors; subclasses name the module."""

    @staticmethod
    def reroute(original):
        return routed(original, tokens_dim=1)


@xFuserLayerWrappersRegister.register(FluxAttention)
class xFuserFluxAttentionWrapper(_DispatchAttentionWrapper):
    call_site = ("diffusers.models.transformers.transformer_flux", "dispatch_attention_fn")


@xFuserLayerWrappersRegister.register(WanAttention)
class xFuserWanAttentionWrapper(_DispatchAttentionWrapper):
    """Wan's self-attention; its cross-attention calls the same function but is never wrapped."""

    call_site = ("diffusers.models.transformers.transformer_wan", "dispatch_attention_fn")
