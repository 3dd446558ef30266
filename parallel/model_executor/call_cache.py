"""The step cache across the model calls of one sampling run (ComfyUI's samplers through xDiT Model).

A job's cache lives for one pipeline call (step_cache.step_cache). A model call is one step of a loop that
runs in ComfyUI, so here diffusers' hook stays on the transformer from call to call, keeping its state as the
pipeline's loop would, and is enabled afresh (its state reset) when the call says a new sampling run starts
(ModelCallCache.reset) or asks for other settings, and removed when a call asks for none. The decision is
shared by every rank as in a job: the first-block metric is reduced over the ranks that hold parts of the
call's batch and tokens (a batch run whole on several ranks adds equal parts to both sums: the same ratio).
ComfyUI batches cond and uncond into one call, so the state is one context over that batch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..cache_settings import CacheSettings, ModelCallCache
from ..distributed import get_pp_group
from .plans import CfgMode
from .step_cache import DEFAULT_CONTEXT, CacheReport, check_cache, install, metric_groups

HELD = "_xdit_call_cache"  # the diffusers model's attribute: the CacheReport of the model calls' cache it carries


def drop(module: torch.nn.Module) -> None:
    """Remove the model calls' cache from `module`, if it carries one (before a job enables its own)."""
    if getattr(module, HELD, None) is not None:
        module.disable_cache()
        setattr(module, HELD, None)


def check(module: torch.nn.Module, settings: CacheSettings) -> None:
    """Raise, before any rank computes, where diffusers has no hook for the method on this model."""
    check_cache(settings, get_pp_group().world_size, module)


@contextlib.contextmanager
def call_cache(wrapper, cache: ModelCallCache) -> Iterator[CacheReport | None]:
    """Around one model call on `wrapper` (the xFuser transformer wrapper): its cache, kept since the run began.
    Yields the run's report so far (None without a cache)."""
    module = wrapper.module
    held: CacheReport | None = getattr(module, HELD, None)
    if held is not None and (cache.reset or held.settings != cache.settings):
        drop(module)
        held = None
    if cache.settings.method == "none":
        yield None
        return
    if held is None:
        check(module, cache.settings)
        held = CacheReport(cache.settings)
        install(module, cache.settings, held, metric_groups(CfgMode.BATCHED))
        setattr(module, HELD, held)
    with module.cache_context(DEFAULT_CONTEXT):
        yield held
    calls = held.decisions.get(DEFAULT_CONTEXT, [])
    held.full, held.cached = sum(calls), len(calls) - sum(calls)
