"""ComfyUI entry point of xDiT Pool (imported by ComfyUI under this folder's name).

Everything the pack needs is imported relative to this package (`.nodes`, `..parallel`, `..workers`), so
loading it adds no top-level `parallel` or `workers` module and leaves sys.path alone; the pool's rank
processes, which are our own, run with the pack folder on their path. Outside ComfyUI (pytest collects
this folder as a package) there is nothing to register.
"""

import importlib.util

WEB_DIRECTORY = "./web"
__all__ = ["WEB_DIRECTORY"]

if importlib.util.find_spec("comfy_api") is not None:
    from .nodes import comfy_entrypoint  # noqa: E402

    __all__.append("comfy_entrypoint")
