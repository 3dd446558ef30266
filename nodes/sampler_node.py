"""xDiT Sampler: KSampler's place in a workflow, sampling on an xDiT pool.

Takes native CONDITIONING and LATENT, uses ComfyUI's own noise for the seed, streams progress and
live previews, and turns ComfyUI's cancel into a cancel on the pool at the next step.
"""

from __future__ import annotations

import logging

import comfy.sample
import comfy.utils
from comfy_api.latest import io

from . import comfy_compat
from .adapters import adapter_for
from .pool_node import XDiTPoolType
from .pools import POOLS
from .progress import publish_step

SCHEDULERS = ["default", "dpmsolver", "unipc", "ddim", "euler", "flow-euler", "flow-dpmsolver", "flow-unipc"]


class XDiTSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTSampler",
            display_name="xDiT Sampler",
            category="sampling/xDiT",
            description="Samples on an xDiT pool in parallel; a drop-in for KSampler.",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="The xDiT Pool that samples."),
                io.Conditioning.Input("positive", tooltip="What to generate (xDiT Text Encode or the model's native encoders)."),
                io.Conditioning.Input("negative", tooltip="What to avoid (used when cfg > 1)."),
                io.Latent.Input("latent_image", tooltip="The latent to start from (Empty Latent Image for text-to-image)."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise seed; the noise is exactly KSampler's for this seed."),
                io.Int.Input("steps", default=20, min=1, max=1000, tooltip="Denoising steps."),
                io.Float.Input("cfg", default=4.5, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale (Flux: true CFG; its distilled guidance comes from FluxGuidance, default 3.5)."),
                io.Combo.Input("sampler", options=SCHEDULERS, default="default",
                               tooltip="The diffusers scheduler; default is the pipeline's own."),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="1.0: text-to-image; below 1: img2img from latent_image (the last steps of steps/denoise)."),
                io.Boolean.Input("preview", default=True, tooltip="Stream live previews from the pool."),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, pool, positive, negative, latent_image, seed, steps, cfg, sampler, denoise, preview) -> io.NodeOutput:
        adapter = adapter_for(pool.pipeline, pool.latent_scale)
        if denoise <= 0.0:
            return io.NodeOutput(latent_image)  # nothing to denoise, as KSampler
        video, audio = adapter.streams(latent_image["samples"])  # audio: an AV latent's second stream (LTX-2)
        samples = adapter.comfy_latent(video)  # images [B, C, H, W]; video (Wan) [B, C, T', H, W]
        batch = samples.shape[0]
        size = adapter.job_size(samples)
        height, width = size.pop("height"), size.pop("width")
        call = {**size, **adapter.conditioning_calls(positive)}  # the family's own call parameters (Wan: num_frames)
        noise = comfy.sample.prepare_noise(latent_image["samples"] if audio is not None else samples, seed,
                                           latent_image.get("batch_index"))
        noise, audio_noise = adapter.streams(noise)
        use_negative = cfg > 1.0
        tensors, conditioning_guidance = adapter.pipeline_inputs(positive, negative if use_negative else None, batch,
                                                                 pool.status.get("inputs", {}))
        tensors["latents"] = adapter.noise_to_model(adapter.comfy_latent(noise)).float()
        if audio_noise is not None:
            tensors[adapter.data.audio_stream[0]] = adapter.audio_to_model(audio_noise).float()
        params = {"steps": steps, "height": height, "width": width, "preview": preview, "scheduler": sampler,
                  "model_latents": True,
                  "loras": pool.lora_params()}
        if denoise < 1.0:  # img2img: start from the given latent, noised to the schedule's point
            tensors["init_latents"] = adapter.to_model(samples.float())
            params["denoise"] = denoise
        params["guidance_scale"], guidance_call = adapter.guidance_parameters(cfg, conditioning_guidance, use_negative)
        call.update(guidance_call)
        if call:
            params["call"] = call
        if pool.cache:  # from an xDiT Cache node
            params["cache"] = pool.cache

        latent_format = adapter.latent_format(samples.shape[1])
        previewer, preview_input = comfy_compat.previewer(latent_format) if preview else (None, None)
        progress = comfy.utils.ProgressBar(steps)
        interrupted = []

        def on_step(message):
            step = message.params["index"]
            image = None
            if previewer is not None and "preview" in message.tensors:
                x = adapter.preview_latents(message.tensors["preview"], height, width)
                image = previewer.decode_latent_to_preview_image("JPEG", preview_input(x))
            if comfy_compat.progress_interrupted(progress, step, steps, image):
                interrupted.append(step)
            publish_step(pool, step, steps)

        def should_cancel():
            return bool(interrupted) or comfy_compat.interrupt_requested()

        from ..workers.client import JobCancelledError

        try:
            client = POOLS.client(pool.endpoint)
            outputs = client.sample_outputs(tensors, params, on_step=on_step, should_cancel=should_cancel)
        except JobCancelledError:
            comfy_compat.raise_interrupted()
        if "cache" in client.last_result:
            logging.info("xDiT Sampler: %s", client.last_result["cache"]["text"])
        out = latent_image.copy()
        out["samples"] = adapter.to_comfy(outputs["latents"].float(), height, width)
        if audio is not None:
            out["samples"] = adapter.av_latent(out["samples"], outputs)
        return io.NodeOutput(out)
