"""Apply a ParallelPlan's sequence part to an untouched diffusers transformer with PyTorch hooks."""

from __future__ import annotations

import fnmatch
import inspect
from typing import Any, Callable

import torch

from ..config import LayoutError
from ..distributed import GroupCoordinator, get_runtime_state
from .layers import xFuserAttentionBaseWrapper, xFuserLayerBaseWrapper
from .plans import Gather, ParallelPlan, Split
from .register import xFuserLayerWrappersRegister


def as_keyword_arguments(function: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Name positional arguments after `function`'s parameters so plans can address them by name."""
    if not args:
        return dict(kwargs)
    names = [p.name for p in inspect.signature(function).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    return {**dict(zip(names, args)), **kwargs}


def map_first(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to a module's main output: the tensor, a tuple's first item, or an output's `sample`."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple):
        return (fn(output[0]), *output[1:])
    output.sample = fn(output.sample)
    return output


def shard(tensor: torch.Tensor, dim: int, group: GroupCoordinator, what: str) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % group.world_size:
        raise LayoutError(
            f"{what} has {size} tokens, which do not split over sequence-parallel degree {group.world_size}; "
            f"choose a resolution whose token count divides by {group.world_size} or lower the ulysses/ring degrees."
        )
    return tensor.chunk(group.world_size, dim=dim)[group.rank_in_group]


def apply_sequence_plan(
    transformer: torch.nn.Module, plan: ParallelPlan, sp: GroupCoordinator, kernel: str | None = None
) -> tuple[list[torch.utils.hooks.RemovableHandle], list[xFuserLayerBaseWrapper]]:
    """Shard tokens where the plan says, gather them back, and make the selected attention USP."""
    handles = [transformer.register_forward_pre_hook(_record_text_tokens(plan.text_input), with_kwargs=True)]

    for path, specs in plan.inputs.items():
        module = transformer.get_submodule(path)
        handles.append(module.register_forward_pre_hook(_split_inputs(module, specs, sp), with_kwargs=True))

    for path, op in plan.outputs.items():
        handles.append(transformer.get_submodule(path).register_forward_hook(_output_op(path, op, sp)))

    layers: list[xFuserLayerBaseWrapper] = []
    for name, module in transformer.named_modules():
        # Patterns are optional one by one (SD3.5's attn2 exists only in some blocks), not all together.
        text_layout = next((t for p, t in plan.attention.items() if fnmatch.fnmatchcase(name, p)), None)
        if text_layout is not None:
            wrapper = xFuserLayerWrappersRegister.get_wrapper(module)
            assert issubclass(wrapper, xFuserAttentionBaseWrapper), wrapper
            layers.append(wrapper(module, name, text_layout, kernel))
    if not layers:
        raise ValueError(f"the plan for {type(transformer).__name__} selects no attention layer: {list(plan.attention)}")
    return handles, layers


def _record_text_tokens(text_input: str):
    def hook(module, args, kwargs):
        text = as_keyword_arguments(module.forward, args, kwargs).get(text_input)
        get_runtime_state().text_tokens = 0 if text is None else text.shape[1]

    return hook


def _split_inputs(module: torch.nn.Module, specs: dict[str, Split], sp: GroupCoordinator):
    def hook(module_, args, kwargs):
        named = as_keyword_arguments(module.forward, args, kwargs)
        for name, spec in specs.items():
            if named.get(name) is not None:
                named[name] = shard(named[name], spec.dim, sp, name)
        return (), named

    return hook


def _output_op(path: str, op: Split | Gather, sp: GroupCoordinator):
    if isinstance(op, Split):
        return lambda module, args, output: map_first(output, lambda t: shard(t, op.dim, sp, path or "output"))
    return lambda module, args, output: map_first(output, lambda t: sp.all_gather(t, op.dim))
