"""Wrappers that parallelise diffusers pipelines, after xDiT's model_executor.

Importing this package registers every wrapper. `wrap_pipeline(pipeline)` parallelises a loaded
diffusers pipeline for the current layout, `under_layout(pipeline, config)` for the length of a block;
`capability_table()` prints what each family supports.
"""

from . import layers, models, pipelines, schedulers
from .capabilities import capability_table
from .layout_scope import under_layout
from .pipelines import xFuserPipelineBaseWrapper

wrap_pipeline = xFuserPipelineBaseWrapper.wrap

__all__ = ["capability_table", "layers", "models", "pipelines", "schedulers", "under_layout", "wrap_pipeline", "xFuserPipelineBaseWrapper"]
