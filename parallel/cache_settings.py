"""Step-cache settings of one job: which diffusers cache hook, and its knobs.

Plain data (no torch, no diffusers), so the ComfyUI process, the pool and contract E share it; the
engine turns it into diffusers' own cache config (model_executor/step_cache.py). Its fields are declared
once (parallel/fields.py): the wire's `cache` map, its checks and the `--cache*` flags all come from them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .fields import Flag, add_flags, declared, from_flags, from_plain, to_plain

# Names as ComfyUI users know them (FBCache, TaylorSeer), spelled like the CLI flag values.
METHODS = ("none", "first-block", "taylorseer")


def _method(name: str, value: str) -> None:
    if value not in METHODS:
        raise ValueError(f"{name} {value!r} is not one of {list(METHODS)}")


@dataclass(frozen=True)
class CacheSettings:
    """method: a name in METHODS. threshold (first-block): the relative change of the first block's
    residual under which the other blocks are skipped. interval, warmup, order (taylorseer): a full step
    every `interval` steps after `warmup` full steps, predicted in between by a Taylor series of `order`."""

    method: str = declared("none", check=_method, flag=Flag(
        "--cache", choices=METHODS, help="first-block: FBCache (skip the other blocks while the first block's "
        "residual barely changes); taylorseer: TaylorSeer (predict steps between full ones)"))
    threshold: float = declared(0.05, minimum=0.0, maximum=10.0, above_minimum=True, flag=Flag(
        "--cache-threshold", help="first-block: relative residual change under which a step is served from the cache"))
    interval: int = declared(5, minimum=1, maximum=1000,
                             flag=Flag("--cache-interval", help="taylorseer: a full step every N steps"))
    # at least 1: diffusers' hook would predict the first step from nothing (its own run fails mid-job)
    warmup: int = declared(3, minimum=1, maximum=1000,
                           flag=Flag("--cache-warmup", help="taylorseer: full steps before caching"))
    order: int = declared(1, minimum=1, maximum=4, flag=Flag("--cache-order", help="taylorseer: Taylor series order"))

    @classmethod
    def from_params(cls, params: dict) -> "CacheSettings":
        """The settings in a plain map (the wire's `cache`), validated: one clear error per problem."""
        return from_plain(cls, params, "cache")

    def to_params(self) -> dict:
        """The plain map `from_params` reads; empty when no cache is asked for."""
        return {} if self.method == "none" else {"method": self.method, **to_plain(self)}

    def describe(self) -> str:
        if self.method == "first-block":
            return f"first-block cache (threshold {self.threshold:g})"
        if self.method == "taylorseer":
            return f"TaylorSeer cache (interval {self.interval}, warm-up {self.warmup}, order {self.order})"
        return "no cache"


@dataclass(frozen=True)
class ModelCallCache:
    """A model call's step cache (ComfyUI's samplers through xDiT Model): its settings, and `reset`, set on the
    first call of each sampling run, so a run never starts from the state an earlier run left."""

    settings: CacheSettings = declared(CacheSettings())
    reset: bool = declared(False)


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """`--cache` and its settings, shared by contract E and the pool CLI."""
    add_flags(parser.add_argument_group("step cache (diffusers' cache hooks; every rank takes the same decision)"),
              CacheSettings)


def cache_from_args(args: argparse.Namespace) -> CacheSettings:
    return from_flags(CacheSettings, args)
