"""The transformer wrapper: one class, parametrised by each family's ParallelPlan (parallel/families/)."""

from .base_transformer import xFuserTransformerBaseWrapper

__all__ = ["xFuserTransformerBaseWrapper"]
