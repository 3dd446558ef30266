"""Run a pipeline under one parallel layout, then leave the process as it was.

Tests, benchmarks and anything else that tries several layouts in one process need the same steps in
the same order: carve the mesh, wrap, run, unwrap, tear the mesh down (also when the run fails), so the
next layout starts from diffusers' own pipeline and a fresh mesh.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from diffusers import DiffusionPipeline

from ..layout.config import ParallelConfig
from ..distributed import destroy_model_parallel, initialize_model_parallel
from .pipeline import xFuserPipelineBaseWrapper


@contextlib.contextmanager
def under_layout(pipeline: DiffusionPipeline, config: ParallelConfig,
                 attention_kernel: str | None = None) -> Iterator[xFuserPipelineBaseWrapper]:
    """`pipeline` wrapped for `config` inside the block; unwrapped and the mesh destroyed afterwards.
    Every rank must enter with the same config (the mesh is built collectively)."""
    initialize_model_parallel(config)
    try:
        wrapped = xFuserPipelineBaseWrapper.wrap(pipeline, attention_kernel)
        try:
            yield wrapped
        finally:
            wrapped.unwrap()
    finally:
        destroy_model_parallel()
