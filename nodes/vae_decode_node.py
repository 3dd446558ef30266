"""xDiT VAE Decode: a LATENT decoded with the pool model's own VAE, its tiles spread over the pool's ranks.

The step that runs out of memory first on a long clip is the decode, on one device. Here each rank
decodes about one tile (diffusers' tiled decode, blended exactly as in one process; see
parallel/model_executor/vae_decode.py), so a rank holds about 1/world of the activations. The LATENT is in the VAE's own
space, as every ComfyUI LATENT is; video comes back as its frames.
"""

from __future__ import annotations

import comfy.model_management
import comfy.utils
from comfy_api.latest import io

from .pool_node import XDiTPoolType
from .pools import POOLS


class XDiTVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTVAEDecode",
            display_name="xDiT VAE Decode",
            category="sampling/xDiT",
            description="Decodes a LATENT with the pool model's VAE, its tiles decoded in parallel on the pool's ranks.",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="The xDiT Pool whose model made the latent (its VAE decodes it)."),
                io.Latent.Input("samples", tooltip="The latent to decode (images, or a video's latent frames)."),
                io.Int.Input("tile_size", default=0, min=0, max=4096, step=8,
                             tooltip="Tile side in latent pixels, an eighth of it overlapping (0: about 1/⌈√ranks⌉ of the "
                                     "longer side, at least one tile per rank)."),
            ],
            outputs=[io.Image.Output()],
        )

    @classmethod
    def execute(cls, pool, samples, tile_size) -> io.NodeOutput:
        latents = samples["samples"].float()
        comfy.model_management.throw_exception_if_processing_interrupted()
        progress = comfy.utils.ProgressBar(1)

        def on_step(message):
            progress.update_absolute(message.params["index"], message.params["total"])

        decoded, _ = POOLS.client(pool.endpoint).decode(latents, tile_size, on_step=on_step)
        images = (decoded.float() / 2 + 0.5).clamp(0, 1)
        if images.ndim == 5:  # video [B, 3, T, H, W] → frames
            images = images.movedim(2, 1).flatten(0, 1)
        return io.NodeOutput(images.movedim(1, -1).contiguous())
