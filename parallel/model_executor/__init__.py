"""Wrappers that parallelise diffusers pipelines, after xFuser's model_executor.

`wrap_pipeline(pipeline)` parallelises a loaded diffusers pipeline for the current layout, with the
wrappers its family declares (parallel/families/); `capability_table()` prints what each family supports;
`layout_scope.under_layout(pipeline, config)` runs a pipeline under one layout for the length of a block.
Importing this package imports no diffusers: the ComfyUI process reads the families' plans and data.
"""


def wrap_pipeline(pipeline, attention_kernel: str | None = None, reversible: bool = False):
    from .pipeline import xFuserPipelineBaseWrapper

    return xFuserPipelineBaseWrapper.wrap(pipeline, attention_kernel, reversible)


def capability_table() -> str:
    from .capabilities import capability_table as table

    return table()


__all__ = ["capability_table", "wrap_pipeline"]
