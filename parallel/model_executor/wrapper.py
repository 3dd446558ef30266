"""The base of every wrapper: delegate what we don't change to the wrapped diffusers object.

After xDiT's `xFuserBaseWrapper`: a wrapper keeps the original in `self.module` and `__getattr__`
forwards every attribute it doesn't define, so diffusers code keeps working on the wrapper.
"""

from __future__ import annotations

import functools
from typing import Any

from ..distributed import model_parallel_is_initialized


class xFuserBaseWrapper:
    def __init__(self, module: Any):
        self.module = module

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails; `module` itself must exist to avoid recursion.
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)

    @staticmethod
    def check_parallel_state(fn):
        """Runtime check: a wrapped call outside an initialised parallel state is a usage error."""

        @functools.wraps(fn)
        def checked(self, *args, **kwargs):
            if not model_parallel_is_initialized():
                raise RuntimeError(
                    f"{type(self).__name__} was called before the parallel state was set up; "
                    "call parallel.distributed.initialize_model_parallel(config) on every rank first"
                )
            return fn(self, *args, **kwargs)

        return checked
