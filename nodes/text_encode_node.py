"""xDiT Text Encode: the pool pipeline's own text encoders → a native CONDITIONING."""

from __future__ import annotations

from comfy_api.latest import io

from .adapters import XDIT_TEXT
from .pool_node import XDiTPoolType
from .pools import POOLS


class XDiTTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTTextEncode",
            display_name="xDiT Text Encode",
            category="sampling/xDiT",
            description="Encodes text with the pool model's own encoders (as its diffusers pipeline does).",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="An xDiT Pool started with text encoders."),
                io.String.Input("text", multiline=True, dynamic_prompts=True, tooltip="The prompt."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, pool, text) -> io.NodeOutput:
        encoded = POOLS.client(pool.endpoint).encode(text)
        extras = {}
        if "pooled_prompt_embeds" in encoded:
            extras["pooled_output"] = encoded["pooled_prompt_embeds"]
        if "prompt_attention_mask" in encoded:
            extras["attention_mask"] = encoded["prompt_attention_mask"]
        for name, tensor in encoded.items():  # the family's other text inputs (HunyuanVideo 1.5's masks and glyph text)
            if name not in ("prompt_embeds", "pooled_prompt_embeds", "prompt_attention_mask"):
                extras[f"{XDIT_TEXT}{name}"] = tensor
        return io.NodeOutput([[encoded["prompt_embeds"], extras]])
