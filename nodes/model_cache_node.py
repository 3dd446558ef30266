"""xDiT Cache (model): the pool's step cache (FBCache, TaylorSeer) on the model calls of ComfyUI's samplers.

xDiT Cache sets the cache of a pool's jobs (xDiT Sampler: whole pipeline calls). Under KSampler the loop runs in
ComfyUI and each evaluation is one model call on the pool, so the cache's state has to outlive a call: the
settings ride on every call (the evaluate message's `cache`), the pool keeps diffusers' hook on its transformer
between them (parallel/model_executor/call_cache.py), and an OUTER_SAMPLE wrapper, as ComfyUI's EasyCache uses,
marks the first call of each sampling run so the pool starts it from a reset state. Every rank takes the same
decision, as in a job.
"""

from __future__ import annotations

import comfy.patcher_extension
from comfy_api.latest import io

from ..parallel.cache_settings import CacheSettings
from .cache_node import XDiTCache
from .lora_patches import UnsupportedPatch
from .model_node import CACHE, PoolTransformer


class SamplingCache:
    """The settings, and the experts (Wan 2.2's two transformers, each its own cache) called so far in this
    sampling run: the first call of each resets its cache (`_new_run` starts a run)."""

    def __init__(self, settings: CacheSettings):
        self.settings, self.called = settings, set()

    def next_call(self, expert: str) -> dict:
        """The call's `cache` (ModelCallCache as a plain map)."""
        plain = {"settings": self.settings.to_params(), "reset": expert not in self.called}
        self.called.add(expert)
        return plain


def _new_run(executor, *args, **kwargs):
    """OUTER_SAMPLE: each sampling run (a KSampler, a second prompt's) starts from a reset cache."""
    executor.class_obj.model_options["transformer_options"][CACHE].called.clear()
    return executor(*args, **kwargs)


class XDiTModelCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        pool_inputs = XDiTCache.define_schema().inputs[1:]  # method, threshold, interval, warmup, order
        return io.Schema(
            node_id="XDiTModelCache",
            display_name="xDiT Cache (model)",
            category="sampling/xDiT",
            description="Step caching on the pool for ComfyUI's samplers (KSampler, SamplerCustomAdvanced) on an xDiT "
                        "MODEL: FBCache (first-block) or TaylorSeer with diffusers' hooks, every rank deciding alike, "
                        "reset at the start of each sampling run.",
            inputs=[io.Model.Input("model", tooltip="A MODEL from Model from xDiT Pool or Load Diffusion Model "
                                                    "(xDiT Pool)."), *pool_inputs],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, method, threshold, interval, warmup, order) -> io.NodeOutput:
        transformer = getattr(model.model, "diffusion_model", None)
        if not isinstance(transformer, PoolTransformer):
            raise UnsupportedPatch("xDiT Cache (model) caches the pool's model calls; this MODEL runs in ComfyUI, so "
                                   "use ComfyUI's EasyCache (or LazyCache) on it instead")
        if why := transformer.pool.status.step_caches.get(method):  # the pool's: ComfyUI imports no diffusers
            raise UnsupportedPatch(f"xDiT Cache (model): --cache {method} on {transformer.pool.pipeline}: {why}")
        patched = model.clone()
        patched.model_options.setdefault("transformer_options", {})[CACHE] = SamplingCache(
            CacheSettings(method, threshold, interval, warmup, order))
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, CACHE, _new_run)
        return io.NodeOutput(patched)
