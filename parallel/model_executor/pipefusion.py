"""PipeFusion: the repeated blocks split into pipeline stages, the image into patches.

Each pp rank keeps only its stage's blocks (the others become weightless passthroughs, so their
parameters are freed). The first local block runs the whole stage: for each patch it receives the
previous stage's output, runs the local blocks, and sends the result on without waiting, so a
stage computes patch p+1 while the next stage computes patch p. Attention inside a patch attends
to fresh K/V of its own patch and, for the other patches, to the K/V they produced most recently
(StaleKVCache) — the previous step's for later patches. During the first `warmup_steps` steps the
whole sequence goes through as one patch, which is exact and fills the cache. The last stage's
output is broadcast to the stage group, so every rank steps the scheduler on the same latents.

Where the blocks carry a text stream beside the image (Flux, SD3, Qwen-Image), the text is a patch of its
own after warm-up, the first of each step: it attends to the image's stale K/V, and the image patches
after it attend to its fresh K/V. So the text is computed once per step rather than with every patch
(M patches computed it M times), and the stage that waits for the first patch waits only for the text.
Where the blocks cannot take a stream of no tokens (`reshape(..., -1, 2)`, `[:, :-0]`), the text patch carries
one image token and each image patch one text token as stand-ins (the plan's `stand_in`); attention replaces
their K/V and their outputs are dropped, so they change nothing.

Where the plan declares a PatchFlow and the call allows it (a scheduler whose step is elementwise, guidance the
family combines per token: runtime `flow_scheduler`, `flow_combine`), the patches also flow across steps after
warm-up, as xDiT runs them: the last stage finishes each patch's step itself — the plan's output modules on the
patch, with guidance the "cond" and "uncond" calls' predictions combined, the step on the patch's own copy of
the scheduler (its multistep history cut to the patch) — and sends the patch's next latents straight back to
the first stage, which embeds them and starts the next step while the other patches are still in flight. No
stage waits for a whole step, so the stages idle only at the start and the end of the run. The result is the
same as with a whole step per stage: each stage's stale K/V hold the same steps' patches either way. The first stage's loop runs on stand-in outputs meanwhile; its latents are replaced after each step with
the latents it used (previews run one step behind) and, after the last step, with the last stage's.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..layout.config import LayoutError
from ..distributed import GroupCoordinator, get_runtime_state, get_sp_group
from .attention import TextLayout
from .hooks import as_keyword_arguments
from .plans import JoinedStream, PipeFusionPlan, TokenRows
from .scheduler import patch_copy
from .stale_kv import PatchContext, StaleKVCache, running


LATENTS = "_latents"  # the embedder's input, captured each call where patches may flow


@dataclass
class _Flow:
    """A run's patches flowing across steps."""

    first: int  # the first flowing step: it starts from the loop's own latents
    schedulers: list = field(default_factory=list)  # the last stage: each image patch's copy of the loop's scheduler
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # the first stage: each image patch's latents this step
    predictions: dict[int, torch.Tensor] = field(default_factory=dict)  # the last stage: each patch's "cond" prediction


def even_stages(blocks: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges of equal count (one block more in the later stages where they do not
    divide). Equal counts balance the compute: a token costs about the same in every family's pipeline blocks,
    Flux's double blocks included — they hold 2.4× a single block's parameters, but a token goes through half
    (the image's or the text's) and their modulation is per sample. Parameter-balanced stages gave a Flux stage
    0 three of the medium model's 8 blocks and left it idle 40% of each step."""
    return [(k * blocks // stages, (k + 1) * blocks // stages) for k in range(stages)]


class PipeFusionStage:
    """This rank's stage of `transformer`, installed in place; see the module docstring."""

    def __init__(self, transformer: torch.nn.Module, plan: PipeFusionPlan, pp: GroupCoordinator, num_patches: int,
                 warmup_steps: int, branch: Callable[[], str], keep_other_stages: bool = False):
        self.plan, self.pp, self.num_patches, self.warmup_steps, self.branch = plan, pp, num_patches, warmup_steps, branch
        blocks = [(name, i, block) for name in plan.blocks for i, block in enumerate(transformer.get_submodule(name))]
        if pp.world_size > len(blocks):
            raise LayoutError(
                f"pipefusion degree {pp.world_size} is more than the model's {len(blocks)} blocks; "
                f"use a pipefusion degree of at most {len(blocks)}."
            )
        start, end = even_stages(len(blocks), pp.world_size)[pp.rank_in_group]
        self.block_range = (start, end)
        self._run, self._first_step = -1, {}
        self._current: _Flow | None = None  # this run's flow
        self._in_flight: list = []  # flowing: sends not yet waited for (a send's work holds its tensor)
        self.flowed = False  # the last call's patches flowed on: its output is this stage's alone
        self.local = [block for _, _, block in blocks[start:end]]
        self._joined = [plan.joined.get(name) for name, _, _ in blocks[start:end]]
        self._forwards = [type(block).forward.__get__(block) for block in self.local]
        self._parameters = [set(inspect.signature(forward).parameters) for forward in self._forwards]  # joined blocks get only these
        # another stage's block: drop its weights, or keep it aside for `remove` to put back
        self._transformer, self._keep = transformer, keep_other_stages
        self._others = [(name, i, block) for name, i, block in blocks[:start] + blocks[end:]] if keep_other_stages else []
        for index, (name, i, block) in enumerate(blocks):
            if not start <= index < end:
                transformer.get_submodule(name)[i] = _Passthrough(plan, type(block).forward.__get__(block),
                                                                  plan.joined.get(name))
        for offset, block in enumerate(self.local):
            run = self._run_stage if offset == 0 else functools.partial(self._pass, self._forwards[offset],
                                                                        self._joined[offset])
            block.forward = _signed(run, self._forwards[offset])
        # what joined blocks take from the transformer's own submodules, as this call computes it
        self._captured: dict[str, torch.Tensor] = {}
        self._hooks = [transformer.get_submodule(path).register_forward_hook(functools.partial(_capture, self._captured, arg))
                       for joined in plan.joined.values() for arg, path in joined.inputs.items()]
        if plan.flow is not None:
            self._hooks.append(transformer.get_submodule(plan.flow.embedder).register_forward_pre_hook(
                lambda module, args: self._captured.__setitem__(LATENTS, args[0])))

    def remove(self) -> bool:
        """Uninstall the stage; True when the transformer is whole again (the other stages' blocks were kept)."""
        for block in self.local:
            del block.forward
        for hook in self._hooks:
            hook.remove()
        for name, i, block in self._others:
            self._transformer.get_submodule(name)[i] = block
        return self._keep

    # -- the stage ----------------------------------------------------------------------------------
    def _pass(self, forward, joined, *args, **kwargs):
        named = as_keyword_arguments(forward, args, kwargs)
        return named[self.plan.carried[0]] if joined else _returns(self.plan, named)

    def _run_stage(self, *args, **kwargs):
        named = as_keyword_arguments(self._forwards[0], args, kwargs)
        image_name, *text_names = self.plan.carried
        image = named[image_name]
        runtime = get_runtime_state()
        entry = self._joined[0]
        if entry is not None:  # the stage starts inside joined blocks: their input is [text; image]
            named = {**named, entry.text: image[:, : runtime.text_tokens]}
            image = image[:, runtime.text_tokens :]
        if self._run != runtime.run:
            self._run, self._first_step, self._current = runtime.run, {}, None
        # Warm-up counts from this stage's first step of the job in this branch: an expert that takes
        # over mid-run (Wan 2.2 A14B's second) fills its own stale K/V first.
        first = self._first_step.setdefault(self.branch(), runtime.step_index)
        asynchronous = runtime.step_index - first >= self.warmup_steps
        count = self.num_patches if asynchronous else 1
        size = image.shape[1] // count
        text_apart = asynchronous and bool(text_names)
        flow = self._flow(asynchronous, count, size) if entry is None else None
        self.flowed = flow is not None
        latents = self._captured.get(LATENTS) if flow is not None else None  # before the embedder runs on a patch
        # With guidance the flow spans the step's two calls: the latents arrive for the "cond" call (the first) and a
        # patch is stepped at the "uncond" call, from both predictions (runtime flow_combine).
        combine = runtime.flow_combine
        opens, closes = combine is None or self.branch() == "cond", combine is None or self.branch() == "uncond"
        arrived = flow is not None and runtime.step_index > flow.first  # this step's latents come from the last stage
        finish = flow is not None and self.pp.is_last_rank and not _last_step(runtime.flow_scheduler)
        # (image patch index, its rows): the text patch first when the text goes apart, with a stand-in image row
        stand_in = self.plan.stand_in
        patches = [(-1, slice(0, stand_in))] * text_apart + [(p, slice(p * size, (p + 1) * size)) for p in range(count)]
        outputs, sends = [], []
        for p, window in patches:
            keep = None if not text_apart or p < 0 else stand_in  # the text tokens the patch holds (None: all)
            state = {image_name: image[:, window],
                     **{n: _text_part(named.get(n), keep) for n in text_names}}
            if not self.pp.is_first_rank:
                state = self._receive(state)
            elif flow is not None and p >= 0:  # the patch's latents: from the loop at first, then from the last stage
                if arrived and opens:
                    flow.inputs[p] = self.pp.recv_prev(torch.empty_like(latents[:, window], memory_format=torch.contiguous_format))
                elif not arrived:
                    flow.inputs[p] = latents[:, window]
                if arrived:
                    state[image_name] = self._transformer.get_submodule(self.plan.flow.embedder)(flow.inputs[p])
            tokens = {n: _rows(named[n], rows, runtime.text_tokens, window, keep)
                      for n, rows in self.plan.token_inputs.items() if named.get(n) is not None}
            with running(PatchContext(p, count, asynchronous, self.branch(), text_apart, stand_in)):
                for forward, joined, parameters in zip(self._forwards, self._joined, self._parameters):
                    if joined is not None:
                        state = self._run_joined(forward, joined, parameters, {**named, **tokens}, state)
                        continue
                    out = forward(**{**named, **tokens, **state})
                    state = dict(zip(self.plan.returns, out if isinstance(out, tuple) else (out,)))
            if self.pp.is_last_rank:
                outputs.append(state)
                if finish and p >= 0:
                    prediction = self._prediction(state[image_name], named)
                    if not closes:
                        flow.predictions[p] = prediction
                    else:
                        if combine is not None:
                            prediction = combine(flow.predictions.pop(p), prediction)
                        sends.append(self.pp.isend_next(self._step_patch(flow, p, prediction, latents[:, window])))
            else:
                sends += [self.pp.isend_next(state[n]) for n in self.plan.carried if state[n].numel()]  # see _receive
        if flow is None:
            for work in sends:
                work.wait()
        else:  # waiting would hold this stage until the receiver reaches the patch: keep them in flight
            self._in_flight = [work for work in self._in_flight if not work.is_completed()] + sends
        if not self.pp.is_last_rank:  # a stand-in; the last stage's result is broadcast later
            return named[image_name] if entry is not None else _returns(self.plan, named)
        result = dict(outputs[0] if text_apart else outputs[-1])  # the text stream as its last patch left it
        result[image_name] = torch.cat([o[image_name] for o in outputs[text_apart:]], dim=1)
        if entry is not None:  # as the first block returns it: the joined stream
            return torch.cat([result[entry.text], result[image_name]], dim=1)
        return _returns(self.plan, result)

    # -- patches flowing across steps ----------------------------------------------------------------
    def _flow(self, asynchronous: bool, count: int, size: int) -> _Flow | None:
        """This call's flow, begun at the first asynchronous step the runtime allows one in (see the module docstring)."""
        runtime = get_runtime_state()
        if not asynchronous or self.plan.flow is None or runtime.flow_scheduler is None or runtime.token_split is not None:
            return None
        if self._current is None:
            self._current = _Flow(runtime.step_index)
            if self.pp.is_last_rank:
                local = self._captured[LATENTS].shape
                self._current.schedulers = [
                    patch_copy(runtime.flow_scheduler, functools.partial(_patch_rows, local, slice(p * size, (p + 1) * size)))
                    for p in range(count)]
            runtime.step_result = self._after_step
        return self._current

    def _prediction(self, image: torch.Tensor, named: dict[str, Any]) -> torch.Tensor:
        """A patch's model output from its image stream after the last block: the plan's output modules."""
        for path, arguments in self.plan.flow.output:  # `forward`: without the plan's hooks, which act on the whole output
            image = self._transformer.get_submodule(path).forward(image, *(named[a] for a in arguments))
        return image

    def _step_patch(self, flow: _Flow, p: int, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """Patch p's next latents: its prediction stepped on its own scheduler."""
        scheduler = flow.schedulers[p]
        timestep = scheduler.timesteps[_position(scheduler)]
        return scheduler.step(prediction, timestep, latents, return_dict=False)[0].to(latents.dtype)

    def _after_step(self, latents: torch.Tensor) -> torch.Tensor:
        """What this rank's loop goes on with after a step while patches flow: after the last step, the last
        stage's latents; before, the first stage takes the latents it used this step (for previews: its own
        steps ran on stand-ins), the other stages keep theirs."""
        runtime = get_runtime_state()
        if _position(runtime.flow_scheduler) < len(runtime.flow_scheduler.timesteps):
            inputs = self._current.inputs
            if not self.pp.is_first_rank or not inputs:
                return latents
            mine = torch.cat([inputs[p] for p in sorted(inputs)], dim=1)
            return get_sp_group().all_gather(mine, dim=1).to(latents.dtype)
        self.settle()
        runtime.step_result = None
        return self.pp.broadcast(latents.contiguous(), src=self.pp.world_size - 1)

    def settle(self) -> None:
        """Complete what a flow left in flight: every send, and on the first stage the next step's patch latents the
        last stage sent before a run stopped early (a cancel at a step's end), so the next run's messages line up."""
        if self.pp.is_first_rank and self._current is not None:
            runtime = get_runtime_state()
            if runtime.step_result is not None and 0 < _position(runtime.flow_scheduler) < len(runtime.flow_scheduler.timesteps):
                for latents in self._current.inputs.values():
                    self.pp.recv_prev(torch.empty_like(latents))
        for work in self._in_flight:
            work.wait()
        self._in_flight, self._current = [], None

    def _run_joined(self, forward, joined, parameters: set[str], named: dict[str, Any],
                    state: dict[str, torch.Tensor]) -> dict:
        """One joined block on [text; this patch], from the arguments it shares with the stage's first block,
        the patch's token rows and what the transformer computed for it; the result split into the two streams."""
        image_name = self.plan.carried[0]
        text = state[joined.text]
        kwargs = {k: v for k, v in named.items() if k in parameters}
        kwargs.update({arg: self._captured[arg] for arg in joined.inputs})
        kwargs.update({image_name: torch.cat([text, state[image_name]], dim=1), joined.text: None})
        out = forward(**kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return {**state, image_name: out[:, text.shape[1] :], joined.text: out[:, : text.shape[1]]}

    def _receive(self, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The previous stage's carried streams for this patch, shaped as this stage's own; a stream of no tokens
        (a patch without stand-ins) travels as nothing: gloo aborts the process on some empty messages."""
        buffers = {name: torch.empty_like(template[name], memory_format=torch.contiguous_format) for name in self.plan.carried}
        return {name: self.pp.recv_prev(buffer) if buffer.numel() else buffer for name, buffer in buffers.items()}


def _position(scheduler) -> int:
    """The scheduler's next step within its schedule."""
    return scheduler.step_index - (scheduler.begin_index or 0)


def _last_step(scheduler) -> bool:
    return _position(scheduler) == len(scheduler.timesteps) - 1


def _patch_rows(local: torch.Size, window: slice, tensor: torch.Tensor) -> torch.Tensor | None:
    """A patch's rows of a tensor shaped like the whole latents (this rank's sequence shard, then the patch's
    window of it); None for other tensors."""
    sp = get_sp_group()
    if tensor.shape != (local[0], local[1] * sp.world_size, *local[2:]):
        return None
    return tensor.chunk(sp.world_size, dim=1)[sp.rank_in_group][:, window]


def _signed(run: Callable, like: Callable) -> Callable:
    """`run` with the signature of the block's own forward, so the plan's hooks on a block (Wan's
    `blocks.0` input split) still name its arguments."""

    def forward(*args, **kwargs):
        return run(*args, **kwargs)

    forward.__signature__ = inspect.signature(like)
    return forward


def _capture(store: dict, name: str, module, args, output) -> None:
    store[name] = output


def _returns(plan: PipeFusionPlan, named: dict[str, Any]):
    values = tuple(named.get(n) for n in plan.returns)
    return values if len(values) > 1 else values[0]


def _text_part(text: torch.Tensor | None, keep: int | None) -> torch.Tensor | None:
    """The text stream a patch holds: all of it (`keep` None), or its first `keep` tokens (an image patch's stand-ins)."""
    return text if keep is None or text is None else text[:, :keep]


def _rows(value, rows: TokenRows, text_tokens: int, window: slice, keep: int | None = None):
    """This patch's rows of a per-token input (or of each tensor in a tuple): its image rows and its text rows (all
    of them, `keep` None, or the first `keep`)."""
    if isinstance(value, tuple):
        return tuple(_rows(v, rows, text_tokens, window, keep) if rows.items is None or i in rows.items
                     else (v if keep is None else v.movedim(rows.dim, 0)[:keep].movedim(0, rows.dim))  # a text table
                     for i, v in enumerate(value))
    if rows.ndim is not None and value.ndim != rows.ndim:
        return value
    value = value.movedim(rows.dim, 0)
    keep = text_tokens if keep is None else keep
    if rows.text is TextLayout.PREFIX:
        text, image = value[:text_tokens], value[text_tokens:]
        value = torch.cat([text[:keep], image[window]])
    elif rows.text is TextLayout.SUFFIX:
        image, text = value[: value.shape[0] - text_tokens], value[value.shape[0] - text_tokens :]
        value = torch.cat([image[window], text[:keep]])
    else:
        value = value[window]
    return value.movedim(0, rows.dim)


class _Passthrough(torch.nn.Module):
    """Stands in for a block held by another stage: hands the carried state on unchanged.

    It keeps only the block's argument names, not the block, so the block's weights are freed.
    """

    def __init__(self, plan: PipeFusionPlan, forward: Callable, joined: JoinedStream | None):
        super().__init__()
        self._plan, self._joined = plan, joined
        self._names = [p.name for p in inspect.signature(forward).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        self.forward = _signed(self._hand_on, forward)  # a plan's hook on this block still names its arguments

    def _hand_on(self, *args, **kwargs):
        named = {**dict(zip(self._names, args)), **kwargs}
        return named[self._plan.carried[0]] if self._joined else _returns(self._plan, named)
