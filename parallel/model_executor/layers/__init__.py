"""Layer wrappers (registered per diffusers layer class)."""

from . import attention_dispatch, attention_processor
from .attention_seam import xFuserAttentionBaseWrapper
from .base_layer import xFuserLayerBaseWrapper

__all__ = ["attention_dispatch", "attention_processor", "xFuserAttentionBaseWrapper", "xFuserLayerBaseWrapper"]
