"""The pipeline wrapper base; each family's wrappers live in its module in parallel/families/."""

from .base_pipeline import xFuserPipelineBaseWrapper

__all__ = ["xFuserPipelineBaseWrapper"]
