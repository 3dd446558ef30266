"""xDiT Model: the pool as a ComfyUI MODEL, so KSampler, SamplerCustomAdvanced and every guider sample on it.

ComfyUI's own sampling loop runs in ComfyUI; each model evaluation is one call to the pool, answered by
one parallel evaluation of the transformer (parallel/model_executor/model_call.py). The MODEL is ComfyUI's
own model class for the family (ComfyData.model_class in comfy.supported_models: its model sampling,
latent format and conditioning), holding PoolTransformer where its diffusion model would be, so samplers,
schedulers, ModelSamplingSD3 / ModelSamplingFlux and guiders see a normal model. ComfyUI batches cond and
uncond into one call where memory allows; the pool splits that batch over its cfg and dp ranks.

What the pool cannot honour is refused with one error: a ControlNet, an attention replacement or patch,
a weight patch (LoraLoader: use xDiT LoRA before xDiT Model), a conditioning the model call does not take.
"""

from __future__ import annotations

import torch
import comfy.model_patcher
import comfy.supported_models
from comfy_api.latest import io

from . import comfy_compat
from .adapters import ConditioningError, adapter_for
from .pool_node import XDiTPoolType
from .pools import POOLS

CPU = torch.device("cpu")  # the pool holds the weights; ComfyUI keeps only the sampler's latents


class UnsupportedPatch(ValueError):
    """A model patch the pool cannot apply (its transformer runs on the pool, not in ComfyUI)."""


class PoolTransformer(torch.nn.Module):
    """Stands where ComfyUI's diffusion model would: each call is one model call on the pool."""

    def __init__(self, pool, conds: dict[str, str]):
        super().__init__()
        self.pool, self.conds = pool, conds
        self.dtype = torch.float32  # ComfyUI casts the call's tensors to this; the pool casts to its own

    def forward(self, x, timesteps, context=None, control=None, transformer_options=None, **kwargs):
        options = transformer_options or {}
        _refuse_patches(control, options)
        unknown = sorted(name for name, value in kwargs.items() if value is not None and name not in self.conds)
        if unknown:
            raise UnsupportedPatch(f"xDiT Model: the conditioning carries {unknown}, which this pool's "
                                   f"{self.pool.pipeline} does not take in a model call; remove the node that adds it")
        sigma = options.get("sigmas")
        if sigma is None:
            raise UnsupportedPatch("xDiT Model is called by ComfyUI's samplers, which pass the noise level (sigmas); "
                                   "this caller passed none")
        one_frame = x.ndim == 5 and x.shape[2] == 1  # an image model in a video latent format (Qwen-Image: [B, C, 1, H, W])
        if one_frame:
            x = x[:, :, 0]
        batch = x.shape[0]
        conditioning = {self.conds[name]: value.float() for name, value in {"context": context, **kwargs}.items()
                        if value is not None and name in self.conds}
        if "guidance" in conditioning:
            conditioning["guidance"] = conditioning["guidance"].reshape(-1).expand(batch).contiguous()
        tensors = {"latents": x.float().contiguous(), "sigma": sigma.float().reshape(-1).expand(batch).contiguous()}
        loras = [{"path": path, "strength": strength, **({"expert": expert} if expert else {})}
                 for path, strength, expert in self.pool.loras]

        from ..workers.client import JobCancelledError

        try:
            prediction = POOLS.client(self.pool.endpoint).evaluate(
                tensors, conditioning, loras, should_cancel=comfy_compat.interrupt_requested)
        except JobCancelledError:
            comfy_compat.raise_interrupted()
        return prediction[:, :, None] if one_frame else prediction


def _refuse_patches(control, options: dict) -> None:
    if control is not None:
        raise UnsupportedPatch("xDiT Model cannot apply a ControlNet: the transformer runs on the pool; "
                               "sample without the ControlNet (Apply ControlNet) or with ComfyUI's own model")
    replaced = [f"{name} {' '.join(map(str, key)) if isinstance(key, tuple) else key}"
                for name, table in options.get("patches_replace", {}).items() for key in table]
    patched = [name for name, table in options.get("patches", {}).items() if table]
    for what, found in (("block or attention replacement", replaced), ("model patch", patched)):
        if found:
            raise UnsupportedPatch(f"xDiT Model cannot apply a ComfyUI {what} ({', '.join(sorted(found))}): the "
                                   "transformer runs on the pool; remove the node that adds it")


class PoolModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher without weights in ComfyUI: weight patches (LoraLoader, merges) are refused at once."""

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        raise UnsupportedPatch("xDiT Model holds no weights in ComfyUI, so ComfyUI's LoRA loaders and model merges "
                               "cannot patch it; load LoRAs with xDiT LoRA between xDiT Pool and xDiT Model")


def comfy_model(pool) -> PoolModelPatcher:
    """ComfyUI's model for the pool's family, its diffusion model replaced by PoolTransformer."""
    adapter = adapter_for(pool.pipeline, pool.latent_scale)
    name = pool.status.get("model_class") or adapter.data.model_class
    if not name or not adapter.data.model_call_conds:
        raise ConditioningError(f"xDiT Model does not run {pool.pipeline} yet (it runs SD3, Flux.1 and Qwen-Image "
                                "pools); "
                                "sample it with xDiT Sampler")
    channels = next(iter(adapter.data.latent_formats))
    config_class = getattr(comfy.supported_models, name)
    unet_config = {**config_class.unet_config, "in_channels": channels, "out_channels": channels,
                   "disable_unet_model_creation": True}
    model_config = config_class(unet_config)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=CPU)
    model.diffusion_model = PoolTransformer(pool, adapter.data.model_call_conds)
    return PoolModelPatcher(model, load_device=CPU, offload_device=CPU)


class XDiTModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTModel",
            display_name="xDiT Model",
            category="sampling/xDiT",
            description="The pool as a MODEL for KSampler, SamplerCustomAdvanced and guiders: ComfyUI's samplers "
                        "step here, each model call runs in parallel on the pool (SD3, Flux.1, Qwen-Image).",
            inputs=[XDiTPoolType.Input("pool", tooltip="The xDiT Pool (or xDiT LoRA) that evaluates the model.")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, pool) -> io.NodeOutput:
        return io.NodeOutput(comfy_model(pool))
