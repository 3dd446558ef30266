"""Model families: one module each declares everything the engine and the nodes need to know about it
(see docs/adding-a-family.md). Importing this package registers them all, and imports no diffusers.
"""

from . import flux, pixart, sd3, wan
from .base import FAMILIES, ComfyData, Family, FamilyRegistry, SingleFile, TinyModel, Variant

__all__ = ["FAMILIES", "ComfyData", "Family", "FamilyRegistry", "SingleFile", "TinyModel", "Variant", "flux", "pixart",
           "sd3", "wan"]
