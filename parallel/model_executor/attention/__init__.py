"""Attention math: local kernels with log-sum-exp, and USP (Ulysses × Ring) over sequence shards."""

from .kernels import KERNELS, pick_kernel, register_kernel
from .usp import TextLayout, usp_attention

__all__ = ["KERNELS", "TextLayout", "pick_kernel", "register_kernel", "usp_attention"]
