"""The transformer wrapper: applies its family's ParallelPlan (sequence parallel, PipeFusion stage)
and runs CFG parallel around forward. It is an nn.Module, so pipelines keep treating the wrapped model as a
model; one class serves every family, parametrised by the family's plan (parallel/families/)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ..distributed import get_cfg_group, get_layout, get_pp_group, get_runtime_state, get_sp_group
from .hooks import apply_sequence_plan, as_keyword_arguments, map_first, map_predictions
from .pipefusion import PipeFusionStage, _signed
from .stale_kv import StaleKVCache
from .plans import CfgMode, ParallelPlan
from .wrapper import xFuserBaseWrapper


class xFuserModelBaseWrapper(torch.nn.Module, xFuserBaseWrapper):
    def __init__(self, module: torch.nn.Module):
        torch.nn.Module.__init__(self)
        self.module = module

    def __getattr__(self, name: str) -> Any:
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _first(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, tuple) else output.sample


def _batch_part(value: Any, batch: int, start: int, stop: int) -> Any:
    """Samples start:stop of a per-sample argument (a batched tensor, a list of samples, a dict of them)."""
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value[start:stop]
    if isinstance(value, list) and len(value) == batch:
        return value[start:stop]
    if isinstance(value, dict):
        return {k: _batch_part(v, batch, start, stop) for k, v in value.items()}
    return value


class xFuserTransformerBaseWrapper(xFuserModelBaseWrapper):
    """One class for every family: the family's `plan` (parallel/families/) says what differs."""

    def __init__(self, transformer: torch.nn.Module, plan: ParallelPlan, attention_kernel: str | None = None,
                 reversible: bool = False):
        super().__init__(transformer)
        # with the model's own signature: a pipeline that passes the arguments its forward names (FLUX 3's modular
        # loop) reads them off the wrapper
        self.forward = _signed(self.forward, transformer.forward)
        self.plan = plan
        self._cfg, self._pp = get_cfg_group(), get_pp_group()
        self._handles, self._layers, self._stage = [], [], None
        self._branch: str | None = None
        self._sample: int | None = None  # the sample running alone (_run_per_sample), which keeps its own stale K/V
        self._step_results: dict[int, torch.Tensor] = {}
        if getattr(transformer, "_xdit_partial", False):
            raise ValueError(
                f"this {type(transformer).__name__} lost the blocks of other PipeFusion stages; load it again to wrap it"
            )
        self.module_names = frozenset(name for name, _ in transformer.named_modules())  # before any stage split
        config = get_layout().config
        sp = get_sp_group()
        cache = None
        if self._pp.world_size > 1:
            if self.plan.pipefusion is None:
                why = f" ({self.plan.no_pipefusion})" if self.plan.no_pipefusion else ""
                raise ValueError(f"{type(transformer).__name__} has no PipeFusion plan{why}; set the pipefusion degree "
                                 "to 1 and use Ulysses, Ring, CFG or data parallel")
            cache = StaleKVCache(config.ulysses_degree)
            self._stage = PipeFusionStage(
                transformer, self.plan.pipefusion, self._pp, config.num_patches or self._pp.world_size,
                config.warmup_steps, self._stale_key, keep_other_stages=reversible,
            )
        if sp.world_size > 1 or cache is not None:
            self._handles, self._layers = apply_sequence_plan(transformer, self.plan, sp, attention_kernel, cache)

    def _stale_key(self) -> str:
        """What PipeFusion keeps stale K/V apart by: the guidance branch and, where samples run one by one, the sample."""
        return (self._branch or "default") + ("" if self._sample is None else f"/{self._sample}")

    def unwrap(self) -> torch.nn.Module:
        """Remove every hook and return the diffusers transformer as it was."""
        for handle in self._handles:
            handle.remove()
        for layer in self._layers:
            layer.remove()
        if self._stage is not None:  # unless kept aside, the other stages' blocks are gone: reload for another layout
            self.module._xdit_partial = not self._stage.remove()
        self._handles, self._layers, self._stage = [], [], None
        return self.module

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        """diffusers names each guidance branch's call; sequential CFG parallel needs to know which (a transformer
        without diffusers' cache support keeps no state per name: the name alone)."""
        self._branch = name
        own = getattr(self.module, "cache_context", None)
        try:
            with own(name, **kwargs) if own is not None else contextlib.nullcontext():
                yield
        finally:
            self._branch = None

    @xFuserBaseWrapper.check_parallel_state
    def forward(self, *args, **kwargs):
        if self._cfg.world_size == 1:
            return self._run(*args, **kwargs)
        if self.plan.cfg is CfgMode.BATCHED:
            named = as_keyword_arguments(self.module.forward, args, kwargs)
            if len(named[self.plan.image_input]) % self._cfg.world_size:  # one branch (LTX-2's STG pass): every rank
                return self._run(**named)
            return self._forward_batched_cfg((), named)
        return self._forward_sequential_cfg(args, kwargs)

    @xFuserBaseWrapper.check_parallel_state
    def evaluate(self, **named):
        """One call outside a pipeline's loop (model_call.py): its batch split over the cfg ranks where it
        divides, whatever the plan's CfgMode (a ComfyUI sampler batches cond and uncond in one call)."""
        if self._cfg.world_size > 1 and len(named[self.plan.image_input]) % self._cfg.world_size == 0:
            return self._forward_batched_cfg((), named)
        return self._run(**named)

    def _run(self, *args, **kwargs):
        """The diffusers forward; with PipeFusion, every stage then takes the last stage's output."""
        named = as_keyword_arguments(self.module.forward, args, kwargs)
        samples = named.get(self.plan.image_input)
        if isinstance(samples, list) and len(samples) > 1 and (self._layers or self._stage is not None):
            return self._run_per_sample(named, len(samples))
        output = self.module(*args, **kwargs)
        if self._pp.world_size > 1 and not self._stage.flowed:  # flowing patches reach the first stage themselves
            output = map_first(output, self._from_last_stage)
        return output

    def settle(self) -> None:
        """After a call of the pipeline, also one stopped early: complete what PipeFusion's flow left in flight."""
        if self._stage is not None:
            self._stage.settle()

    def _from_last_stage(self, output):
        """The last stage's output (a tensor, or one per sample: Z-Image), on every stage."""
        if isinstance(output, list):
            return [self._from_last_stage(sample) for sample in output]
        return self._pp.broadcast(output.contiguous(), src=self._pp.world_size - 1)

    def _run_per_sample(self, named: dict, batch: int):
        """Samples given as a list (Z-Image) may differ in length, which the model pads and masks; sequence-
        parallel attention takes no mask, so each sample runs alone (the same result: padding is masked out)."""
        outputs = []
        try:
            for i in range(batch):
                self._sample = i
                outputs.append(self._run(**{k: _batch_part(v, batch, i, i + 1) for k, v in named.items()}))
        finally:
            self._sample = None
        return map_first(outputs[0], lambda _: [sample for output in outputs for sample in _first(output)])

    def _forward_batched_cfg(self, args: tuple, kwargs: dict):
        """The pipeline sends cat([uncond, cond]); each cfg rank runs its half, then both halves are gathered."""
        named = as_keyword_arguments(self.module.forward, args, kwargs)
        batch = len(named[self.plan.image_input])
        rank, size = self._cfg.rank_in_group, self._cfg.world_size
        part = batch // size
        output = self._run(**{k: _batch_part(v, batch, rank * part, (rank + 1) * part) for k, v in named.items()})
        return map_predictions(output, self._gather_batch, self.plan.predictions)

    def _gather_batch(self, mine):
        """Every cfg rank's part of the batch, in rank order (a list of samples stays a list)."""
        if isinstance(mine, list):
            return list(self._cfg.all_gather(torch.stack(mine), dim=0).unbind(0))
        return self._cfg.all_gather(mine, dim=0)

    def empty_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like the output for `hidden_states` (Wan I2V takes 36 channels, returns 16)."""
        if self.plan.output_channels is None:
            return torch.empty_like(hidden_states)
        channels = self.module.config[self.plan.output_channels]
        return hidden_states.new_empty((hidden_states.shape[0], channels, *hidden_states.shape[2:]))

    def _forward_sequential_cfg(self, args: tuple, kwargs: dict):
        """The pipeline calls once per branch (named by cache_context, else in the plan's order). Each cfg
        rank computes only its own branch; the other
        call returns a buffer that is filled in place once the step's last branch has been exchanged
        (the pipeline combines the two predictions only after both calls)."""
        branches = self.plan.cfg_branches
        if self._branch is not None and self._branch not in branches:
            raise RuntimeError(
                f"CFG parallel for {type(self.module).__name__} expects calls inside cache_context({branches[0]!r}) "
                f"and cache_context({branches[1]!r}); got {self._branch!r}"
            )
        # Pipelines that name no branch (FluxKontextPipeline) call them in the plan's order, once each per step.
        index = len(self._step_results) if self._branch is None else branches.index(self._branch)
        if index == self._cfg.rank_in_group:
            output = self._run(*args, **kwargs)
            result = _first(output)
            if self.plan.output_tail:  # the image's tokens, which the pipeline keeps (ParallelPlan.output_tail)
                result = result[:, result.shape[1] - get_runtime_state().image_tokens:]
        else:
            named = as_keyword_arguments(self.module.forward, args, kwargs)
            result = self.empty_output(named[self.plan.image_input])
            if self.plan.output_tail:
                result = result[:, : get_runtime_state().image_tokens]
            output = Transformer2DModelOutput(sample=result) if named.get("return_dict", True) else (result,)
        self._step_results[index] = result
        if index == len(branches) - 1:
            mine = self._step_results[self._cfg.rank_in_group]
            both = self._cfg.all_gather(mine.unsqueeze(0), dim=0)
            for i, tensor in self._step_results.items():
                if i != self._cfg.rank_in_group:
                    tensor.copy_(both[i])
            self._step_results = {}
        return output
