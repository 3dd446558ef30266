"""The engine (`parallel/`) as the pool imports it.

The pool runs in two settings: as the top-level package `workers` (rank processes, the CLI, tests: the
repo root is on sys.path) and as a subpackage of the pack inside ComfyUI, which must not add `parallel`
or `workers` to sys.modules nor touch sys.path. So the engine is imported next to this package: from the
pack when there is one above us, else top-level. Heavy engine modules are imported by `engine(name)`
where they are used (rank processes only).
"""

from __future__ import annotations

import importlib
from types import ModuleType

_ENGINE = ".".join([*__package__.split(".")[:-1], "parallel"])


def engine(module: str) -> ModuleType:
    """`parallel.<module>`, from the same place this package was imported from."""
    return importlib.import_module(f"{_ENGINE}.{module}")


config = engine("config")
builtin_models = engine("builtin_models")
launch = engine("launch")
ArgumentParser = engine("arguments").ArgumentParser

LayoutError = config.LayoutError
ParallelConfig = config.ParallelConfig
AutoLayout = config.AutoLayout
PIPELINE_TENSOR_INPUTS = engine("families").FAMILIES.tensor_inputs()  # every registered pipeline's
MODEL_CALL_TENSORS = engine("families").FAMILIES.model_call_tensors()  # single model calls (xDiT Model)
add_parallel_arguments = config.add_parallel_arguments
config_from_args = config.config_from_args
auto_layout_from_args = config.auto_layout_from_args

request = engine("request")  # the one request type: SampleRequest, its fields, flags and checks
