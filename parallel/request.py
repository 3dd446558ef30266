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
from dataclasses import dataclass, replace
from typing import Any

from .cache_settings import CacheSettings, add_cache_arguments, cache_from_args
from .call_parameters import CallParameter, check_call
from .fields import Flag, add_flags, declared, from_flags, from_plain, to_plain


@dataclass(frozen=True)
class SampleRequest:
    """What one sampling job asks for, whoever sends it; `call` holds the family's own scalars."""

    steps: int = declared(minimum=1, maximum=1000, flag=Flag("--steps", default=20))
    guidance_scale: float = declared(flag=Flag("--guidance-scale", default=4.5))
    height: int = declared(minimum=8, maximum=16384, flag=Flag("--height", default=1024))
    width: int = declared(minimum=8, maximum=16384, flag=Flag("--width", default=1024))
    denoise: float = declared(1.0, minimum=0.0, maximum=1.0, above_minimum=True)  # below 1: img2img from init_latents
    call: dict[str, int | float] = declared(factory=dict)  # the family's own scalars, checked against its call_parameters
    cache: CacheSettings = declared(CacheSettings())  # step cache settings (cache_settings.py)

    @classmethod
    def from_params(cls, params: dict[str, Any], declared: dict[str, CallParameter] | None = None,
                    model: str = "this model") -> "SampleRequest":
        """The request in `params`, validated; `declared`: the family's call_parameters, if known here."""
        return from_plain(cls, params, "a sample request").for_family(declared, model)

    def for_family(self, declared: dict[str, CallParameter] | None, model: str = "this model") -> "SampleRequest":
        """This request with its call map checked against what the family of `model` declares (None: unknown
        here, only the values' kinds are judged, as the wire does)."""
        return self if declared is None else replace(self, call=check_call(declared, self.call, model))

    def to_params(self) -> dict[str, Any]:
        """The plain map `from_params` reads (what travels on the wire), defaults left out."""
        return to_plain(self)

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


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA of a job: its file on the pool's machine, its strength, and the expert it goes into."""

    path: str = declared()
    strength: float = declared()
    # "transformer" / "transformer_2" (Wan 2.2 A14B's low-noise expert) / "transformer_ref" (MiniMax-H3's reference
    # partition: the file's `transformer.` weights go there); "": every expert
    expert: str = declared("")


def check_tensor_values(tensors: dict[str, Any]) -> None:
    """Refuse, before any compute, values no pipeline can use: latents, embeddings and images that are not
    floating point (a cast would silently change them), non-finite values (the result would be NaN),
    embeddings of no token. Masks (`*_mask`, `*_mask_2`) and per-token tags (MiniMax-H3's `text_token_tags`: each
    token's modality) are integer or boolean and pass as they are."""
    import torch  # here: the request's plain fields travel through processes that never hold a tensor

    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or name.rstrip("_0123456789").endswith(("_mask", "_tags")):
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
    add_flags(parser, SampleRequest)
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
    request = from_flags(SampleRequest, args, "a sample request", call=call, cache=cache_from_args(args))
    return request.for_family(declared, model)
