"""ComfyUI side of xDiT Pool: nodes (V3 API), REST routes and events for the web panel."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import routes  # noqa: F401 - registers the /xdit routes on ComfyUI's server
from .cache_node import XDiTCache
from .empty_latent_node import XDiTEmptyLatent
from .loader_node import XDiTLoadDiffusionModel
from .lora_node import XDiTLoRA
from .model_cache_node import XDiTModelCache
from .model_node import XDiTModel
from .pool_node import XDiTPool
from .sampler_node import XDiTSampler
from .text_encode_node import XDiTTextEncode
from .vae_decode_node import XDiTVAEDecode


class XDiTExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [XDiTPool, XDiTTextEncode, XDiTSampler, XDiTLoRA, XDiTCache, XDiTVAEDecode, XDiTModel,
                XDiTEmptyLatent, XDiTLoadDiffusionModel, XDiTModelCache]


async def comfy_entrypoint() -> XDiTExtension:
    return XDiTExtension()
