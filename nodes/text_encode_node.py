"""xDiT Text Encode: the pool pipeline's own text encoders → a native CONDITIONING."""

from __future__ import annotations

from comfy_api.latest import io

from .adapters import XDIT_TEXT, adapter_for
from .pool_node import XDiTPoolType
from .pools import POOLS


class XDiTTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTTextEncode",
            display_name="xDiT Text Encode",
            category="sampling/xDiT",
            description="Encodes text with the pool model's own encoders (as its diffusers pipeline does); for an edit "
                        "model whose text encoder sees images (Qwen-Image-Edit), with its reference image(s).",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="An xDiT Pool started with text encoders."),
                io.String.Input("text", multiline=True, dynamic_prompts=True, tooltip="The prompt."),
                io.Image.Input("image", optional=True,
                               tooltip="Qwen-Image-Edit: the reference image, encoded with the prompt and by the pool's "
                                       "VAE into the conditioning's reference latents (as TextEncodeQwenImageEdit with "
                                       "its vae and image); Edit Plus: a batch of references of one size; Qwen-Image "
                                       "2.1: its condition pictures, which the conditioning carries to the sampler."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, pool, text, image=None) -> io.NodeOutput:
        client = POOLS.client(pool.endpoint)
        encoded = client.encode(text) if image is None else client.encode(text, image=image.movedim(-1, 1))
        extras, adapter = {}, adapter_for(pool.pipeline, pool.latent_scale)
        if "image" in encoded and adapter.data.reference_latents:  # the references' latents, model space:
            extras["reference_latents"] = adapter.comfy_references(encoded.pop("image"))  # ReferenceLatent's way
        if "pooled_prompt_embeds" in encoded:
            extras["pooled_output"] = encoded["pooled_prompt_embeds"]
        if "prompt_attention_mask" in encoded:
            extras["attention_mask"] = encoded["prompt_attention_mask"]
        # the family's other inputs: HunyuanVideo 1.5's masks and glyph text, Qwen-Image 2.1's pictures and their slots
        for name, tensor in encoded.items():
            if name not in ("prompt_embeds", "pooled_prompt_embeds", "prompt_attention_mask"):
                extras[f"{XDIT_TEXT}{name}"] = tensor
        return io.NodeOutput([[encoded["prompt_embeds"], extras]])
