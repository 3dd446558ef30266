"""The pipeline wrapper base (wrapper.py) and its units; each family's wrappers live in its module in
parallel/families/."""

from .wrapper import xFuserPipelineBaseWrapper

__all__ = ["xFuserPipelineBaseWrapper"]
