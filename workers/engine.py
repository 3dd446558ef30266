"""The engine (`parallel/`) as the pool imports it.

The pool runs in two settings: as the top-level package `workers` (rank processes, the CLI, tests: the
repo root is on sys.path) and as a subpackage of the pack inside ComfyUI, which must not add `parallel`
or `workers` to sys.modules nor touch sys.path. So the engine is imported next to this package: from the
pack when there is one above us, else top-level. Only its plain modules (no torch, no diffusers) are imported
here, for the wire, the supervisor and the light commands; the rest by `engine(name)` where it is used.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_ENGINE = ".".join([*__package__.split(".")[:-1], "parallel"])


def engine(module: str) -> ModuleType:
    """`parallel.<module>`, from the same place this package was imported from."""
    return importlib.import_module(f"{_ENGINE}.{module}")


fields = engine("fields")  # declared fields: every typed structure's checks, plain maps and flags
request = engine("request")  # the one request type: SampleRequest, LoraSpec, their flags and checks
config = engine("layout.config")  # the parallel layout: ParallelConfig, AutoLayout, LayoutError
launch = engine("cli.launch")  # torchrun's command line and the ranks' environment
rendezvous = engine("cli.rendezvous")  # where ranks meet: a store bound to one address, the interfaces they listen on
ArgumentParser = engine("cli.arguments").ArgumentParser
LayoutError, ParallelConfig, AutoLayout = config.LayoutError, config.ParallelConfig, config.AutoLayout


def tensor_inputs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every registered pipeline's tensor inputs, a single model call's): the families' own lists."""
    families = engine("families").FAMILIES
    return families.tensor_inputs(), families.model_call_tensors()
