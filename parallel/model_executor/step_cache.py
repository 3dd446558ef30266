"""Step caching with diffusers' own hooks, with one decision that every rank shares.

diffusers' first-block cache skips the remaining blocks when mean|r - r_prev| / mean|r_prev| of the first
block's residual r is under the threshold. Under sequence parallelism a rank holds only its tokens, so
the two sums are all-reduced over the ranks that together hold what one single-process forward sees
(sequence parallel, data-parallel replicas) before they are divided: every rank then takes the decision
the single-process model takes. That reduction replaces the hook's metric method and is the only change
to diffusers' hook. TaylorSeer decides from the step count alone, so it needs none; the same seam only
counts its decisions. Sequential CFG parallel needs no reduction either: the pipelines call each guidance
branch in its own cache_context, which keys the hook's state, so a CFG rank keeps the state of its
branch exactly as one process does.

The cache lives for one pipeline call (a job's setting): enabled before, removed after.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..cache_settings import CacheSettings
from ..layout.config import LayoutError
from ..distributed import GroupCoordinator, get_cfg_group, get_dp_group, get_pp_group, get_runtime_state, get_sp_group
from .plans import CfgMode

# The context the cache state is kept under when the pipeline names none (FLUX.1 Kontext): one per call.
DEFAULT_CONTEXT = "default"


@dataclass
class CacheReport:
    """What the cache did in one call: per cache context (guidance branch), True = the full model ran."""

    settings: CacheSettings
    branches_by_name: bool = False  # sequential CFG parallel: each rank runs the branch named for it
    decisions: dict[str, list[bool]] = field(default_factory=dict)
    full: int = 0  # transformer calls of the whole job (every branch), once the call has ended
    cached: int = 0

    def record(self, context: str, full: bool) -> None:
        if self.branches_by_name and context == DEFAULT_CONTEXT:
            raise ValueError(
                "this pipeline calls its guidance branches without naming them (cache_context), so their cache "
                "state cannot be split over CFG parallel ranks; turn CFG parallel off or use --cache none."
            )
        self.decisions.setdefault(context, []).append(full)

    def describe(self) -> str:
        return f"{self.settings.describe()}: {self.full} full model calls, {self.cached} from the cache"


def diffusers_config(settings: CacheSettings):
    """diffusers' own config object for these settings."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if settings.method == "first-block":
        return FirstBlockCacheConfig(threshold=settings.threshold)
    if settings.method == "taylorseer":  # factors in the model's own dtype (diffusers' default bf16 rounds fp32)
        return TaylorSeerCacheConfig(cache_interval=settings.interval, disable_cache_before_step=settings.warmup,
                                     max_order=settings.order, taylor_factors_dtype=None)
    raise ValueError(f"no diffusers cache for method {settings.method!r}")


def metric_groups(cfg: CfgMode) -> list[GroupCoordinator]:
    """The groups whose ranks together hold what one single-process forward sees."""
    groups = [get_sp_group(), get_dp_group()]
    if cfg is CfgMode.BATCHED:  # one call on cat([uncond, cond]): each CFG rank holds half of it
        groups.append(get_cfg_group())
    return [group for group in groups if group.world_size > 1]


def real_tokens(residual: torch.Tensor) -> torch.Tensor:
    """This rank's residual without the padding rows of an uneven token split (they repeat a real token)."""
    split = get_runtime_state().token_split
    if split is None or residual.ndim < 3 or residual.shape[1] != split.length:
        return residual
    return residual.narrow(1, 0, split.sizes[get_sp_group().rank_in_group])


def reduced_relative_change(residual: torch.Tensor, previous: torch.Tensor, groups: list[GroupCoordinator]) -> float:
    """mean|residual - previous| / mean|previous| over every token of the groups' ranks."""
    residual, previous = real_tokens(residual), real_tokens(previous)
    sums = torch.stack([(residual - previous).abs().sum(), previous.abs().sum()]).double()
    for group in groups:
        group.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def _first_block_seam(hook, report: CacheReport, groups: list[GroupCoordinator]) -> None:
    """Replace the FBC head hook's metric by the reduced one, and record each decision."""

    def should_compute(self, residual: torch.Tensor) -> bool:
        state = self.state_manager.get_state()
        if state.head_block_residual is None:
            full = True
        else:
            full = reduced_relative_change(residual, state.head_block_residual, groups) > self.threshold
        report.record(self.state_manager.context.name, full)
        return full

    hook._should_compute_remaining_blocks = types.MethodType(should_compute, hook)


def _taylorseer_seam(hook, report: CacheReport) -> None:
    """Record the decisions of the first TaylorSeer hook (every hooked module decides alike)."""
    measure = hook._measure_should_compute

    def recorded():
        full, state = measure()
        report.record(hook.state_manager.context.name, full)
        return full, state

    hook._measure_should_compute = recorded


def _hooks(transformer: torch.nn.Module, name: str) -> list:
    return [m._diffusers_hook.get_hook(name) for m in transformer.modules()
            if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook(name) is not None]


def install(transformer: torch.nn.Module, settings: CacheSettings, report: CacheReport,
            groups: list[GroupCoordinator]) -> None:
    """diffusers' cache on `transformer` (the unwrapped diffusers model) with the shared decision."""
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    transformer.enable_cache(diffusers_config(settings))
    if settings.method == "first-block":
        _first_block_seam(_hooks(transformer, _FBC_LEADER_BLOCK_HOOK)[0], report, groups)
    else:
        _taylorseer_seam(_hooks(transformer, _TAYLORSEER_CACHE_HOOK)[0], report)


def check_cache(settings: CacheSettings, pipefusion_degree: int, transformer: torch.nn.Module) -> None:
    """The cache needs diffusers' cache support on the model (the first-block cache also its blocks' outputs
    described), and whole steps per forward (PipeFusion runs each step as patches through stale K/V)."""
    if settings.method == "none":
        return
    if why := cache_refusal(type(transformer), settings.method):
        instead = "none" if cache_refusal(type(transformer), "taylorseer") else "taylorseer or --cache none"
        raise ValueError(f"--cache {settings.method}: {why}; use --cache {instead} with this model.")
    if pipefusion_degree > 1:
        raise LayoutError(
            f"--cache {settings.method} does not combine with PipeFusion (pipefusion degree {pipefusion_degree}): "
            "its blocks see one patch at a time; use --cache none, or Ulysses/Ring/CFG parallel instead of PipeFusion."
        )


def cache_refusal(transformer: type, method: str) -> str:
    """Why diffusers' `method` cache cannot hook this transformer class, or "" where it can: no CacheMixin at all
    (Krea 2, FLUX 3), or, for the first-block cache, repeated blocks whose outputs diffusers' block registry does
    not describe (Qwen-Image 2.1: enable_cache would fail inside diffusers on every rank, in words naming no
    option). From the class alone, so that
    --list-supported says what a job is refused."""
    import sys

    from diffusers.hooks._helpers import TransformerBlockRegistry

    if not hasattr(transformer, "enable_cache"):
        return f"diffusers has no cache hooks for {transformer.__name__} (no CacheMixin)"
    if method != "first-block":
        return ""
    unknown = []  # of its repeated blocks (`_repeated_blocks` names embedders too, which that cache never hooks)
    for name in (name for name in getattr(transformer, "_repeated_blocks", ()) if name.endswith("Block")):
        try:
            TransformerBlockRegistry.get(getattr(sys.modules[transformer.__module__], name))
        except (AttributeError, ValueError):
            unknown.append(name)
    if unknown:
        return f"diffusers' first-block cache has no entry for {' and '.join(unknown)} in its block registry"
    return ""


@contextlib.contextmanager
def step_cache(wrappers: list, settings: CacheSettings) -> Iterator[CacheReport]:
    """Enable the cache on each wrapped transformer for one pipeline call, then remove it (pipelines that
    name no cache context run in DEFAULT_CONTEXT).

    `wrappers`: xFuserTransformerBaseWrapper objects (Wan 2.2: both experts, each its own cache).
    """
    from .call_cache import drop

    check_cache(settings, get_pp_group().world_size, wrappers[0].module)
    sequential_cfg = get_cfg_group().world_size > 1 and any(w.plan.cfg is CfgMode.SEQUENTIAL for w in wrappers)
    report = CacheReport(settings, branches_by_name=sequential_cfg)
    modules = [wrapper.module for wrapper in wrappers]
    try:
        for wrapper, module in zip(wrappers, modules):
            drop(module)  # a model calls' cache left by ComfyUI's samplers
            install(module, settings, report, metric_groups(wrapper.plan.cfg))
        with contextlib.ExitStack() as contexts:
            for module in modules:
                contexts.enter_context(module.cache_context(DEFAULT_CONTEXT))
            yield report
        _count(report, sequential_cfg)
    finally:
        for module in modules:
            if module._cache_config is not None:
                module.disable_cache()


def _count(report: CacheReport, sequential_cfg: bool) -> None:
    """The job's full and cached calls; sequential CFG parallel ranks each ran one branch, so they add up."""
    every = [full for calls in report.decisions.values() for full in calls]
    counts = torch.tensor([sum(every), len(every) - sum(every)])
    if sequential_cfg:
        get_cfg_group().all_reduce(counts)
    report.full, report.cached = int(counts[0]), int(counts[1])
