"""Model wrappers."""

from . import transformers
from .base_model import xFuserModelBaseWrapper

__all__ = ["transformers", "xFuserModelBaseWrapper"]
