"""One sampling request, the same on every hop: contract E, the pool CLI, the wire, rank 0, every rank.

`SampleRequest.from_params` validates a plain map once (one clear error per problem) and
`pipeline_kwargs` builds the pipeline's keyword arguments once, so no layer maps request fields to
pipeline arguments by hand. Family scalars (Flux's `true_cfg_scale`, Wan's `num_frames`, Wan 2.2's
`guidance_scale_2`) travel in `call`, a generic map: without a declaration it is only checked to be
names with finite numbers (what the wire can judge); with the wrapper's `call_parameters` it is checked
against the family (call_parameters.py).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .cache_settings import CacheSettings, add_cache_arguments, cache_from_args
from .call_parameters import CallParameter, check_call


@dataclass(frozen=True)
class Field:
    """A common request field: its wire types, whether it is required, and its range."""

    types: tuple[type, ...]
    required: bool
    minimum: float | None = None
    maximum: float | None = None
    above_minimum: bool = False  # the minimum itself is excluded (denoise > 0)

    def check(self, name: str, value: Any) -> None:
        if isinstance(value, bool) and bool not in self.types or not isinstance(value, self.types):
            raise ValueError(f"{name} must be {' or '.join(t.__name__ for t in self.types)}, not {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be finite")
        low, high = self.minimum, self.maximum
        if low is None or high is None:
            return
        if (value <= low if self.above_minimum else value < low) or value > high:
            span = f"a value above {low:g} and at most {high:g}" if self.above_minimum else f"{low:g} to {high:g}"
            raise ValueError(f"{name} is {value}; use {span}")


def check_fields(fields: dict[str, Field], params: dict[str, Any]) -> None:
    """Every field present if required, of its types and in its range (keys beyond `fields` are the caller's)."""
    for name, spec in fields.items():
        if name not in params:
            if spec.required:
                raise ValueError(f"needs {name!r}")
            continue
        spec.check(name, params[name])


_NUMBER = (int, float)
FIELDS: dict[str, Field] = {
    "steps": Field((int,), True, 1, 1000),
    "guidance_scale": Field(_NUMBER, True),
    "height": Field((int,), True, 8, 16384),
    "width": Field((int,), True, 8, 16384),
    "denoise": Field(_NUMBER, False, 0.0, 1.0, above_minimum=True),  # below 1: img2img from init_latents
    "call": Field((dict,), False),  # the family's own scalars, checked against its call_parameters
    "cache": Field((dict,), False),  # step cache settings (cache_settings.py)
}


def _check_call_values(call: dict[str, Any]) -> None:
    """What can be said of a call map without the family: string names, finite numbers."""
    for name, value in call.items():
        if not isinstance(name, str):
            raise ValueError(f"call parameter names must be strings, not {type(name).__name__}")
        Field(_NUMBER, False).check(f"call {name}", value)


@dataclass(frozen=True)
class SampleRequest:
    """What one sampling job asks for, whoever sends it; `call` holds the family's own scalars."""

    steps: int
    guidance_scale: float
    height: int
    width: int
    denoise: float = 1.0
    call: dict[str, int | float] = field(default_factory=dict)
    cache: CacheSettings = CacheSettings()

    @classmethod
    def from_params(cls, params: dict[str, Any], declared: dict[str, CallParameter] | None = None,
                    model: str = "this model") -> "SampleRequest":
        """The request in `params`, validated; `declared`: the family's call_parameters, if known here."""
        unknown = sorted(set(params) - set(FIELDS), key=str)
        if unknown:
            raise ValueError(f"a sample request does not take {unknown}; it takes {sorted(FIELDS)}")
        check_fields(FIELDS, params)
        call = dict(params.get("call", {}))
        _check_call_values(call)
        if declared is not None:
            call = check_call(declared, call, model)
        return cls(params["steps"], float(params["guidance_scale"]), params["height"], params["width"],
                   float(params.get("denoise", 1.0)), call, CacheSettings.from_params(params.get("cache", {})))

    def to_params(self) -> dict[str, Any]:
        """The plain map `from_params` reads (what travels on the wire), defaults left out."""
        params = asdict(self)
        if self.denoise == 1.0:
            del params["denoise"]
        if not self.call:
            del params["call"]
        params["cache"] = self.cache.to_params()
        if not params["cache"]:
            del params["cache"]
        return params

    def pipeline_kwargs(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The diffusers pipeline's keyword arguments for this request and its tensor inputs (their values
        checked: see check_tensor_values)."""
        check_tensor_values(tensors)
        return {
            **tensors,
            "num_inference_steps": self.steps,
            "guidance_scale": self.guidance_scale,
            "height": self.height,
            "width": self.width,
            **self.call,
            **({STEP_CACHE: self.cache} if self.cache.method != "none" else {}),
        }


def check_tensor_values(tensors: dict[str, Any]) -> None:
    """Refuse, before any compute, values no pipeline can use: latents, embeddings and images that are not
    floating point (a cast would silently change them), non-finite values (the result would be NaN),
    embeddings of no token. Masks (`*_mask`, `*_mask_2`) are integer or boolean and pass as they are."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or name.rstrip("_0123456789").endswith("_mask"):
            continue
        if not tensor.is_floating_point():
            raise ValueError(f"{name} is {str(tensor.dtype).removeprefix('torch.')}; send floating-point values "
                             "(float32, bfloat16 or float16)")
        # A finite sum means every value is finite (a NaN or an infinity makes the sum one), 25x cheaper than
        # testing each value; only a sum that is not finite (or overflows) is looked at value by value.
        finite = torch.isfinite(tensor.sum()) or torch.isfinite(tensor)
        if not finite.all():
            raise ValueError(f"{name} has {int((~finite).sum())} NaN or infinite values of {tensor.numel()}; "
                             "send finite values")
        if name.endswith("prompt_embeds") and tensor.ndim == 3 and tensor.shape[1] == 0:
            raise ValueError(f"{name} has no tokens; encode the prompt with this model's text encoders "
                             "(an empty prompt still has its padding and end tokens)")


# The pipeline wrapper's key for the job's step cache (it pops it before diffusers sees the arguments).
STEP_CACHE = "_step_cache"


def parse_call(text: str) -> tuple[str, int | float]:
    """`NAME=VALUE` of `--call`: an integer when it reads as one, else a float."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--call takes NAME=VALUE (e.g. guidance_scale_2=3.0), not {text!r}")
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            continue
    raise argparse.ArgumentTypeError(f"--call {name} needs a number, not {value!r}")


# Shorthands for family scalars that contract E and the pool CLI have always taken.
CALL_SHORTHANDS = {
    "true_cfg_scale": dict(type=float, help="Flux: real CFG with negative embeds (shorthand for --call true_cfg_scale=X)"),
    "num_frames": dict(type=int, help="video (Wan): frames, 4k+1; default: as many as the latents hold"),
}


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The request's flags, shared by contract E and `python -m workers sample`."""
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    for name, options in CALL_SHORTHANDS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", default=None, **options)
    parser.add_argument("--call", type=parse_call, action="append", default=[], metavar="NAME=VALUE",
                        help="a family's own call parameter (e.g. guidance_scale_2=3.0 for Wan 2.2); repeatable")
    add_cache_arguments(parser)


def request_from_args(args: argparse.Namespace, declared: dict[str, CallParameter] | None = None,
                      model: str = "this model") -> SampleRequest:
    """The request the flags of `add_request_arguments` describe, validated."""
    call = dict(args.call)
    for name in CALL_SHORTHANDS:
        if getattr(args, name) is not None:
            call[name] = getattr(args, name)
    params = {"steps": args.steps, "guidance_scale": args.guidance_scale, "height": args.height, "width": args.width}
    cache = cache_from_args(args)
    params = {**params, **({"call": call} if call else {}), **({"cache": cache} if cache else {})}
    return SampleRequest.from_params(params, declared, model)
