"""xDiT VAE Decode: a LATENT decoded with the pool model's own VAE, its tiles spread over the pool's ranks.

The step that runs out of memory first on a long clip is the decode, on one device. Here each rank
decodes about one tile (diffusers' tiled decode, blended exactly as in one process; see
parallel/model_executor/vae_decode.py), so a rank holds about 1/world of the activations. The LATENT is in the VAE's own
space, as every ComfyUI LATENT is, except where ComfyUI's VAE normalises inside it (LTX-2, MiniMax-H3: its latent
format's process_in, as ComfyUI's samplers apply it, and the pool convert it); video comes back as its frames. A
video-with-sound latent (LTX-2's or MiniMax-H3's AV latent) also gives its sound, decoded by the pool's audio VAE and
vocoder, as ComfyUI's AUDIO (CreateVideo joins the two).
"""

from __future__ import annotations

import comfy.model_management
import comfy.utils
from comfy_api.latest import io

from . import comfy_compat
from .adapters import adapter_for
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
                io.Latent.Input("samples", tooltip="The latent to decode (images, a video's latent frames, or a video "
                                "with its sound)."),
                io.Int.Input("tile_size", default=0, min=0, max=4096, step=8,
                             tooltip="Tile side in latent pixels, an eighth of it overlapping (0: about 1/⌈√ranks⌉ of the "
                                     "longer side, at least one tile per rank)."),
            ],
            outputs=[io.Image.Output(), io.Audio.Output(tooltip="The sound of a video-with-sound latent (None for others).")],
        )

    @classmethod
    def execute(cls, pool, samples, tile_size) -> io.NodeOutput:
        adapter = adapter_for(pool.pipeline, pool.latent_scale)
        normalised = adapter.data.vae_normalises
        tensors = _loop_latents(adapter, samples["samples"]) if normalised else _vae_latents(samples["samples"])
        comfy.model_management.throw_exception_if_processing_interrupted()
        progress = comfy.utils.ProgressBar(1)

        def on_step(message):
            progress.update_absolute(message.params["index"], message.params["total"])

        reply = POOLS.client(pool.endpoint).decode_streams(tensors, tile_size, model_latents=normalised, on_step=on_step)
        images = (reply.tensors["images"].float() / 2 + 0.5).clamp(0, 1)
        if images.ndim == 5:  # video [B, 3, T, H, W] → frames
            images = images.movedim(2, 1).flatten(0, 1)
        audio = None
        if "audio" in reply.tensors:
            audio = {"waveform": reply.tensors["audio"].float().contiguous(), "sample_rate": reply.params["sample_rate"]}
        return io.NodeOutput(images.movedim(1, -1).contiguous(), audio)


def _vae_latents(samples) -> dict:
    """A LATENT in the VAE's own space, sent as it is: its streams by the names a decode job takes."""
    streams = comfy_compat.latent_streams(samples)
    return {"latents": streams[0].float(), **({"audio": streams[1].float()} if len(streams) > 1 else {})}


def _loop_latents(adapter, samples) -> dict:
    """A LATENT in the sampling loop's space (ComfyUI's VAE normalises inside it: LTX-2, MiniMax-H3) as the pool's
    decode takes it: ComfyUI's samplers' own step into the model's space (the latent format's process_in, on every
    stream of an AV latent), the audio in the pipeline's axes (MiniMax-H3: ComfyUI's [B, 32, 2, L] → [B, 2, 32, L])."""
    video = comfy_compat.latent_streams(samples)[0]
    streams = comfy_compat.latent_streams(adapter.latent_format(video.shape[1]).process_in(samples))
    tensors = {"latents": streams[0].float()}
    if len(streams) > 1:
        tensors["audio"] = adapter.audio_to_model(streams[1].float()).contiguous()
    return tensors
