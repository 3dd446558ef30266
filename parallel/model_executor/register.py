"""Registers that map a diffusers class to the wrapper that parallelises it.

Layers and schedulers, as in xDiT (pipelines and transformers are found through their family, see
parallel/families/base.py). A wrapper registers itself
with `@REGISTER.register(DiffusersClass, ...)`; `get_wrapper(obj)` finds the wrapper for an object's
exact class (then its bases), and raises a ValueError naming the class and what is supported.
"""

from __future__ import annotations

from typing import Any


class WrapperRegister:
    def __init__(self, kind: str):
        self.kind = kind
        self._wrappers: dict[type, type] = {}

    def register(self, *originals: type):
        def decorate(wrapper: type) -> type:
            for original in originals:
                self._wrappers[original] = wrapper
            return wrapper

        return decorate

    def get_wrapper(self, obj: Any) -> type:
        cls = obj if isinstance(obj, type) else type(obj)
        for candidate in cls.__mro__:
            if candidate in self._wrappers:
                return self._wrappers[candidate]
        raise ValueError(
            f"{cls.__name__} is not a supported {self.kind}; supported: {', '.join(self.supported_names())}"
        )

    def items(self) -> list[tuple[type, type]]:
        return list(self._wrappers.items())

    def supported_names(self) -> list[str]:
        return sorted(original.__name__ for original in self._wrappers)


xFuserLayerWrappersRegister = WrapperRegister("layer")
xFuserSchedulerWrappersRegister = WrapperRegister("scheduler")
