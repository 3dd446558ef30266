"""SampleRequest (parallel/request.py): validates once with one clear error per problem, checks the family's
call map against its declaration, and builds the pipeline keyword arguments the hand-written mappings of
jobs.py / rank.py / run.py built before (and the ones rank.py dropped: num_frames)."""

from __future__ import annotations

import argparse

import pytest
import torch

from parallel.call_parameters import CallParameter
from parallel.request import SampleRequest, add_request_arguments, parse_call, request_from_args

BASE = {"steps": 4, "guidance_scale": 4.5, "height": 64, "width": 48}
# As the Wan and Flux wrappers declare them (their declarations are checked in test_engine_video / test_pool_video).
WAN = {
    "num_frames": CallParameter(int, "video frames", 1, 10_000),
    "guidance_scale_2": CallParameter(float, "low-noise expert's guidance", 0.0, 100.0),
}
FLUX = {"true_cfg_scale": CallParameter(float, "real CFG", 0.0, 100.0)}


def old_job_kwargs(params: dict, inputs: dict) -> dict:
    """workers/rank/runner.py's mapping before SampleRequest (family scalars were top-level params then)."""
    extra = {"true_cfg_scale": params["true_cfg_scale"]} if "true_cfg_scale" in params else {}
    return {
        **inputs,
        "num_inference_steps": params["steps"],
        "guidance_scale": float(params["guidance_scale"]),
        "height": params["height"],
        "width": params["width"],
        **({"num_frames": params["num_frames"]} if "num_frames" in params else {}),
        **extra,
    }


@pytest.mark.parametrize(
    "family, declared",
    [({}, None), ({"true_cfg_scale": 2.5}, FLUX), ({"num_frames": 9}, WAN), ({"guidance_scale": 7}, None)],
)
def test_pipeline_kwargs_equal_the_old_mapping(family, declared):
    inputs = {"latents": torch.ones(1, 4, 8, 6), "prompt_embeds": torch.zeros(1, 3, 8)}
    old = {**BASE, **family}
    common = {k: v for k, v in old.items() if k in BASE}
    call = {k: v for k, v in old.items() if k not in BASE}
    request = SampleRequest.from_params({**common, **({"call": call} if call else {})}, declared)
    kwargs = request.pipeline_kwargs(inputs)
    expected = old_job_kwargs(old, inputs)
    assert kwargs.keys() == expected.keys()
    for name, value in expected.items():
        assert kwargs[name] is value if isinstance(value, torch.Tensor) else (kwargs[name] == value and type(kwargs[name]) is type(value))


def test_the_wan22_expert_guidance_reaches_the_pipeline_arguments():
    """What no hand mapping passed before: Wan 2.2's guidance_scale_2 (and num_frames on the pool path)."""
    request = SampleRequest.from_params({**BASE, "call": {"num_frames": 9, "guidance_scale_2": 3}}, WAN, "WanPipeline")
    kwargs = request.pipeline_kwargs({})
    assert kwargs["num_frames"] == 9 and kwargs["guidance_scale_2"] == 3.0 and type(kwargs["guidance_scale_2"]) is float


def test_to_params_round_trips_and_leaves_defaults_out():
    assert SampleRequest.from_params(BASE).to_params() == {**BASE, "guidance_scale": 4.5}
    full = {**BASE, "denoise": 0.5, "call": {"num_frames": 9}}
    request = SampleRequest.from_params(full, WAN)
    assert request.to_params() == full
    assert SampleRequest.from_params(request.to_params(), WAN) == request


@pytest.mark.parametrize(
    "change, message",
    [
        ({"steps": None}, "needs 'steps'"),
        ({"height": None}, "needs 'height'"),
        ({"steps": "4"}, "steps must be int, not str"),
        ({"steps": 4.0}, "steps must be int, not float"),
        ({"width": True}, "width must be int, not bool"),
        ({"guidance_scale": "7"}, "guidance_scale must be int or float, not str"),
        ({"guidance_scale": float("nan")}, "guidance_scale must be finite"),
        ({"steps": 0}, "steps is 0; use 1 to 1000"),
        ({"steps": 1001}, "steps is 1001; use 1 to 1000"),
        ({"height": 7}, "height is 7; use 8 to 16384"),
        ({"width": 16385}, "width is 16385; use 8 to 16384"),
        ({"denoise": 0}, "denoise is 0; use a value above 0 and at most 1"),
        ({"denoise": 1.5}, "denoise is 1.5; use a value above 0 and at most 1"),
        ({"sampler": "euler"}, "a sample request does not take ['sampler']; it takes ["),
        ({"true_cfg_scale": 2.0}, "a sample request does not take ['true_cfg_scale']"),
        ({"call": [1]}, "call must be dict, not list"),
        ({"call": {"true_cfg_scale": "2"}}, "call true_cfg_scale must be int or float, not str"),
        ({"call": {"true_cfg_scale": float("inf")}}, "call true_cfg_scale must be finite"),
        ({"call": {1: 2.0}}, "call parameter names must be strings, not int"),
    ],
)
def test_each_problem_is_one_clear_error(change, message):
    params = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ValueError) as caught:
        SampleRequest.from_params(params)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "call, declared, message",
    [
        ({"true_cfg_scale": 2.0}, WAN, "WanPipeline does not take true_cfg_scale; it takes guidance_scale_2, num_frames"),
        ({"num_frames": 9}, {}, "WanPipeline does not take num_frames; it takes no family parameters"),
        ({"num_frames": 9.0}, WAN, "num_frames must be an integer, not 9.0"),
        ({"num_frames": 0}, WAN, "num_frames is 0; use 1 to 10000"),
        ({"guidance_scale_2": 101}, WAN, "guidance_scale_2 is 101; use 0.0 to 100.0"),
        ({"true_cfg_scale": -1}, FLUX, "true_cfg_scale is -1; use 0.0 to 100.0"),
    ],
)
def test_the_call_map_is_checked_against_the_family(call, declared, message):
    params = {**BASE, "call": call}
    SampleRequest.from_params(params)  # without the family only the values' kinds are judged (the wire)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SampleRequest.from_params(params, declared, "WanPipeline")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_request_arguments(parser)
    return parser


def test_flags_build_the_request_with_shorthands_and_call():
    args = parser().parse_args(["--steps", "3", "--height", "48", "--width", "64", "--num-frames", "9",
                                "--call", "guidance_scale_2=2.5", "--true-cfg-scale", "2"])
    request = request_from_args(args)
    assert request == SampleRequest(3, 4.5, 48, 64, 1.0, {"guidance_scale_2": 2.5, "true_cfg_scale": 2.0, "num_frames": 9})
    with pytest.raises(ValueError, match="WanPipeline does not take true_cfg_scale"):
        request_from_args(args, WAN, "WanPipeline")
    plain = request_from_args(parser().parse_args([]))
    assert plain.to_params() == {"steps": 20, "guidance_scale": 4.5, "height": 1024, "width": 1024}


def test_call_flag_values():
    assert parse_call("num_frames=9") == ("num_frames", 9) and isinstance(parse_call("num_frames=9")[1], int)
    assert parse_call("guidance_scale_2=2.5") == ("guidance_scale_2", 2.5)
    for bad in ("num_frames", "=3", "num_frames=nine"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_call(bad)
    with pytest.raises(SystemExit):
        parser().parse_args(["--call", "num_frames"])


def test_masks_pass_as_integers_and_other_tensors_must_be_floating_point():
    """HunyuanVideo 1.5's glyph-text mask is `prompt_embeds_mask_2`: a mask too, though its name ends in a number."""
    from parallel.request import check_tensor_values

    masks = {name: torch.ones(1, 4, dtype=torch.long) for name in ("prompt_embeds_mask", "negative_prompt_embeds_mask_2")}
    check_tensor_values({**masks, "prompt_embeds_2": torch.zeros(1, 4, 8)})
    with pytest.raises(ValueError, match="prompt_embeds_2 is int64; send floating-point values"):
        check_tensor_values({**masks, "prompt_embeds_2": torch.zeros(1, 4, 8, dtype=torch.long)})
