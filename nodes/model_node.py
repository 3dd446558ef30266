"""xDiT Model: the pool as a ComfyUI MODEL, so KSampler, SamplerCustomAdvanced and every guider sample on it.

ComfyUI's own sampling loop runs in ComfyUI; each model evaluation is one call to the pool, answered by
one parallel evaluation of the transformer (parallel/model_executor/model_call.py). The MODEL is ComfyUI's
own model class for the family (ComfyData.model_class in comfy.supported_models: its model sampling,
latent format and conditioning), holding PoolTransformer where its diffusion model would be, so samplers,
schedulers, ModelSamplingSD3 / ModelSamplingFlux and guiders see a normal model. ComfyUI batches cond and
uncond into one call where memory allows; the pool splits that batch over its cfg and dp ranks.

ComfyUI's LoRA loaders (LoraLoaderModelOnly, LoraLoader) work on it: their patches become a LoRA the pool applies
(lora_patches.py). What the pool cannot honour is refused with one error by the node that adds it: a model merge
or a non-LoRA weight patch, a block or attention replacement or patch; at sampling, a ControlNet or a
conditioning the model call does not take.
"""

from __future__ import annotations

import torch
import comfy.model_patcher
import comfy.patcher_extension
import comfy.supported_models
from comfy_api.latest import io

from . import comfy_compat
from .adapters import ConditioningError, adapter_for
from .av_calls import AudioCall
from .lora_patches import UnsupportedPatch, lora_file, peft_lora
from .meta_weights import lookup
from .pool_node import XDiTPoolType
from .pools import POOLS

CPU = torch.device("cpu")  # the pool holds the weights; ComfyUI keeps only the sampler's latents
REFERENCE_KEYS = ("ref_latents", "ref_latents_method")  # ReferenceLatent's images and how they are placed: _references
LORAS = "xdit_loras"  # transformer_options: the LoRA files ComfyUI's LoRA loaders added, with their strengths
CACHE = "xdit_cache"  # transformer_options: the pool's step cache on these calls (model_cache_node.SamplingCache)


class PoolTransformer(torch.nn.Module):
    """Stands where ComfyUI's diffusion model would: each call is one model call on the pool. It holds no weights
    but reports the names of the weights ComfyUI's own model has (`weights`, from the file), so ComfyUI's LoRA
    loaders find what to patch; `expert`: the pool's transformer it calls (Wan 2.2's low-noise `transformer_2`);
    `methods`: the reference methods its model calls take (ComfyData.reference_methods); `timestep`: the call carries
    ComfyUI's timestep (ComfyData.model_call_timestep); `av`: the family's ComfyData where its calls take ComfyUI's
    [video, audio] streams (av_calls.py); `versions`: ComfyData.model_call_versions, sent with each call."""

    def __init__(self, pool, conds: dict[str, str], weights: dict[str, torch.Size] | None = None, expert: str = "",
                 config: dict | None = None, methods: tuple[str, ...] = (), timestep: bool = False, av=None,
                 versions: dict[str, str] | None = None):
        super().__init__()
        self.pool, self.conds, self.weights, self.expert, self.methods = pool, conds, weights or {}, expert, methods
        self.timestep, self.av, self.versions = timestep, av, versions or {}
        self.config = config or {}  # ComfyUI's unet_config of the file: patch_size, in_channels, ...
        self.dtype = torch.float32  # ComfyUI casts the call's tensors to this; the pool casts to its own

    def __getattr__(self, name: str):
        """What ComfyUI's model class reads off its diffusion model: a config value, or a weight's shape
        (meta_weights.py)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            state = self.__dict__
            if name in state.get("config", {}):
                return state["config"][name]
            return lookup(state.get("weights", {}), name)

    def preprocess_text_embeds(self, text: torch.Tensor, unprocessed: bool | None = None) -> torch.Tensor:
        """ComfyUI's model refines the text once per sampling here (MiniMax-H3's token refiner, LTX-2's connectors);
        the pool refines it in each call, so the text goes as the encoder gave it. LTX-2's text that a compat-mode
        encoder already ran through connectors (`unprocessed` False) would go through the pool's again: refused."""
        if unprocessed is False:
            raise UnsupportedPatch("xDiT Model: this LTX-2 text already went through text connectors (a text encoder "
                                   "in compat mode); the pool runs its own: encode with LTX-2.3's text encoder "
                                   "(LTXAVTextEncoderLoader), whose text is unprocessed")
        return text

    @property
    def patchifier(self):
        """ComfyUI's LTXAV patchifies a noise mask × timestep into per-token timesteps (its process_timestep) with its
        model's patchifiers: the same ones here, so the call gets them in its model's token order."""
        from comfy.ldm.lightricks.symmetric_patchifier import SymmetricPatchifier

        return SymmetricPatchifier(1, start_end=True)

    @property
    def a_patchifier(self):
        from comfy.ldm.lightricks.symmetric_patchifier import AudioPatchifier

        return AudioPatchifier(1, start_end=True)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, shape in self.weights.items():
            destination[prefix + name] = torch.empty(shape, device="meta")

    def forward(self, x, timesteps, context=None, control=None, transformer_options=None, **kwargs):
        """As ComfyUI's own diffusion models: the call runs inside the model's DIFFUSION_MODEL wrappers, so those that
        work on its input and output (EasyCache, which reuses an earlier output instead of calling) work here too."""
        options = transformer_options or {}
        wrappers = comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, options)
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(self._evaluate, self, wrappers).execute(
            x, timesteps, context, control, options, **kwargs)

    def _evaluate(self, x, timesteps, context, control, options, **kwargs):
        _refuse_patches(control, options)
        kwargs.pop("denoise_mask", None)  # Wan 2.2's, LTXAV's: ComfyUI's model already turned it into timesteps
        kwargs.pop("audio_denoise_mask", None)
        kwargs = {f"{name}.{key}" if isinstance(value, dict) else name: entry for name, value in kwargs.items()
                  for key, entry in (value.items() if isinstance(value, dict) else [(None, value)])}
        unknown = sorted(name for name, value in kwargs.items() if value is not None and name not in self.conds)
        if unknown:
            raise UnsupportedPatch(f"xDiT Model: the conditioning carries {unknown}, which this pool's "
                                   f"{self.pool.pipeline} does not take in a model call; remove the node that adds it")
        sigma = options.get("sigmas")
        if sigma is None:
            raise UnsupportedPatch("xDiT Model is called by ComfyUI's samplers, which pass the noise level (sigmas); "
                                   "this caller passed none")
        av = AudioCall(self.av, x, sigma, options, kwargs.get(self.av.audio_scale), timesteps) if self.av else None
        x = x[0] if av else x
        one_frame = x.ndim == 5 and x.shape[2] == 1  # an image model in a video latent format (Qwen-Image: [B, C, 1, H, W])
        if one_frame:
            x = x[:, :, 0]
        batch = x.shape[0]
        conditioning = {self.conds[name]: torch.as_tensor(value).float().reshape(value.shape if torch.is_tensor(value)
                                                                                   else (1,))
                        for name, value in {"context": context, **kwargs}.items()
                        if value is not None and self.conds.get(name) and name not in REFERENCE_KEYS}  # "": not used
        if kwargs.get("ref_latents") is not None and "ref_latents" in self.conds:
            conditioning.update(_references(kwargs["ref_latents"]))
            if "ref_latents_method" in self.conds:
                conditioning[self.conds["ref_latents_method"]] = self._method(kwargs.get("ref_latents_method"), batch)
        if "guidance" in conditioning:
            conditioning["guidance"] = conditioning["guidance"].reshape(-1).expand(batch).contiguous()
        sigma = sigma.float().reshape(-1).expand(batch)
        if not av and timesteps.ndim == 2:  # one per latent frame (Wan 2.2 TI2V: its start frame's 0), ComfyUI's mask × timestep
            top = timesteps.float().amax(dim=1, keepdim=True)
            sigma = sigma[:, None] * torch.where(top > 0, timesteps.float() / top.clamp_min(1e-12), 1.0)
        tensors = {"latents": x.float().contiguous(), "sigma": sigma.contiguous()}
        if self.timestep:  # a discrete-schedule model's own step (PixArt), which sigma does not give
            tensors["timestep"] = timesteps.float().reshape(-1).expand(batch).contiguous()
        if av:
            tensors, conditioning = av.inputs(), {**av.batched(conditioning), **av.keyframes(kwargs)}
        conditioning.update(comfy_compat.model_call_versions(self.versions, batch))
        loras = self.pool.lora_params() + [{"path": path, "strength": strength} for path, strength in options.get(LORAS, ())]

        from ..workers.client import JobCancelledError

        try:
            outputs = POOLS.client(self.pool.endpoint).evaluate(
                tensors, conditioning, loras, should_cancel=comfy_compat.interrupt_requested, expert=self.expert,
                cache=options[CACHE].next_call(self.expert) if CACHE in options else None)
        except JobCancelledError:
            comfy_compat.raise_interrupted()
        if av:
            return av.answer(outputs)
        prediction = outputs["prediction"]
        return prediction[:, :, None] if one_frame else prediction

    def _method(self, method: str | None, batch: int) -> torch.Tensor:
        """ComfyUI's reference method (the conditioning's, else the file's default) as its index in `methods`."""
        method = method or self.config.get("default_ref_method") or self.methods[0]
        if method not in self.methods:
            raise UnsupportedPatch(f"xDiT Model: the reference method {method!r} (FluxKontextMultiReferenceLatentMethod) "
                                   f"is not one this pool's {self.pool.pipeline} takes in a model call: use one of "
                                   f"{list(self.methods)}")
        return torch.full((batch,), float(self.methods.index(method)))


def _references(value: list) -> dict[str, torch.Tensor]:
    """ReferenceLatent's images ([B, C, h, w] each, any sizes) as the pool takes them: `reference_latents`, their
    pixels flattened and joined, [B, C, Σ h·w], and `reference_sizes`, each image's (h, w), [B, N, 2]."""
    images = [image[:, :, 0] if image.ndim == 5 else image for image in value]  # [B, C, 1, h, w]: Qwen-Image's
    sizes = torch.tensor([list(image.shape[-2:]) for image in images], dtype=torch.float32)
    return {"reference_latents": torch.cat([image.float().flatten(2) for image in images], dim=2),
            "reference_sizes": sizes.expand(len(images[0]), -1, -1).contiguous()}


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
    """A ModelPatcher without weights in ComfyUI. ComfyUI's LoRA loaders' patches become a LoRA file the pool applies
    (kept in the model options, so every clone carries its own stack); anything else that would change the model's
    weights or its blocks is refused by the node that tries it."""

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        if strength_model != 1.0:
            raise UnsupportedPatch("xDiT: a model merge scales the model's own weights, which live on the pool; merge "
                                   "the files beforehand, or sample with ComfyUI's own model")
        if not self.model.diffusion_model.weights:  # a pipeline folder's pool: ComfyUI knows no names to patch
            raise UnsupportedPatch("xDiT Model of a pipeline folder's pool holds no weights ComfyUI can name, so "
                                   "ComfyUI's LoRA loaders cannot patch it; load LoRAs with xDiT LoRA between xDiT Pool "
                                   "and xDiT Model, or load the transformer file with Load Diffusion Model (xDiT Pool)")
        if not patches:
            return []
        path = lora_file(peft_lora(self.model, patches))
        options = self.model_options.setdefault("transformer_options", {})
        options[LORAS] = (*options.get(LORAS, ()), (path, float(strength_patch)))
        return list(patches)

    def set_model_patch(self, patch, name):
        raise UnsupportedPatch(f"xDiT: a `{name}` model patch changes the transformer's blocks, which run on the pool; "
                               "remove the node that adds it, or sample with ComfyUI's own model")

    def set_model_patch_replace(self, patch, name, block_name, number, transformer_index=None):
        raise UnsupportedPatch(f"xDiT: a `{name}` replacement of {block_name} {number} changes the transformer's blocks, "
                               "which run on the pool; remove the node that adds it, or sample with ComfyUI's own model")


def comfy_model(pool, comfy_file=None, expert: str = "") -> PoolModelPatcher:
    """ComfyUI's model for the pool's family, its diffusion model replaced by PoolTransformer: as ComfyUI detects
    `comfy_file` (comfy_files.read: its model sampling and weight names), or for a pipeline folder, from the
    family's ComfyUI model class."""
    adapter = adapter_for(pool.pipeline, pool.latent_scale)
    if not adapter.data.model_call_conds:
        raise ConditioningError(f"xDiT Model cannot run the pool's {pool.pipeline} under ComfyUI's samplers: it takes "
                                "no model calls yet; sample it with xDiT Sampler")
    if comfy_file is not None:
        model_config, weights = comfy_file.model_config, comfy_file.weights
        model_config.unet_config["disable_unet_model_creation"] = True
    else:
        name = pool.status.get("model_class") or adapter.data.model_class
        channels = next(iter(adapter.data.latent_formats))
        config_class = getattr(comfy.supported_models, name)
        model_config = config_class({**config_class.unet_config, "in_channels": channels, "out_channels": channels,
                                     "disable_unet_model_creation": True})
        model_config.set_inference_dtype(torch.float32, None)
        weights = None
    model = model_config.get_model({}, device=CPU)
    model.diffusion_model = PoolTransformer(pool, adapter.data.model_call_conds, weights, expert,
                                            config=dict(model_config.unet_config),
                                            methods=adapter.data.reference_methods,
                                            timestep=adapter.data.model_call_timestep,
                                            av=adapter.data if adapter.data.audio_stream else None,
                                            versions=adapter.data.model_call_versions)
    return PoolModelPatcher(model, load_device=CPU, offload_device=CPU)


class XDiTModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTModel",
            display_name="Model from xDiT Pool",
            category="sampling/xDiT",
            description="The pool as a MODEL for KSampler, SamplerCustomAdvanced and guiders: ComfyUI's samplers "
                        "step here, each model call runs in parallel on the pool.",
            inputs=[XDiTPoolType.Input("pool", tooltip="The xDiT Pool (or xDiT LoRA) that evaluates the model.")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, pool) -> io.NodeOutput:
        return io.NodeOutput(comfy_model(pool))
