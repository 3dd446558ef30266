"""xDiT LoRA: add a LoRA (from models/loras) at a strength to the pool's next jobs.

Chain several to stack them; bypass one to remove it. The pool keeps each file loaded once and
switches adapters per job, so changing LoRAs never reloads the base model. On a pool with two experts
(Wan 2.2 A14B) a LoRA goes into both, as when ComfyUI users load it onto both models, or into the one
chosen (`transformer`: the high-noise expert, `transformer_2`: the low-noise expert). On a MiniMax-H3 pool that holds
the reference-to-video partition, `transformer_ref` takes the LoRA instead of `transformer` (diffusers'
`load_into_transformer_ref=True`); a pool without the target refuses the job in one line naming its transformers.
"""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from .pool_node import XDiTPoolType

EXPERTS_ALL = "all experts"
EXPERTS = {EXPERTS_ALL: "", "transformer (high noise)": "transformer", "transformer_2 (low noise)": "transformer_2",
           "transformer_ref (MiniMax-H3 references)": "transformer_ref"}


class XDiTLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTLoRA",
            display_name="xDiT LoRA",
            category="sampling/xDiT",
            description="Applies a LoRA on every rank of the pool (SD3, Flux and Wan; diffusers, Kohya, BFL and ComfyUI formats).",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="The xDiT Pool (or another xDiT LoRA) to add this LoRA to."),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras"), tooltip="A file in models/loras."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01, tooltip="How strongly the LoRA applies."),
                io.Combo.Input("expert", options=list(EXPERTS), default=EXPERTS_ALL, optional=True,
                               tooltip="Models with two experts (Wan 2.2 A14B): apply to both, or only to the "
                                       "high-noise expert (transformer) or the low-noise expert (transformer_2). "
                                       "MiniMax-H3 with references: transformer_ref, the partition they run on."),
            ],
            outputs=[XDiTPoolType.Output(display_name="pool")],
        )

    @classmethod
    def execute(cls, pool, lora_name, strength, expert=EXPERTS_ALL) -> io.NodeOutput:
        if strength == 0:
            return io.NodeOutput(pool)
        path = folder_paths.get_full_path_or_raise("loras", lora_name)
        return io.NodeOutput(pool.with_lora(path, strength, EXPERTS[expert]))
