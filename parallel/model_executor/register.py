"""Registers that map a diffusers class to the wrapper that parallelises it.

Layers and schedulers, as in xDiT (pipelines and transformers are found through their family, see
parallel/families/base.py). A wrapper registers itself
with `@REGISTER.register(DiffusersClass, ...)`; `get_wrapper(obj)` finds the wrapper for an object's
exact class (then its bases), and raises a ValueError naming the class and what is supported.
Wrappers can also be declared by class name (`declare`): the families name their attention classes
without importing diffusers, and the wrapper for such a class is built when a module of it is met.
"""

from __future__ import annotations

from typing import Any, Callable


class WrapperRegister:
    def __init__(self, kind: str):
        self.kind = kind
        self._wrappers: dict[type, type] = {}
        self._declared: list[tuple[Callable[[], dict[str, Any]], Callable[[str, Any], type]]] = []

    def register(self, *originals: type):
        def decorate(wrapper: type) -> type:
            for original in originals:
                self._wrappers[original] = wrapper
            return wrapper

        return decorate

    def declare(self, names: Callable[[], dict[str, Any]], build: Callable[[str, Any], type]) -> None:
        """Classes found by name: `names()` → class name → what `build(name, value)` makes its wrapper from."""
        self._declared.append((names, build))

    def get_wrapper(self, obj: Any) -> type:
        """The wrapper for `obj`'s class; for a layer of a shared class (diffusers' `Attention`) whose processor
        class is declared, the one built for that processor (its processor decides what the layer calls)."""
        cls = obj if isinstance(obj, type) else type(obj)
        processor = getattr(obj, "processor", None) if not isinstance(obj, type) else None
        for names, build in self._declared if processor is not None else ():
            declared = names()
            if type(processor).__name__ in declared:
                return build(type(processor).__name__, declared[type(processor).__name__])
        for candidate in cls.__mro__:
            if candidate in self._wrappers:
                return self._wrappers[candidate]
            for names, build in self._declared:
                declared = names()
                if candidate.__name__ in declared:
                    return build(candidate.__name__, declared[candidate.__name__])
        raise ValueError(
            f"{cls.__name__} is not a supported {self.kind}; supported: {', '.join(self.supported_names())}"
        )

    def items(self) -> list[tuple[type, type]]:
        return list(self._wrappers.items())

    def supported_names(self) -> list[str]:
        return sorted({original.__name__ for original in self._wrappers}.union(*(names() for names, _ in self._declared)))


xFuserLayerWrappersRegister = WrapperRegister("layer")
xFuserSchedulerWrappersRegister = WrapperRegister("scheduler")
