"""The pipeline wrapper: wraps the transformer and scheduler, and runs the diffusers pipeline's own `__call__`.

The call runs unchanged on every rank; all parallelism happens in the wrapped transformer (sequence and CFG
parallel) and around the call (data parallel over the batch, data_parallel.py). Its other units are mixed in:
the checks before a call (checks.py), img2img's schedule (img2img.py) and what it answers besides sampling
(model_calls.py). Family wrappers subclass it in their module in parallel/families/, which the ComfyUI process
reads for its ComfyData: so diffusers is imported only where a pipeline is wrapped or run.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from ...call_parameters import CallParameter
from ...distributed import get_dp_group, get_layout, get_runtime_state
from ...layout.config import ParallelConfig
from ...pipeline_transformers import TRANSFORMERS
from ...request import STEP_CACHE
from ..register import xFuserSchedulerWrappersRegister
from ..wrapper import xFuserBaseWrapper
from .checks import LayoutChecks
from .data_parallel import batch_size, gather_batch, split_batch
from .img2img import SCHEDULE_TAIL_OF, Img2Img
from .model_calls import ModelCallGlue

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from ...families.comfy_data import ComfyData

# What every pipeline takes; families add theirs in `tensor_inputs`.
BASE_TENSOR_INPUTS = ("latents", "prompt_embeds", "negative_prompt_embeds")


class xFuserPipelineBaseWrapper(LayoutChecks, Img2Img, ModelCallGlue, xFuserBaseWrapper):
    """A family module subclasses this for each diffusers pipeline class it wraps and sets:

    comfy:           what the ComfyUI side needs (latent format, packing, conditioning), as plain data.
    tensor_inputs:   the tensor keyword arguments of `__call__` a job may send, beyond BASE_TENSOR_INPUTS.
    shared_inputs:   those of them that every sample of a batch shares (not split by data parallel even when
                     they hold as many entries as the batch: Qwen-Image-Edit Plus's reference images).
    embedding_sizes: input tensor → transformer config entry giving its width (entries: their product).
    call_parameters: the family's own `__call__` scalars that a job may set.
    call_defaults:   keyword arguments the family needs when it is given embeddings instead of text.
    latent_patch:    latent pixels per token side, if not the transformer's `patch_size` (Flux packs 2×2).
    model_call_inputs: the conditioning a single model call takes (model_call.py; ComfyUI's samplers
                     through xDiT Model), named as the pipeline names them; (): no model calls.
    model_call_required: those of them every call needs.
    extra_outputs:   what `__call__` returns after the latents (output_type="latent", return_dict=False), named as
                     the pipeline's output class names them (LTX-2: `audio`, its audio latents); contract E's OUT
                     and pool jobs carry them under these names.
    """

    comfy: ClassVar[ComfyData]
    tensor_inputs: ClassVar[tuple[str, ...]] = ()
    shared_inputs: ClassVar[tuple[str, ...]] = ()
    embedding_sizes: ClassVar[dict[str, str | tuple[str, ...]]] = {}
    call_parameters: ClassVar[dict[str, CallParameter]] = {}  # family scalars a job may set (call_parameters.py)
    call_defaults: ClassVar[dict[str, Any]] = {}
    latent_patch: ClassVar[int | None] = None
    model_call_inputs: ClassVar[tuple[str, ...]] = ()
    model_call_required: ClassVar[tuple[str, ...]] = ()
    extra_outputs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, pipeline: DiffusionPipeline, attention_kernel: str | None = None, reversible: bool = False):
        from ...families import FAMILIES
        from ..transformer import xFuserTransformerBaseWrapper

        super().__init__(pipeline)
        from ...loading.checkpoints.fp8 import use_fp8_matmul

        self.parallel_config: ParallelConfig = get_layout().config
        self.fp8_matmul = use_fp8_matmul(pipeline, self.parallel_config.fp8_matmul)  # fp8 layers multiplying in fp8
        self.cache_report = None  # the last call's step_cache.CacheReport, when it asked for a cache
        self._original = {"scheduler": pipeline.scheduler}
        pipeline.scheduler = xFuserSchedulerWrappersRegister.get_wrapper(pipeline.scheduler)(pipeline.scheduler)
        try:
            for name in TRANSFORMERS:
                transformer = getattr(pipeline, name, None)
                if transformer is not None:
                    plan = FAMILIES.for_transformer(transformer).plan
                    setattr(pipeline, name, xFuserTransformerBaseWrapper(transformer, plan, attention_kernel, reversible))
                    self._original[name] = transformer
        except Exception:
            self.unwrap()  # the pipeline as it was, wrapped nowhere
            raise
        if self.parallel_config.compile:  # after the wrappers, so their attention seam is compiled in
            from ..compile import compile_blocks

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
        from .. import scheduler  # noqa: F401 - registers the scheduler wrappers

        return FAMILIES.pipeline_wrapper(pipeline)(pipeline, attention_kernel, reversible)

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "xFuserPipelineBaseWrapper":
        from diffusers import DiffusionPipeline

        return cls.wrap(DiffusionPipeline.from_pretrained(path, **kwargs))

    def use_scheduler(self, scheduler) -> None:
        """Sample with another diffusers scheduler from now on (wrapped like the original)."""

        self.module.scheduler = xFuserSchedulerWrappersRegister.get_wrapper(scheduler)(scheduler)

    def transformers(self) -> list:
        """The pipeline's transformers as wrapped here (Wan 2.2 A14B: both experts), high-noise first."""
        return [getattr(self.module, name) for name in TRANSFORMERS if name in self._original]

    def unwrap(self) -> DiffusionPipeline:
        """Restore the pipeline's own transformer and scheduler (before re-initialising the layout)."""
        for name in TRANSFORMERS:
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
        from ..scheduler import steps_each_token

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

        return step_cache(self.transformers(), settings)

    def call_context(self, kwargs: dict[str, Any]) -> contextlib.AbstractContextManager:
        """Around the pipeline call, with this rank's arguments: a family may take out inputs the pipeline
        does not know and stand in for what they replace (Wan image-to-video's given image encoding)."""
        return contextlib.nullcontext()

    def converted(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's tensors as the pipeline takes them, where a client sends them otherwise (ComfyUI's flattened
        layers). `prepare` converts them, and a call run from a prepared result converts the tensors this rank holds
        again (they replace the prepared ones), so a conversion must leave converted tensors as they are."""
        return kwargs

    def prepare(self, kwargs: dict[str, Any], check_layout: bool = True) -> tuple[dict[str, Any], int, int]:
        """The call's full keyword arguments, its batch size and image tokens; raises if it can't run (without
        `check_layout`: if its inputs do not fit the model, whatever the layout)."""
        from ...loading.checkpoints.load import missing_vae

        if missing := missing_vae(self.module):  # a transformer file loaded alone serves model calls only
            raise ValueError(missing)
        kwargs = self.converted({**self.call_defaults, **kwargs})
        if not kwargs.get("height") or not kwargs.get("width"):
            raise ValueError("pass height and width: the layout is checked against the token count they give")
        batch = batch_size(kwargs)
        if not check_layout:
            self.check_inputs(kwargs, batch)
            return kwargs, batch, self.sequence_tokens(kwargs)
        return kwargs, batch, self.check_layout(kwargs, batch)

    def call_parameter_names(self) -> set[str]:
        """The keyword arguments the pipeline's `__call__` takes (img2img and step callbacks choose by them)."""
        return set(inspect.signature(self.module.__call__).parameters)

    def run_pipeline(self, arguments: dict[str, Any]):
        """One call of the diffusers pipeline with this rank's arguments."""
        return self.module(**arguments)

    def step_callbacks(self, step_callback: Callable[[int, torch.Tensor], None]
                       ) -> tuple[dict[str, Any], contextlib.AbstractContextManager]:
        """`step_callback(step_index, latents)` in the pipeline's own callback style: the call's arguments, and a
        context to call it in (where the pipeline takes no callback, the scheduler calls it after each step)."""
        parameters = self.call_parameter_names()
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
            kwargs = self.converted({**checked, **kwargs})
        after_step = contextlib.nullcontext()
        if step_callback is not None:
            arguments, after_step = self.step_callbacks(step_callback)
            kwargs.update(arguments)
        total = kwargs.pop(SCHEDULE_TAIL_OF, None)
        schedule = self.module.scheduler.tail_of(total) if total else contextlib.nullcontext()
        caching = self._step_cache(kwargs.pop(STEP_CACHE, None))
        dp = get_dp_group()
        local, counts = split_batch(kwargs, batch, self.shared_inputs, dp, self.parallel_config.batch_split(batch))
        runtime = get_runtime_state()
        runtime.set_input_parameters(
            height=kwargs["height"],
            width=kwargs["width"],
            batch_size=batch if counts is None else counts[dp.rank_in_group],
            num_inference_steps=kwargs.get("num_inference_steps", 0),
            image_tokens=tokens,
        )
        if self.patches_flow(kwargs):
            runtime.flow_scheduler = self.module.scheduler.module
            runtime.flow_combine = self.guidance_combine(kwargs) if self.uses_cfg(kwargs) else None
        try:
            with schedule, after_step, caching as self.cache_report, self.call_context(local):
                output = self.run_pipeline(local)
        finally:
            for name in TRANSFORMERS:
                if name in self._original:
                    getattr(self.module, name).settle()
            runtime.flow_scheduler = runtime.step_result = runtime.flow_combine = None  # the flow ends with the call
        if counts is None:
            return output
        return gather_batch(output, counts, dp)
