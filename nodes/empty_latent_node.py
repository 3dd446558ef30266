"""xDiT Empty Latent: the empty LATENT a model on the pool starts from, for the models this ComfyUI has no
empty-latent node for (FLUX.2 and HunyuanVideo 1.5 on ComfyUI 0.3.64); it takes any family's pool whose model has
one latent format.

Its channels and scale are the pool model's ComfyUI latent format's (the family's `ComfyData`), as ComfyUI's own
empty-latent nodes make them: zeros, [batch, channels, height / scale, width / scale], with the latent frames of
`length` video frames before height for video models ((length − 1) / 4 + 1).
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
            description="An empty latent of the size and latent format the pool's model samples.",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="The xDiT Pool whose model will sample the latent."),
                io.Int.Input("width", default=1024, min=16, max=16384, step=16, tooltip="Image width in pixels."),
                io.Int.Input("height", default=1024, min=16, max=16384, step=16, tooltip="Image height in pixels."),
                io.Int.Input("batch_size", default=1, min=1, max=4096, tooltip="Images (or videos) per batch."),
                io.Int.Input("length", default=1, min=1, max=10_000, step=4, optional=True,
                             tooltip="Video frames, 4k+1 (video models only; images ignore it)."),
            ],
            outputs=[io.Latent.Output()],
        )

    @classmethod
    def execute(cls, pool, width, height, batch_size, length=1) -> io.NodeOutput:
        adapter = adapter_for(pool.pipeline, pool.latent_scale)
        formats = adapter.data.latent_formats
        if len(formats) != 1:
            raise ConditioningError(f"xDiT Empty Latent makes latents of a model with one latent format; for "
                                    f"{adapter.name} use {adapter.data.empty_latent}")
        (channels,) = formats
        scale, temporal = adapter.latent_scale, adapter.data.temporal
        frames = [(length - 1) // temporal + 1] if temporal else []
        samples = torch.zeros([batch_size, channels, *frames, height // scale, width // scale],
                              device=comfy.model_management.intermediate_device())
        return io.NodeOutput({"samples": samples})
