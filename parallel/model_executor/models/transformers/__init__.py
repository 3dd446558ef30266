"""Transformer wrappers: one ParallelPlan per diffusers transformer class."""

from . import pixart_transformer_2d, transformer_flux, transformer_sd3, transformer_wan
from .base_transformer import xFuserTransformerBaseWrapper

__all__ = [
    "pixart_transformer_2d",
    "transformer_flux",
    "transformer_sd3",
    "transformer_wan",
    "xFuserTransformerBaseWrapper",
]
