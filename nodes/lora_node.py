"""xDiT LoRA: add a LoRA (from models/loras) at a strength to the pool's next jobs.

Chain several to stack them; bypass one to remove it. The pool keeps each file loaded once and
switches adapters per job, so changing LoRAs never reloads the base model.
"""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from .pool_node import XDiTPoolType


class XDiTLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTLoRA",
            display_name="xDiT LoRA",
            category="sampling/xDiT",
            description="Applies a LoRA on every rank of the pool (SD3 and Flux; diffusers, Kohya and BFL formats).",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="The xDiT Pool (or another xDiT LoRA) to add this LoRA to."),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras"), tooltip="A file in models/loras."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01, tooltip="How strongly the LoRA applies."),
            ],
            outputs=[XDiTPoolType.Output(display_name="pool")],
        )

    @classmethod
    def execute(cls, pool, lora_name, strength) -> io.NodeOutput:
        if strength == 0:
            return io.NodeOutput(pool)
        return io.NodeOutput(pool.with_lora(folder_paths.get_full_path_or_raise("loras", lora_name), strength))
