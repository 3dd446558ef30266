"""The pool's wire format (workers/wire/protocol.py) under fuzzing: decode returns a well-formed message or
raises ProtocolError, whatever the bytes."""

from __future__ import annotations

import math

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol_helpers import (
    CLIENT_TYPES,
    SUBMIT_PARAMS,
    minimal_params,
    on_the_wire,
    pack,
    random_bytes,
    random_tensor,
    raw_bytes,
)
from workers.wire import protocol
from parallel.fields import wire_fields
from workers.wire.framing import DTYPE_NAMES, DTYPES
from workers.wire.messages import CLIENT_KINDS
from workers.wire.protocol import (
    CLIENT_MESSAGES,
    MAX_DIMS,
    MAX_PROMPT_CHARS,
    PROTOCOL_VERSION,
    SERVER_MESSAGES,
    Message,
    ProtocolError,
    decode,
    encode,
)


def check_decode(frames, from_client: bool):
    """decode returns a well-formed Message or raises ProtocolError; nothing else."""
    try:
        message = decode(frames, from_client=from_client)
    except ProtocolError as error:
        text = str(error)
        assert text
        if from_client:
            assert "\n" not in text, "errors go back to the client as one line"
        return None
    assert isinstance(message, Message)
    assert message.type in (CLIENT_MESSAGES if from_client else SERVER_MESSAGES)
    assert isinstance(message.job, str) and isinstance(message.params, dict)
    assert len(message.tensors) == len(frames) - 1
    for (name, tensor), frame in zip(message.tensors.items(), frames[1:]):
        assert isinstance(name, str) and isinstance(tensor, torch.Tensor)
        assert tensor.dtype in DTYPE_NAMES and tensor.dim() <= MAX_DIMS
        assert raw_bytes(tensor) == bytes(frame)
        if from_client:
            assert name in CLIENT_KINDS[message.type].tensor_names()
    if from_client:
        schema = wire_fields(CLIENT_KINDS[message.type])
        assert set(message.params) <= {f.name for f in schema}
        assert all(f.required <= (f.name in message.params) for f in schema)
        assert isinstance(message.body, CLIENT_KINDS[message.type])
    if from_client and message.type == "submit":
        assert 1 <= message.params["steps"] <= 1000
    if from_client and message.type == "encode":
        assert len(message.params["prompt"]) <= MAX_PROMPT_CHARS
    return message


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=5), st.booleans())
def test_fuzz_arbitrary_frames(frames, from_client):
    check_decode(frames, from_client)


@FUZZ
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=5), st.booleans())
def test_fuzz_msgpack_prefixed_frames(frames, from_client):
    """Random bytes after a msgpack map prefix, so the fuzz gets past the first byte more often."""
    frames[0] = bytes([0x80 | (len(frames[0]) % 16)]) + frames[0]
    check_decode(frames, from_client)


# Structured headers: arbitrary msgpack values mixed with fields that look right. `mostly` keeps most
# examples plausible at each level so the fuzz reaches the later checks instead of dying at the version.


def mostly(good, bad, weight: int = 4):
    """`good` about weight times as often as `bad` (one_of drops repeated branches, so it cannot weight)."""
    return st.sampled_from([True] * weight + [False]).flatmap(lambda plain: good if plain else bad)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-3, 20),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=12),
)
rare_ext = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)) | st.builds(
    msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999)
)
keys = st.one_of(
    st.text(max_size=8),
    st.binary(max_size=4),
    st.sampled_from(["v", "type", "job", "params", "tensors", "name", "dtype", "shape", "steps", "height"]),
)
anything = st.recursive(
    mostly(leaves, rare_ext, weight=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=10,
)
param_values = st.one_of(
    st.integers(-2, 1002), st.integers(0, 20000), st.floats(), st.booleans(), st.text(max_size=5), anything
)
near_miss_dims = st.lists(
    st.sampled_from([0, 1, 3, -1, 2**21, 2**26, protocol.MAX_FRAME_BYTES + 1, 2**64 - 1, True, 1.0, None]),
    max_size=MAX_DIMS + 1,
)
good_job = st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True) | st.just("")
good_submit_params = st.fixed_dictionaries(
    {
        "steps": st.integers(1, 1000),
        "guidance_scale": st.floats(-10, 10) | st.integers(-5, 5),
        "height": st.integers(8, 16384),
        "width": st.integers(8, 16384),
    },
    optional={
        "call": st.dictionaries(
            st.sampled_from(["true_cfg_scale", "num_frames", "guidance_scale_2"]) | st.text(max_size=8),
            st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**63), 2**63),
            max_size=3,
        ),
        "scheduler": st.text(max_size=8),
        "preview": st.booleans(),
    },
)
CORRUPTIONS = ["v", "type", "job", "params", "tensors", "drop_key", "extra_key", "param_value", "param_key",
               "drop_param", "spec", "spec_field", "spec_key", "shape", "shape_dim", "shape_extreme", "frame_size",
               "frame_count"]


@st.composite
def structured_cases(draw):
    """A valid header for a random message type, then 0-3 corruptions of its fields and frames."""
    from_client = draw(st.booleans())
    if not draw(st.integers(0, 15)):  # now and then a header that is any msgpack value at all
        value = draw(anything | st.dictionaries(keys, anything, max_size=6))
        return [pack(value), *draw(st.lists(st.binary(max_size=32), max_size=3))], from_client
    kind = draw(st.sampled_from(CLIENT_TYPES if from_client else SERVER_MESSAGES))
    if from_client and kind == "submit":
        params = draw(good_submit_params)
    elif from_client and kind == "encode":
        params = {"prompt": draw(st.text(max_size=40) | st.just("x" * MAX_PROMPT_CHARS))}
    elif from_client:
        params = minimal_params(kind)
    else:
        params = draw(st.dictionaries(st.text(max_size=8), anything, max_size=4))
    accepted = CLIENT_KINDS[kind].tensor_names() if from_client else ()
    if from_client and not accepted:
        names = []
    elif from_client:  # every kind's own tensors: submit's job inputs, evaluate's model call, decode's, encode's
        names = draw(st.lists(st.sampled_from(accepted), unique=True, max_size=4))
    else:
        names = draw(st.lists(st.text(max_size=8), unique=True, max_size=4))
    specs, frames = [], []
    for name in names:
        dtype = draw(st.sampled_from(list(DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=MAX_DIMS))
        specs.append({"name": name, "dtype": dtype, "shape": shape})
        size = math.prod(shape) * DTYPES[dtype].itemsize
        frames.append(bytearray(random_bytes(draw(st.integers(0, 2**32 - 1)), size)))
    value = {"v": PROTOCOL_VERSION, "type": kind, "job": draw(good_job), "params": params, "tensors": specs}

    for corruption in draw(st.lists(st.sampled_from(CORRUPTIONS), max_size=3)):
        if corruption in ("v", "type", "job", "params", "tensors"):
            value[corruption] = draw(anything)
        elif corruption == "drop_key":
            if value:
                del value[draw(st.sampled_from(sorted(value, key=repr)))]
        elif corruption == "extra_key":
            value[draw(keys)] = draw(anything)
        elif corruption in ("param_value", "param_key") and isinstance(value.get("params"), dict):
            existing = sorted(value["params"], key=repr)
            if corruption == "param_value" and existing:
                value["params"][draw(st.sampled_from(existing))] = draw(param_values)
            else:
                for key in draw(st.lists(keys, min_size=1, max_size=2)):
                    value["params"][key] = draw(param_values)
        elif corruption == "drop_param" and isinstance(value.get("params"), dict) and value["params"]:
            del value["params"][draw(st.sampled_from(sorted(value["params"], key=repr)))]
        elif corruption.startswith(("spec", "shape")) and isinstance(value.get("tensors"), list) and value["tensors"]:
            index = draw(st.integers(0, len(value["tensors"]) - 1))
            target = value["tensors"][index]
            if corruption == "spec" or not isinstance(target, dict):
                value["tensors"][index] = draw(anything)
            elif corruption == "spec_field":
                target[draw(st.sampled_from(["name", "dtype", "shape"]))] = draw(anything)
            elif corruption == "spec_key":
                target[draw(keys)] = draw(anything)
            elif corruption == "shape":
                target["shape"] = draw(near_miss_dims)
            elif corruption == "shape_extreme":  # sizes at the per-dimension limit, some of them 0
                target["shape"] = draw(st.lists(st.sampled_from([0, protocol.MAX_FRAME_BYTES]), min_size=3,
                                                max_size=MAX_DIMS))
            elif isinstance(target.get("shape"), list) and target["shape"]:
                target["shape"][draw(st.integers(0, len(target["shape"]) - 1))] = draw(
                    st.sampled_from([-1, 0, 5, 2**26, 2**26 + 1, 1.5, True, None, "2", [2]]) | anything)
        elif corruption == "frame_size" and frames:
            frame = frames[draw(st.integers(0, len(frames) - 1))]
            if frame and draw(st.booleans()):
                del frame[draw(st.integers(0, len(frame) - 1)):]
            else:
                frame.extend(draw(st.binary(min_size=1, max_size=8)))
        elif corruption == "frame_count":
            if frames and draw(st.booleans()):
                frames.pop(draw(st.integers(0, len(frames) - 1)))
            else:
                frames.append(bytearray(draw(st.binary(max_size=16))))
    if isinstance(value.get("tensors"), list) and draw(st.booleans()):
        # Resize frames to fit the (maybe corrupted) specs, so spec corruptions get past the size check.
        for index, tensor_spec in enumerate(value["tensors"][: len(frames)]):
            size = _fitting_frame_size(tensor_spec)
            if size is not None:
                frames[index] = bytearray(random_bytes(index, size))
    return [pack(value), *map(bytes, frames)], from_client


def _fitting_frame_size(tensor_spec) -> int | None:
    """The frame size a spec asks for, when the spec is readable enough to say and the size is small."""
    try:
        size = math.prod(tensor_spec["shape"]) * DTYPES[tensor_spec["dtype"]].itemsize
    except Exception:  # noqa: BLE001 - a spec too broken to size keeps its frame
        return None
    return size if isinstance(size, int) and 0 <= size <= 4096 else None


@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(structured_cases())
def test_fuzz_structured_headers(case):
    frames, from_client = case
    check_decode(frames, from_client)


def _valid_messages():
    tensors = {name: random_tensor(dtype, (2, 3), seed=i) for i, (name, dtype) in enumerate(zip(CLIENT_KINDS['submit'].tensor_names(), DTYPES.values()))}
    submit = Message("submit", "job-1", {**SUBMIT_PARAMS, "call": {"true_cfg_scale": 2.0}, "scheduler": "x", "preview": True}, tensors)
    result = Message("result", "job-1", {"step": 3, "nested": [1, {"a": b"b"}]}, {"image": torch.rand(1, 3, 4, 4)})
    return [(on_the_wire(encode(submit)), True), (on_the_wire(encode(Message("cancel", "job-1"))), True),
            (on_the_wire(encode(Message("encode", "e", {"prompt": "a photo of a cat"}))), True),
            (on_the_wire(encode(result)), False), (on_the_wire(encode(Message("stopping"))), False)]


VALID_MESSAGES = _valid_messages()


@st.composite
def mutated_messages(draw):
    frames, from_client = draw(st.sampled_from(VALID_MESSAGES))
    frames = [bytearray(frame) for frame in frames]
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(frames) - 1))
        frame = frames[index]
        operation = draw(st.sampled_from(["flip", "set", "truncate", "extend", "insert", "delete", "drop_frame",
                                          "dup_frame", "add_frame", "swap_frames"]))
        if operation == "flip" and frame:
            position = draw(st.integers(0, len(frame) - 1))
            frame[position] ^= 1 << draw(st.integers(0, 7))
        elif operation == "set" and frame:
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
        elif operation == "truncate":
            del frame[draw(st.integers(0, len(frame))):]
        elif operation == "extend":
            frame.extend(draw(st.binary(min_size=1, max_size=16)))
        elif operation == "insert":
            position = draw(st.integers(0, len(frame)))
            frame[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif operation == "delete" and frame:
            position = draw(st.integers(0, len(frame) - 1))
            del frame[position:position + draw(st.integers(1, 8))]
        elif operation == "drop_frame":
            del frames[index]
        elif operation == "dup_frame":
            frames.insert(index, bytearray(frame))
        elif operation == "add_frame":
            frames.insert(index, bytearray(draw(st.binary(max_size=32))))
        elif operation == "swap_frames" and len(frames) > 1:
            other = draw(st.integers(0, len(frames) - 1))
            frames[index], frames[other] = frames[other], frames[index]
        if not frames:
            break
    return [bytes(frame) for frame in frames], draw(st.sampled_from([from_client, from_client, not from_client]))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_messages())
def test_fuzz_mutated_valid_messages(case):
    frames, from_client = case
    check_decode(frames, from_client)


def test_mutation_fuzz_base_messages_are_valid():
    for frames, from_client in VALID_MESSAGES:
        assert check_decode(frames, from_client) is not None

