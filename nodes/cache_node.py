"""xDiT Cache: step caching (FBCache, TaylorSeer) for the jobs of the pool it is chained onto.

diffusers' own cache hooks run on every rank, and under sequence parallelism the first-block metric is
reduced over the ranks, so every rank skips the same steps as one process would. A setting of the job:
changing it reloads nothing.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..parallel.cache_settings import METHODS, CacheSettings
from .pool_node import XDiTPoolType

_DEFAULT = CacheSettings()


class XDiTCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTCache",
            display_name="xDiT Cache",
            category="sampling/xDiT",
            description="Step caching on the pool where diffusers has hooks for the model (python -m parallel.run "
                        "--list-supported: its step cache column): FBCache (first-block) or TaylorSeer.",
            inputs=[
                XDiTPoolType.Input("pool", tooltip="The xDiT Pool (or an xDiT LoRA) whose jobs use this cache."),
                io.Combo.Input("method", options=list(METHODS), default="first-block",
                               tooltip="first-block: FBCache, skips the other blocks while the first block's output "
                                       "barely changes; taylorseer: TaylorSeer, predicts the steps between full ones."),
                io.Float.Input("threshold", default=_DEFAULT.threshold, min=0.001, max=10.0, step=0.01,
                               tooltip="first-block: the relative change under which a step comes from the cache "
                                       "(higher: faster, further from the uncached image)."),
                io.Int.Input("interval", default=_DEFAULT.interval, min=1, max=1000,
                             tooltip="taylorseer: a full step every this many steps."),
                io.Int.Input("warmup", default=_DEFAULT.warmup, min=1, max=1000,
                             tooltip="taylorseer: full steps before caching starts."),
                io.Int.Input("order", default=_DEFAULT.order, min=1, max=4, tooltip="taylorseer: Taylor series order."),
            ],
            outputs=[XDiTPoolType.Output(display_name="pool")],
        )

    @classmethod
    def execute(cls, pool, method, threshold, interval, warmup, order) -> io.NodeOutput:
        return io.NodeOutput(pool.with_cache(CacheSettings(method, threshold, interval, warmup, order).to_params()))
