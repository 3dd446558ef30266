"""xDiT Empty Latent: the empty LATENT an image model on the pool starts text-to-image from, for the models this
ComfyUI has no empty-latent node for (FLUX.2 on ComfyUI 0.3.64); it takes any image family's pool alike.

Its channels and scale are the pool model's ComfyUI latent format's (the family's `ComfyData`), as ComfyUI's own
empty-latent nodes make them: zeros, [batch, channels, height / scale, width / scale].
"""

from __future__ import annotations

import comfy.model_management
import torch
from comfy_api.latest import io

from .adapters import ConditioningError, adapter_for
from .pool_node import XDiTPoolType


class XDiTEmptyLatent(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTEmptyLatent",
            display_name="xDiT Empty Latent",
            category="sampling/xDiT",
            description="An empty latent of the size and latent format the pool's image model samples.",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="The xDiT Pool whose model will sample the latent."),
                io.Int.Input("width", default=1024, min=16, max=16384, step=16, tooltip="Image width in pixels."),
                io.Int.Input("height", default=1024, min=16, max=16384, step=16, tooltip="Image height in pixels."),
                io.Int.Input("batch_size", default=1, min=1, max=4096, tooltip="Images per batch."),
            ],
            outputs=[io.Latent.Output()],
        )

    @classmethod
    def execute(cls, pool, width, height, batch_size) -> io.NodeOutput:
        adapter = adapter_for(pool.pipeline)
        formats = adapter.data.latent_formats
        if adapter.data.temporal or len(formats) != 1:
            raise ConditioningError(f"xDiT Empty Latent makes image latents of one format; for {adapter.name} use "
                                    f"{adapter.data.empty_latent}")
        (channels,) = formats
        scale = adapter.data.scale(channels)
        samples = torch.zeros([batch_size, channels, height // scale, width // scale],
                              device=comfy.model_management.intermediate_device())
        return io.NodeOutput({"samples": samples})
