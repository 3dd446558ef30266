"""Model families: one module each declares everything the engine and the nodes need to know about it
(see docs/adding-a-family.md). Importing this package imports every module in it, which registers
the families; it imports no diffusers.
"""

import importlib
import pkgutil

from .base import FAMILIES, Family, FamilyRegistry, SingleFile, TinyModel, Variant, VaeFile
from .comfy_data import ComfyData, DeclaredLatentFormat

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["FAMILIES", "ComfyData", "DeclaredLatentFormat", "Family", "FamilyRegistry", "SingleFile", "TinyModel", "Variant", "VaeFile"]
