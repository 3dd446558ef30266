"""Step-cache settings of one job: which diffusers cache hook, and its knobs.

Plain data (no torch, no diffusers), so the ComfyUI process, the pool and contract E share it; the
engine turns it into diffusers' own cache config (model_executor/step_cache.py). A job's `cache` map on
the wire is `to_params()`; `from_params` checks it once.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Any

# Names as ComfyUI users know them (FBCache, TaylorSeer), spelled like the CLI flag values.
METHODS = ("none", "first-block", "taylorseer")


@dataclass(frozen=True)
class CacheSettings:
    """method: a name in METHODS. threshold (first-block): the relative change of the first block's
    residual under which the other blocks are skipped. interval, warmup, order (taylorseer): a full step
    every `interval` steps after `warmup` full steps, predicted in between by a Taylor series of `order`."""

    method: str = "none"
    threshold: float = 0.05
    interval: int = 5
    warmup: int = 3
    order: int = 1

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "CacheSettings":
        """The settings in a plain map (the wire's `cache`), validated: one clear error per problem."""
        from .request import Field, check_fields

        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known, key=str)
        if unknown:
            raise ValueError(f"cache does not take {unknown}; it takes {sorted(known)}")
        try:
            check_fields({
                "method": Field((str,), False),
                "threshold": Field((int, float), False, 0.0, 10.0, above_minimum=True),
                "interval": Field((int,), False, 1, 1000),
                "warmup": Field((int,), False, 0, 1000),
                "order": Field((int,), False, 1, 4),
            }, params)
        except ValueError as error:
            raise ValueError(f"cache {error}") from None
        if params.get("method", "none") not in METHODS:
            raise ValueError(f"cache method {params['method']!r} is not one of {list(METHODS)}")
        values = dict(params)
        if "threshold" in values:
            values["threshold"] = float(values["threshold"])
        return cls(**values)

    def to_params(self) -> dict[str, Any]:
        """The plain map `from_params` reads; empty when no cache is asked for."""
        return {} if self.method == "none" else asdict(self)

    def describe(self) -> str:
        if self.method == "first-block":
            return f"first-block cache (threshold {self.threshold:g})"
        if self.method == "taylorseer":
            return f"TaylorSeer cache (interval {self.interval}, warm-up {self.warmup}, order {self.order})"
        return "no cache"


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """`--cache` and its settings, shared by contract E and the pool CLI."""
    default = CacheSettings()
    group = parser.add_argument_group("step cache (diffusers' cache hooks; every rank takes the same decision)")
    group.add_argument("--cache", choices=METHODS, default="none",
                       help="first-block: FBCache (skip the other blocks while the first block's residual barely "
                            "changes); taylorseer: TaylorSeer (predict steps between full ones)")
    group.add_argument("--cache-threshold", type=float, default=default.threshold,
                       help="first-block: relative residual change under which a step is served from the cache")
    group.add_argument("--cache-interval", type=int, default=default.interval, help="taylorseer: a full step every N steps")
    group.add_argument("--cache-warmup", type=int, default=default.warmup, help="taylorseer: full steps before caching")
    group.add_argument("--cache-order", type=int, default=default.order, help="taylorseer: Taylor series order")


def cache_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The request's `cache` map from the flags of `add_cache_arguments` (empty for --cache none)."""
    return CacheSettings(args.cache, args.cache_threshold, args.cache_interval, args.cache_warmup,
                         args.cache_order).to_params()
