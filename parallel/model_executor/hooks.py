"""Apply a ParallelPlan's sequence part to an untouched diffusers transformer with PyTorch hooks."""

from __future__ import annotations

import fnmatch
import inspect
from typing import Any, Callable

import torch

from ..layout.config import LayoutError
from ..distributed import GroupCoordinator, get_runtime_state, get_ulysses_group
from .attention import TextLayout, dispatch, processor  # noqa: F401 - their attention wrappers register themselves
from .attention.seam import xFuserAttentionBaseWrapper, xFuserLayerBaseWrapper
from .plans import Gather, ParallelPlan, Split, TextPadding, check_dims
from .register import xFuserLayerWrappersRegister
from .token_split import UnevenSplit


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


def map_predictions(output: Any, fn: Callable[[torch.Tensor], torch.Tensor], count: int) -> Any:
    """Apply `fn` to the first `count` items of a module's output (ParallelPlan.predictions: LTX-2's video and audio)."""
    if count == 1:
        return map_first(output, fn)
    if isinstance(output, tuple):
        return (*(fn(item) for item in output[:count]), *output[count:])
    for key in list(output.keys())[:count]:
        output[key] = fn(output[key])
    return output


def shard(tensor: torch.Tensor, dim: int, group: GroupCoordinator, what: str, uneven: bool = False) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % group.world_size and uneven and size >= group.world_size:
        split = UnevenSplit.of(size, group.world_size, get_ulysses_group().world_size)
        get_runtime_state().token_split = split
        return split.shard(tensor, dim, group.rank_in_group)
    if size % group.world_size:
        raise LayoutError(
            f"{what} has {size} tokens, which do not split over sequence-parallel degree {group.world_size}; "
            f"choose a resolution whose token count divides by {group.world_size} or lower the ulysses/ring degrees."
        )
    return tensor.chunk(group.world_size, dim=dim)[group.rank_in_group]


def apply_sequence_plan(
    transformer: torch.nn.Module, plan: ParallelPlan, sp: GroupCoordinator, kernel: str | None = None,
    kv_cache: Any = None,
) -> tuple[list[torch.utils.hooks.RemovableHandle], list[xFuserLayerBaseWrapper]]:
    """Shard tokens where the plan says, gather them back, and make the selected attention USP
    (with `kv_cache`, PipeFusion's stale K/V, when the blocks run as a patch pipeline)."""
    handles = [transformer.register_forward_pre_hook(_record_text_tokens(plan.text_input), with_kwargs=True)]
    for path, padding in plan.text_padding.items():
        for where, module in modules_at(transformer, path):
            handles.append(module.register_forward_pre_hook(
                _trim_text_padding(module, where, padding, sp, padding.text == plan.text_input), with_kwargs=True))

    if plan.text_rows is not None:
        for _, module in modules_at(transformer, plan.text_rows.path):
            handles.append(module.register_forward_pre_hook(_count_text_rows(module, plan.text_rows.mask), with_kwargs=True))
    if sp.world_size > 1:
        for path, specs in plan.inputs.items():
            specs = {name: spec for name, spec in specs.items() if kv_cache is None or not spec.text}
            for where, module in modules_at(transformer, path):
                handles.append(module.register_forward_pre_hook(
                    _split_inputs(module, where or type(transformer).__name__, specs, sp, plan.uneven_tokens), with_kwargs=True))
        for path, op in plan.outputs.items():
            for where, module in modules_at(transformer, path):
                handles.append(module.register_forward_hook(_output_op(where, op, sp, plan.uneven_tokens)))

    layers: list[xFuserLayerBaseWrapper] = []
    for name, module in transformer.named_modules():
        # Patterns are optional one by one (SD3.5's attn2 exists only in some blocks), not all together.
        text_layout = next((t for p, t in plan.attention.items() if fnmatch.fnmatchcase(name, p)), None)
        replicated_queries = any(fnmatch.fnmatchcase(name, p) for p in plan.replicated_queries)
        mask = next((m for p, m in plan.attention_masks.items() if fnmatch.fnmatchcase(name, p)), None)
        if text_layout is not None or (replicated_queries and sp.world_size > 1):
            wrapper = xFuserLayerWrappersRegister.get_wrapper(module)
            assert issubclass(wrapper, xFuserAttentionBaseWrapper), wrapper
            assert mask is None or text_layout is not None, f"{name}: attention_masks names a layer USP does not run"
            layers.append(wrapper(module, name, text_layout or TextLayout.NONE, kernel, kv_cache, replicated_queries,
                                  mask))
    if not layers:
        raise ValueError(f"the plan for {type(transformer).__name__} selects no attention layer: {list(plan.attention)}")
    return handles, layers


def modules_at(root: torch.nn.Module, path: str) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for every submodule a plan path names ("*": each child at that level, "-1": the last)."""
    found = [("", root)]
    for part in path.split(".") if path else ():
        step = []
        for name, module in found:
            children = list(module.named_children())
            if part == "*":
                chosen = children
            elif part == "-1":
                chosen = children[-1:]
            else:
                chosen = [(part, module.get_submodule(part))]
            step += [(f"{name}.{child}" if name else child, sub) for child, sub in chosen]
        found = step
    if not found:
        raise ValueError(f"the parallel plan's path {path!r} names no module of {type(root).__name__}")
    return found


def _record_text_tokens(text_input: str | None):
    """Each call's own text length, and no token split yet: the split sees a call's own tokens (Krea 2's joined
    [text; image] differs between the guidance branches' calls)."""
    def hook(module, args, kwargs):
        text = as_keyword_arguments(module.forward, args, kwargs).get(text_input) if text_input else None
        runtime = get_runtime_state()
        runtime.text_tokens, runtime.token_split = 0 if text is None else text.shape[1], None

    return hook


def _count_text_rows(module: torch.nn.Module, mask: str):
    """The call's text length: the rows its joined stream's mask marks false (see TextRows)."""

    def hook(module_, args, kwargs):
        rows = as_keyword_arguments(module.forward, args, kwargs).get(mask)
        get_runtime_state().text_tokens = 0 if rows is None else int((~rows.bool()).sum())

    return hook


def _trim_text_padding(module: torch.nn.Module, where: str, padding: TextPadding, sp: GroupCoordinator,
                       joint: bool = True):
    """See TextPadding. The blocks after the first get the text the first one trimmed and the transformer's whole
    mask: the mask is cut to the text's length (no second look at it, no device sync). `joint`: the text is the
    replicated text of joint attention, whose length the attention needs (not where the plan splits text and image
    as one sequence)."""

    def hook(module_, args, kwargs):
        named = as_keyword_arguments(module.forward, args, kwargs)
        text, mask = named.get(padding.text), named.get(padding.mask)
        if text is None or mask is None:
            return None
        if text.shape[1] < mask.shape[1]:  # trimmed by an earlier block of this call
            named[padding.mask] = mask[:, : text.shape[1]]
            return (), named
        if padding.order_free:  # each sample's valid tokens first, in their order
            order = torch.sort((~mask.bool()).to(torch.int8), dim=1, stable=True).indices
            text = text.gather(1, order.view(*order.shape, *[1] * (text.ndim - 2)).expand_as(text))
            mask = mask.gather(1, order)
        valid = mask.bool()
        used = valid.any(dim=0).nonzero()
        length = int(used.max()) + 1 if len(used) else 1
        complete = bool(valid[:, :length].all())
        if sp.world_size > 1 and not complete:
            raise LayoutError(f"the samples of this batch have texts of different lengths, which {where} masks; "
                              "sequence-parallel attention takes no mask: send one prompt per job, or prompts of one "
                              "token length")
        for name in padding.rows:
            if named.get(name) is not None:
                named[name] = torch.cat([named[name][:length], named[name][text.shape[1]:]])
        named[padding.text], named[padding.mask] = text[:, :length], mask[:, :length]
        runtime = get_runtime_state()
        runtime.text_mask_complete = complete  # the attention seam drops such a mask
        if joint:
            runtime.text_tokens = length
        return (), named

    return hook


def shard_after_text(tensor: torch.Tensor, dim: int, group: GroupCoordinator, what: str, uneven: bool = False):
    """`shard` of the rows after the call's replicated text, which stay whole ahead of them (Split.after_text)."""
    text = get_runtime_state().text_tokens
    rows = tensor.narrow(dim, text, tensor.shape[dim] - text)
    return torch.cat([tensor.narrow(dim, 0, text), shard(rows, dim, group, what, uneven)], dim=dim)


def _split_inputs(module: torch.nn.Module, where: str, specs: dict[str, Split], sp: GroupCoordinator,
                  uneven: bool = False):
    image = {name: spec for name, spec in specs.items() if not spec.text}
    text = {name: spec for name, spec in specs.items() if spec.text}

    def hook(module_, args, kwargs):
        named = as_keyword_arguments(module.forward, args, kwargs)
        for name, spec in image.items():
            if named.get(name) is not None and spec.ndim in (None, named[name].ndim):
                check_dims(named[name], spec, where, f"input {name!r}")
                named[name] = (shard_after_text(named[name], spec.dim, sp, name, uneven) if spec.after_text
                               else shard(named[name], spec.dim, sp, name, uneven))
        present = {name: spec for name, spec in text.items() if named.get(name) is not None}
        if present and _text_shards(named, present, sp):
            for name, spec in present.items():
                check_dims(named[name], spec, where, f"input {name!r}")
                named[name] = shard(named[name], spec.dim, sp, name)
            get_runtime_state().text_tokens = 0  # no replicated text: attention sees one sequence shard
        return (), named

    return hook


def _text_shards(named: dict, text: dict[str, Split], sp: GroupCoordinator) -> bool:
    """Whether this call's text splits with the image (see Split.text)."""
    return get_runtime_state().token_split is None and all(named[n].shape[s.dim] % sp.world_size == 0 for n, s in text.items())



def _output_op(path: str, op: Split | Gather, sp: GroupCoordinator, uneven: bool = False):
    def checked(function: Callable[[torch.Tensor], torch.Tensor], what: str = "the output"):
        def apply(tensor: torch.Tensor) -> torch.Tensor:
            check_dims(tensor, op, path or "the transformer", what)
            return function(tensor)

        return apply

    if isinstance(op, Split):
        cut = shard_after_text if op.after_text else shard
        split = lambda t: cut(t, op.dim, sp, path or "output", uneven)  # noqa: E731
        if op.items is not None:
            return lambda module, args, output: tuple(
                checked(split, f"output item {i}")(t) if i in op.items else t for i, t in enumerate(output)
            )
        return lambda module, args, output: map_first(output, checked(split))
    gather = (lambda t: _gather_uneven(t, op.dim, sp)) if uneven else (lambda t: sp.all_gather(t, op.dim))
    if op.after_text:
        def gather_after_text(t: torch.Tensor) -> torch.Tensor:
            text = get_runtime_state().text_tokens
            return torch.cat([t.narrow(op.dim, 0, text), gather(t.narrow(op.dim, text, t.shape[op.dim] - text))], dim=op.dim)

        return lambda module, args, output: map_first(output, checked(gather_after_text))
    return lambda module, args, output: map_first(output, checked(gather))


def _gather_uneven(tensor: torch.Tensor, dim: int, sp: GroupCoordinator) -> torch.Tensor:
    split = get_runtime_state().token_split
    gathered = sp.all_gather(tensor, dim)
    return gathered if split is None else split.unpad(gathered, dim)
