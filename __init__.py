"""ComfyUI entry point of xDiT Pool (imported by ComfyUI under this folder's name).

The engine packages `parallel` and `workers` are top-level packages in the pool's ranks, so the
pack's folder is appended to sys.path for them here (appended: ComfyUI's own `nodes` module keeps
precedence; our node code is imported only relatively, as this package's `.nodes`).
Outside ComfyUI (pytest collects this folder as a package) there is nothing to register.
"""

import importlib.util
import os
import sys

_PACK = os.path.dirname(os.path.abspath(__file__))
if _PACK not in sys.path:
    sys.path.append(_PACK)

WEB_DIRECTORY = "./web"
__all__ = ["WEB_DIRECTORY"]

if importlib.util.find_spec("comfy_api") is not None:
    from .nodes import comfy_entrypoint  # noqa: E402

    __all__.append("comfy_entrypoint")
