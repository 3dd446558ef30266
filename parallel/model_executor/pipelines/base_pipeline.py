"""The pipeline wrapper: wraps the transformer and scheduler, checks the layout, splits data parallel.

The diffusers pipeline's own `__call__` runs unchanged on every rank; all parallelism happens in
the wrapped transformer (sequence and CFG parallel) and here (data parallel over the batch).
Family wrappers subclass this in their module in parallel/families/, which the ComfyUI process reads
for its ComfyData: so diffusers is imported only where a pipeline is wrapped or run.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np
import torch

from ...call_parameters import CallParameter
from ...config import LayoutError, ParallelConfig
from ...distributed import get_dp_group, get_layout, get_runtime_state
from ...request import STEP_CACHE
from ..base_wrapper import xFuserBaseWrapper
from ..register import xFuserSchedulerWrappersRegister

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from ...families.base import ComfyData

# partial_denoise's note to __call__: sample the tail of a schedule of this many steps (see tail_of).
SCHEDULE_TAIL_OF = "_schedule_tail_of"

# What every pipeline takes; families add theirs in `tensor_inputs`.
BASE_TENSOR_INPUTS = ("latents", "prompt_embeds", "negative_prompt_embeds")


class xFuserPipelineBaseWrapper(xFuserBaseWrapper):
    """A family module subclasses this for each diffusers pipeline class it wraps and sets:

    comfy:           what the ComfyUI side needs (latent format, packing, conditioning), as plain data.
    tensor_inputs:   the tensor keyword arguments of `__call__` a job may send, beyond BASE_TENSOR_INPUTS.
    shared_inputs:   those of them that every sample of a batch shares (not split by data parallel even when
                     they hold as many entries as the batch: Qwen-Image-Edit Plus's reference images).
    embedding_sizes: input tensor → transformer config entry giving its last dimension.
    call_parameters: the family's own `__call__` scalars that a job may set.
    call_defaults:   keyword arguments the family needs when it is given embeddings instead of text.
    latent_patch:    latent pixels per token side, if not the transformer's `patch_size` (Flux packs 2×2).
    model_call_inputs: the conditioning a single model call takes (model_call.py; ComfyUI's samplers
                     through xDiT Model), named as the pipeline names them; (): no model calls.
    model_call_required: those of them every call needs.
    """

    comfy: ClassVar[ComfyData]
    tensor_inputs: ClassVar[tuple[str, ...]] = ()
    shared_inputs: ClassVar[tuple[str, ...]] = ()
    embedding_sizes: ClassVar[dict[str, str]] = {}
    call_parameters: ClassVar[dict[str, CallParameter]] = {}  # family scalars a job may set (call_parameters.py)
    call_defaults: ClassVar[dict[str, Any]] = {}
    latent_patch: ClassVar[int | None] = None
    model_call_inputs: ClassVar[tuple[str, ...]] = ()
    model_call_required: ClassVar[tuple[str, ...]] = ()

    def __init__(self, pipeline: DiffusionPipeline, attention_kernel: str | None = None, reversible: bool = False):
        from ...families import FAMILIES
        from ..models.transformers import xFuserTransformerBaseWrapper

        super().__init__(pipeline)
        from ...checkpoints.fp8_matmul import use_fp8_matmul

        self.parallel_config: ParallelConfig = get_layout().config
        self.fp8_matmul = use_fp8_matmul(pipeline, self.parallel_config.fp8_matmul)  # fp8 layers multiplying in fp8
        self.cache_report = None  # the last call's step_cache.CacheReport, when it asked for a cache
        self._original = {"scheduler": pipeline.scheduler}
        pipeline.scheduler = xFuserSchedulerWrappersRegister.get_wrapper(pipeline.scheduler)(pipeline.scheduler)
        try:
            for name in ("transformer", "transformer_2"):  # Wan 2.2's low-noise expert is wrapped like the first
                transformer = getattr(pipeline, name, None)
                if transformer is not None:
                    plan = FAMILIES.for_transformer(transformer).plan
                    setattr(pipeline, name, xFuserTransformerBaseWrapper(transformer, plan, attention_kernel, reversible))
                    self._original[name] = transformer
        except Exception:
            self.unwrap()  # the pipeline as it was, wrapped nowhere
            raise
        if self.parallel_config.compile:  # after the wrappers, so their attention seam is compiled in
            from ...compile import compile_blocks

            compile_blocks(pipeline)

    @classmethod
    def all_tensor_inputs(cls) -> tuple[str, ...]:
        return BASE_TENSOR_INPUTS + cls.tensor_inputs

    @staticmethod
    def wrap(pipeline: DiffusionPipeline, attention_kernel: str | None = None,
             reversible: bool = False) -> "xFuserPipelineBaseWrapper":
        """Wrap any supported diffusers pipeline for the current parallel layout (`reversible`: PipeFusion stages
        keep the other stages' blocks aside, so that `unwrap` gives back the whole model for another layout)."""
        from ...families import FAMILIES
        from .. import schedulers  # noqa: F401 - registers the scheduler wrappers

        return FAMILIES.pipeline_wrapper(pipeline)(pipeline, attention_kernel, reversible)

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "xFuserPipelineBaseWrapper":
        from diffusers import DiffusionPipeline

        return cls.wrap(DiffusionPipeline.from_pretrained(path, **kwargs))

    def use_scheduler(self, scheduler) -> None:
        """Sample with another diffusers scheduler from now on (wrapped like the original)."""
        from .. import schedulers  # noqa: F401 - registers the scheduler wrappers

        self.module.scheduler = xFuserSchedulerWrappersRegister.get_wrapper(scheduler)(scheduler)

    def unwrap(self) -> DiffusionPipeline:
        """Restore the pipeline's own transformer and scheduler (before re-initialising the layout)."""
        for name in ("transformer", "transformer_2"):
            if name in self._original:
                getattr(self.module, name).unwrap()
                setattr(self.module, name, self._original[name])
        self.module.scheduler = self._original["scheduler"]
        return self.module

    def patches_flow(self, kwargs: dict[str, Any], config: ParallelConfig | None = None) -> bool:
        """Whether PipeFusion's patches may flow across steps in this call (pipefusion.py) under `config` (this
        wrapper's): the plan says how; a step is one model call, or with guidance a "cond" then an "uncond" call on
        this rank whose predictions the family combines per token (`guidance_combine`); no reference tokens beside
        the latents; and the scheduler's step is elementwise."""
        from ..schedulers.base_scheduler import steps_each_token

        c = config or self.parallel_config
        plan = self.module.transformer.plan
        guided = self.uses_cfg(kwargs)
        return (c.pipefusion_degree > 1 and c.patch_flow and plan.pipefusion is not None and plan.pipefusion.flow is not None
                and "transformer_2" not in self._original and not self.reference_tokens(kwargs.get("image"))
                and (not guided or (c.cfg_degree == 1 and plan.cfg_branches == ("cond", "uncond")
                                    and self.guidance_combine(kwargs) is not None))
                and steps_each_token(self.module.scheduler.module))

    def guidance_combine(self, kwargs: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The pipeline's guidance as its loop applies it to the two calls' predictions, (cond, uncond) -> prediction,
        where it treats each token on its own (so PipeFusion's patches can flow across steps with guidance); None:
        not declared."""
        return None

    def _step_cache(self, settings) -> contextlib.AbstractContextManager:
        """diffusers' cache hook on the transformer(s) for this call, if the job asks for one."""
        if settings is None:
            return contextlib.nullcontext()
        from ..step_cache import step_cache

        experts = [getattr(self.module, name) for name in ("transformer", "transformer_2") if name in self._original]
        return step_cache(experts, settings)

    # -- text -------------------------------------------------------------------------------------
    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        """The pipeline's own `encode_prompt(prompt)` with its defaults, as named pipeline inputs."""
        raise NotImplementedError(f"{type(self.module).__name__} has no text encoding in this engine")

    def encode_text_with_images(self, prompt: str, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """The prompt encoded together with reference images [N, 3, H, W] in [0, 1], where the model's text encoder
        sees them (Qwen-Image-Edit); the others refuse."""
        name = type(self.module).__name__
        references = " (its reference images go in as ReferenceLatent)" if self.comfy.reference_latents else ""
        raise ValueError(f"{name}'s text encoders take no image{references}: encode the text alone, without an image")

    def input_widths(self) -> dict[str, int]:
        """Last-dimension size the model needs for each embedding input (for clients to check)."""
        config = self.module.transformer.config
        return {name: int(config[entry]) for name, entry in self.embedding_sizes.items()}

    # -- single model calls (model_call.py) ----------------------------------------------------------
    def model_call_arguments(self, latents: torch.Tensor, timestep: torch.Tensor,
                             inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The transformer's keyword arguments for `latents` [B, C, H, W] at the scheduler's `timestep` [B],
        as the pipeline's loop makes them (families with model_call_inputs)."""
        raise NotImplementedError

    def model_call_output(self, output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's output as a prediction shaped like `latents`."""
        return output

    def model_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's `output_type="latent"` result as its denoising loop keeps latents (what a step callback
        sees): the same for most pipelines; a family overrides it where its pipeline returns them otherwise."""
        return latents

    def comfy_model_class(self) -> str:
        """comfy.supported_models' class for this model (ComfyData.model_class; a family may tell variants apart)."""
        return self.comfy.model_class

    # -- checks -------------------------------------------------------------------------------------
    def attention_heads(self) -> int:
        return self.module.transformer.config.num_attention_heads

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("guidance_scale", 1.0) > 1.0

    def noise_channels(self) -> int:
        """The latent channels its `__call__` gives `prepare_latents`: the transformer's input channels, over the
        2×2 patch where the pipeline packs latent pixels into tokens itself (Flux, Qwen-Image, FLUX.2)."""
        return self.module.transformer.config.in_channels // (self.latent_patch or 1) ** 2

    def noise_input(self, prepared: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The initial noise as `prepare_latents` returns it (prompt_inputs.py), as this pipeline's `latents`
        argument takes it: as returned, for most."""
        return prepared

    def latent_scale(self) -> int:
        """Pixels per latent pixel of the image-shaped latents a client (ComfyUI's LATENT) holds for this pipeline:
        its VAE's spatial factor, read off the loaded VAE rather than assumed (FLUX.2 doubles it)."""
        return getattr(self.module, "vae_scale_factor_spatial", None) or self.module.vae_scale_factor

    def image_tokens(self, height: int, width: int) -> int:
        patch = self.latent_patch or self.module.transformer.config.patch_size
        return self.grid_tokens(height, width, self.module.vae_scale_factor, patch, patch)

    @staticmethod
    def grid_tokens(height: int, width: int, scale: int, patch_h: int, patch_w: int) -> int:
        """Tokens of a height × width image at VAE factor `scale` in patch_h × patch_w patches; a side that
        does not divide is a LayoutError that says how to round it."""
        for name, size, patch in (("height", height, patch_h), ("width", width, patch_w)):
            if size % (scale * patch):
                raise LayoutError(
                    f"{name} {size} is not a multiple of {scale * patch} (VAE factor {scale} × patch {patch}); "
                    f"round it to a multiple of {scale * patch}."
                )
        return (height // (scale * patch_h)) * (width // (scale * patch_w))

    def sequence_tokens(self, kwargs: dict[str, Any]) -> int:
        """Tokens the sequence-parallel split sees: the image's and its reference images' (video pipelines count
        every latent frame)."""
        return self.image_tokens(kwargs["height"], kwargs["width"]) + self.reference_tokens(kwargs.get("image"))

    def reference_tokens(self, image: Any) -> int:
        """Tokens reference images add after the image's in the sequence (edit models); 0 for the others."""
        return 0

    def token_rows(self, kwargs: dict[str, Any]) -> int:
        """Rows of image tokens (video: of every latent frame): PipeFusion patches cut whole rows."""
        patch = self.latent_patch or self.module.transformer.config.patch_size
        return kwargs["height"] // (self.module.vae_scale_factor * patch)

    def tokens_split(self, tokens: int) -> bool:
        """Whether `tokens` split over the sequence-parallel degree: evenly, or unevenly if the plan pads."""
        sp = self.parallel_config.sp_degree
        return tokens % sp == 0 or (self.module.transformer.plan.uneven_tokens and tokens >= sp)

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        scale = self.module.vae_scale_factor
        return (batch, self.module.transformer.config.in_channels, height // scale, width // scale)

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        """Shapes of the given tensors against the model, so a mismatch fails before any rank computes."""
        latents = kwargs.get("latents")
        expected = self.expected_latents_shape(batch, kwargs["height"], kwargs["width"])
        if isinstance(latents, torch.Tensor) and tuple(latents.shape) != expected:
            raise ValueError(
                f"latents have shape {list(latents.shape)} but {type(self.module).__name__} at "
                f"{kwargs['height']}x{kwargs['width']} needs {list(expected)}; send latents of that shape."
            )
        config = self.module.transformer.config
        for name, entry in self.embedding_sizes.items():
            tensor = kwargs.get(name)
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.shape[0] != batch or tensor.shape[-1] != config[entry]:
                raise ValueError(
                    f"{name} has shape {list(tensor.shape)}, but this model needs batch {batch} and width "
                    f"{config[entry]} ({entry}); encode the prompt with this model's own text encoders."
                )

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        """Raise LayoutError, before any compute, if this input cannot run on this layout."""
        c = self.parallel_config
        heads = self.attention_heads()
        if heads % c.ulysses_degree:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise LayoutError(
                f"the model has {heads} attention heads, which do not split over ulysses degree {c.ulysses_degree}; "
                f"use a ulysses degree in {divisors} and put the rest into --ring-degree."
            )
        tokens = self.sequence_tokens(kwargs)
        self.check_inputs(kwargs, batch)
        if not self.tokens_split(tokens):
            raise LayoutError(
                f"{kwargs['height']}x{kwargs['width']} gives {tokens} image tokens, which do not split over "
                f"sequence-parallel degree {c.sp_degree} (ring {c.ring_degree} × ulysses {c.ulysses_degree}); "
                f"choose a resolution whose token count divides by {c.sp_degree} or lower the degrees."
            )
        if c.pipefusion_degree > 1:
            rows = self.token_rows(kwargs)
            if rows % (c.patches * c.sp_degree):
                raise LayoutError(
                    f"{kwargs['height']}x{kwargs['width']} has {rows} token rows, which do not split into "
                    f"{c.patches} PipeFusion patches × sequence-parallel degree {c.sp_degree}; choose a height whose "
                    f"token rows divide by {c.patches * c.sp_degree}, or change --num-patches."
                )
            references = self.reference_tokens(kwargs.get("image"))
            if references and tokens % (c.patches * c.sp_degree):  # the patches cut [noisy; reference] tokens
                raise LayoutError(
                    f"{tokens} tokens ({references} of them the reference images') do not split into {c.patches} "
                    f"PipeFusion patches × sequence-parallel degree {c.sp_degree}; choose a reference size whose tokens "
                    f"make the total divide by {c.patches * c.sp_degree}, or change --num-patches."
                )
        if kwargs.get(STEP_CACHE) is not None:
            from ..step_cache import check_cache

            check_cache(kwargs[STEP_CACHE], c.pipefusion_degree, self.module.transformer.module)
        if c.cfg_degree > 1 and not self.uses_cfg(kwargs):
            raise LayoutError(self.cfg_parallel_hint(kwargs))
        if batch < c.dp_degree and not c.dp_when_divisible:
            raise LayoutError(
                f"data parallel degree {c.dp_degree} needs at least {c.dp_degree} samples, but the batch is {batch}; "
                f"lower --dp-degree or send {c.dp_degree} or more samples."
            )
        return tokens

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return (
            f"CFG parallel needs classifier-free guidance, but guidance_scale is {kwargs.get('guidance_scale', 1.0)}; "
            "set a guidance scale above 1 or turn CFG parallel off."
        )

    # -- img2img ------------------------------------------------------------------------------------
    def flow_sigmas(self, total: int) -> np.ndarray:
        """The unshifted sigmas this pipeline gives a flow-matching scheduler for `total` steps."""
        scheduler = self.module.scheduler
        return np.linspace(scheduler.sigma_max, scheduler.sigma_min, total)

    def shift_arguments(self, height: int, width: int, steps: int) -> dict[str, float]:
        """`mu` for schedulers with resolution-dependent shifting, computed as the pipelines do for a call of
        `steps` steps."""
        config = self.module.scheduler.config
        if not config.get("use_dynamic_shifting"):
            return {}
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        mu = calculate_shift(
            self.image_tokens(height, width), config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )
        return {"mu": mu}

    def partial_denoise(self, kwargs: dict[str, Any], init_latents: torch.Tensor, denoise: float) -> dict[str, Any]:
        """img2img as ComfyUI's `denoise` means it: run the last `steps` of a `steps / denoise` schedule,
        starting from `init_latents` noised (with the given `latents` as noise) to that point."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = kwargs["num_inference_steps"]
        total = max(steps, int(steps / denoise))
        noise = kwargs["latents"]
        scheduler = copy.deepcopy(self.module.scheduler.module)
        call = inspect.signature(self.module.__call__).parameters
        if "sigmas" not in call and "timesteps" not in call and hasattr(scheduler, "set_begin_index"):
            scheduler.set_timesteps(total)  # the pipeline takes no schedule: __call__ cuts the scheduler's own
            start = scheduler.timesteps[(total - steps) * scheduler.order :][:1]
            noised = (scheduler.add_noise(init_latents, noise, start) if hasattr(scheduler, "add_noise")
                      else scheduler.scale_noise(init_latents, start, noise))  # flow matching's name for it
            return {**kwargs, "latents": noised, SCHEDULE_TAIL_OF: total}
        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            sigmas = self.flow_sigmas(total)[total - steps :]
            scheduler.set_timesteps(sigmas=sigmas, **self.shift_arguments(kwargs["height"], kwargs["width"], steps))
            sigma = scheduler.sigmas[0].to(noise.dtype)
            return {**kwargs, "latents": sigma * noise + (1 - sigma) * init_latents, "sigmas": sigmas.tolist()}
        takes_timesteps = "timesteps" in inspect.signature(scheduler.set_timesteps).parameters
        if takes_timesteps and scheduler.init_noise_sigma == 1.0:
            scheduler.set_timesteps(total)
            timesteps = scheduler.timesteps[total - steps :]
            latents = scheduler.add_noise(init_latents, noise, timesteps[:1])
            return {**kwargs, "latents": latents, "timesteps": timesteps.tolist()}
        raise ValueError(
            f"denoise below 1 is not available with {type(scheduler).__name__}; use the pipeline's default scheduler"
        )

    # -- running ------------------------------------------------------------------------------------
    def call_context(self, kwargs: dict[str, Any]) -> contextlib.AbstractContextManager:
        """Around the pipeline call, with this rank's arguments: a family may take out inputs the pipeline
        does not know and stand in for what they replace (Wan image-to-video's given image encoding)."""
        return contextlib.nullcontext()

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        """The call's full keyword arguments, its batch size and image tokens; raises if it can't run (without
        `check_layout`: if its inputs do not fit the model, whatever the layout)."""
        kwargs = {**self.call_defaults, **kwargs}
        if not kwargs.get("height") or not kwargs.get("width"):
            raise ValueError("pass height and width: the layout is checked against the token count they give")
        batch = _batch_size(kwargs)
        if not check_layout:
            self.check_inputs(kwargs, batch)
            return kwargs, batch, self.sequence_tokens(kwargs)
        return kwargs, batch, self.check_layout(kwargs, batch)

    def step_callbacks(self, step_callback: Callable[[int, torch.Tensor], None]
                       ) -> tuple[dict[str, Any], contextlib.AbstractContextManager]:
        """`step_callback(step_index, latents)` in the pipeline's own callback style: the call's arguments, and a
        context to call it in (where the pipeline takes no callback, the scheduler calls it after each step)."""
        parameters = inspect.signature(self.module.__call__).parameters
        if "callback_on_step_end" in parameters:
            def on_step_end(pipeline, index, timestep, tensors):
                step_callback(index, tensors["latents"])
                return {}

            arguments = {"callback_on_step_end": on_step_end, "callback_on_step_end_tensor_inputs": ["latents"]}
            return arguments, contextlib.nullcontext()
        if "callback" in parameters:
            arguments = {"callback": lambda index, timestep, latents: step_callback(index, latents), "callback_steps": 1}
            return arguments, contextlib.nullcontext()
        return {}, self.module.scheduler.calling_after_each_step(step_callback)

    @torch.no_grad()
    @xFuserBaseWrapper.check_parallel_state
    def __call__(self, *, step_callback: Callable[[int, torch.Tensor], None] | None = None,
                 prepared: tuple[dict[str, Any], int, int] | None = None, **kwargs):
        """Run the diffusers pipeline on this rank's share; `step_callback(i, latents)` after each step.

        `prepared`: what `prepare` returned for these arguments when the caller already checked them (a
        pool's rank 0 does at submit), so the checks run once; `kwargs` override its arguments (the
        tensors as this rank holds them, img2img's noised latents)."""
        if prepared is None:
            kwargs, batch, tokens = self.prepare(kwargs)
        else:
            checked, batch, tokens = prepared
            kwargs = {**checked, **kwargs}
        after_step = contextlib.nullcontext()
        if step_callback is not None:
            arguments, after_step = self.step_callbacks(step_callback)
            kwargs.update(arguments)
        total = kwargs.pop(SCHEDULE_TAIL_OF, None)
        schedule = self.module.scheduler.tail_of(total) if total else contextlib.nullcontext()
        caching = self._step_cache(kwargs.pop(STEP_CACHE, None))
        dp = get_dp_group()
        counts = self.parallel_config.batch_split(batch)  # None: this rank runs the whole batch
        start, mine = (0, batch) if counts is None else (sum(counts[: dp.rank_in_group]), counts[dp.rank_in_group])
        local = {k: v if k in self.shared_inputs else _take(k, v, batch, start, mine) for k, v in kwargs.items()}
        runtime = get_runtime_state()
        runtime.set_input_parameters(
            height=kwargs["height"],
            width=kwargs["width"],
            batch_size=mine,
            num_inference_steps=kwargs.get("num_inference_steps", 0),
            image_tokens=tokens,
        )
        if self.patches_flow(kwargs):
            runtime.flow_scheduler = self.module.scheduler.module
            runtime.flow_combine = self.guidance_combine(kwargs) if self.uses_cfg(kwargs) else None
        try:
            with schedule, after_step, caching as self.cache_report, self.call_context(local):
                output = self.module(**local)
        finally:
            for name in ("transformer", "transformer_2"):
                if name in self._original:
                    getattr(self.module, name).settle()
            runtime.flow_scheduler = runtime.step_result = runtime.flow_combine = None  # the flow ends with the call
        if counts is None:
            return output
        return _gather_batch(output, counts, dp)


def _batch_size(kwargs: dict[str, Any]) -> int:
    for key in ("latents", "prompt_embeds"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key].shape[0]
    prompt = kwargs.get("prompt")
    return len(prompt) if isinstance(prompt, list) else 1


PER_SAMPLE_LISTS = ("prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3", "generator")


def _take(name: str, value: Any, batch: int, start: int, count: int) -> Any:
    """This dp rank's slice of a per-sample argument (batched tensors, per-prompt lists)."""
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value[start : start + count]
    if name in PER_SAMPLE_LISTS and isinstance(value, list) and len(value) == batch:
        return value[start : start + count]
    return value


def _gather_batch(output: Any, counts: list[int], dp) -> Any:
    """Reassemble the batch from every dp rank (padded to equal size for the collective)."""
    images = output[0] if isinstance(output, tuple) else output.images
    if not isinstance(images, torch.Tensor):
        raise ValueError("data parallel returns tensors only: call with output_type='latent' or 'pt'")
    padded = torch.zeros((max(counts), *images.shape[1:]), dtype=images.dtype, device=images.device)
    padded[: images.shape[0]] = images
    gathered = dp.all_gather(padded.unsqueeze(0), dim=0)
    images = torch.cat([gathered[i, :n] for i, n in enumerate(counts)])
    if isinstance(output, tuple):
        return (images, *output[1:])
    output.images = images
    return output
