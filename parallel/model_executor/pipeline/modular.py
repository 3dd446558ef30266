"""The pipeline wrapper for diffusers' modular pipelines (`ModularPipeline`: a folder with modular_model_index.json).

A modular pipeline is a sequence of blocks (text encoder, denoise, decode, ...) run on shared components. The engine
runs the blocks that sample from embeddings — the family names those sub-blocks (`sampling_blocks`) — with the
pipeline's own `__call__` on the pipeline's own components, the transformer and scheduler wrapped as for a
`DiffusionPipeline`; so its loop's transformer calls run under the family's plan, data parallel splits the batch
around the call and the scheduler's steps carry the step callbacks (previews, cancel). What differs:

- guidance is a component, the guider: the call's `guidance_scale` (and any `guider_arguments`) set it for the
  call, and its calls of the transformer are named after its predictions ("pred_cond" → "cond"), as diffusers'
  classic pipelines name theirs with `cache_context`, so sequential CFG parallel and step caches know each branch;
- it returns what the blocks leave in the state: the engine asks for `latents` (what `output_type="latent"`
  means elsewhere) and decodes them itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from .wrapper import xFuserPipelineBaseWrapper


class xFuserModularPipelineWrapper(xFuserPipelineBaseWrapper):
    """A family module subclasses this for each diffusers `ModularPipeline` class it wraps and sets, beyond what
    every wrapper sets:

    sampling_blocks:  the sub-blocks of the pipeline's blocks that sample from embeddings to latents, in order (FLUX 3:
                      "vae_encoder" for its reference images, then "denoise"); the text encoder, prompt upsampler and
                      decoder blocks stay out of a sampling call.
    guider_arguments: call arguments that configure the pipeline's guider for one call (its attributes).
    state_outputs:    what a sampling call returns, from the blocks' state, in order: the latents, then one per name of
                      `extra_outputs` (MiniMax-H3: its `audio_latents`, the wrapper's `audio`).
    workflows:        the sampling blocks a call runs instead when it sends the named input, {input: blocks}; a block
                      may be named by its path (MiniMax-H3: `condition_latents` → "denoise.fl2va", the keyframe branch
                      of its conditional denoise block, which would choose it by the keyframe images, which the engine
                      never holds: the caller sends them encoded).
    """

    sampling_blocks: ClassVar[tuple[str, ...]] = ("denoise",)
    guider_arguments: ClassVar[tuple[str, ...]] = ("guidance_scale",)
    state_outputs: ClassVar[tuple[str, ...]] = ("latents",)
    workflows: ClassVar[dict[str, tuple[str, ...]]] = {}
    guidance_needs_negative = True  # the guider's unconditional branch is the negative prompt's

    def __init__(self, pipeline, attention_kernel: str | None = None, reversible: bool = False):
        self._sampling = sampling_blocks(pipeline, self.sampling_blocks)
        self._workflows = {name: sampling_blocks(pipeline, paths) for name, paths in self.workflows.items()}
        super().__init__(pipeline, attention_kernel, reversible)

    def call_parameter_names(self) -> set[str]:
        """What a sampling call takes: the inputs of every workflow's sampling blocks, and the guider's arguments."""
        every = [self._sampling, *self._workflows.values()]
        return {param.name for blocks in every for param in blocks.inputs if param.name} | set(self.guider_arguments)

    def uses_cfg(self, kwargs: dict[str, Any]) -> bool:
        guider = getattr(self.module, "guider", None)
        return guider is not None and guider._enabled and super().uses_cfg(kwargs)

    def run_pipeline(self, arguments: dict[str, Any]):
        """The pipeline's `__call__` running its sampling blocks; `(latents, *extra outputs)` as `return_dict=False`
        gives elsewhere."""
        from ...families.base import replaced

        arguments = dict(arguments)
        output_type, return_dict = arguments.pop("output_type", "latent"), arguments.pop("return_dict", True)
        if output_type != "latent":
            raise ValueError(f"{type(self.module).__name__} is a modular pipeline: the engine samples latents "
                             "(output_type='latent') and decodes them with the pool's VAE decode")
        settings = {name: arguments.pop(name) for name in self.guider_arguments if name in arguments}
        guider = getattr(self.module, "guider", None)
        blocks = next((self._workflows[name] for name in self._workflows if arguments.get(name) is not None),
                      self._sampling)
        with contextlib.ExitStack() as stack:
            stack.enter_context(replaced(self.module, "_blocks", blocks))
            if guider is not None:
                for name, value in settings.items():
                    stack.enter_context(replaced(guider, name, value))
                stack.enter_context(named_branches(guider, self.module.transformer))
            state = self.module(**arguments, output=list(self.state_outputs))
        outputs = tuple(state[name] for name in self.state_outputs)
        return _Output(images=outputs[0]) if return_dict else outputs


def sampling_blocks(pipeline, paths: tuple[str, ...]):
    """The pipeline's blocks at `paths` ("denoise", or "denoise.fl2va" for a branch of a conditional block) in one
    sequence, each under its first name (the pipeline's own blocks stay whole: `sub_blocks` are copies)."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    chosen = {}
    for path in paths:
        block = pipeline.blocks
        for name in path.split("."):
            inner = getattr(block, "sub_blocks", {})
            if name not in inner:
                raise ValueError(f"{type(pipeline).__name__} has no {path} blocks to sample with; there the blocks "
                                 f"are {', '.join(inner) or 'none'}")
            block = inner[name]
        chosen[path.split(".")[0]] = block
    return SequentialPipelineBlocks.from_blocks_dict(chosen)


class _Output:
    """What a DiffusionPipeline returns with `return_dict=True`, for callers that read `.images`."""

    def __init__(self, images: torch.Tensor):
        self.images = images


@contextlib.contextmanager
def named_branches(guider, transformer):
    """Inside: each transformer call the guider prepares runs in the transformer's `cache_context` named after the
    guider's prediction ("pred_cond" → "cond", "pred_uncond" → "uncond"), as diffusers' pipelines name their
    guidance branches."""
    from ...families.base import replaced

    entered: list[contextlib.AbstractContextManager] = []

    def prepare_models(denoiser):
        type(guider).prepare_models(guider, denoiser)
        name = guider._input_predictions[guider._count_prepared - 1].removeprefix("pred_")
        context = transformer.cache_context(name)
        context.__enter__()
        entered.append(context)

    def cleanup_models(denoiser):
        if entered:
            entered.pop().__exit__(None, None, None)
        type(guider).cleanup_models(guider, denoiser)

    try:
        with replaced(guider, "prepare_models", prepare_models), replaced(guider, "cleanup_models", cleanup_models):
            yield
    finally:
        while entered:  # a call that raised before its cleanup
            entered.pop().__exit__(None, None, None)
