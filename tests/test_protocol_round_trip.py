"""The pool's wire format (workers/wire/protocol.py): every message type and dtype round-trips bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol_helpers import (
    CLIENT_TYPES,
    SUBMIT_PARAMS,
    assert_bit_equal,
    header,
    minimal_params,
    on_the_wire,
    pack,
    random_bytes,
    random_tensor,
    rejects,
)
from workers.wire import protocol
from workers.wire.framing import DTYPES
from parallel.fields import wire_fields
from workers.wire.messages import CLIENT_KINDS, job_inputs
from workers.wire.protocol import (
    CLIENT_MESSAGES,
    MAX_TENSORS,
    MAX_DIMS,
    SERVER_MESSAGES,
    Message,
    decode,
    encode,
)

JOB_INPUTS = job_inputs()


SHAPES = [(3,), (2, 3), (1, 2, 1, 3), (2, 1, 2, 1, 2, 1), (0,), (2, 0, 3), (1,) * MAX_DIMS, (4, 0, 1, 1, 1, 2)]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_submit_round_trips_every_dtype_bit_for_bit(dtype_name, shape):
    dtype = DTYPES[dtype_name]
    tensors = {name: random_tensor(dtype, shape, seed=i) for i, name in enumerate(JOB_INPUTS[:3])}
    message = Message("submit", "job.1:a-b_c", {**SUBMIT_PARAMS, "scheduler": "dpm", "preview": True}, tensors)
    frames = encode(message)
    assert len(frames) == 1 + len(tensors)
    for wire in (frames, on_the_wire(frames)):
        decoded = decode(wire)
        assert (decoded.type, decoded.job, decoded.params) == (message.type, message.job, message.params)
        assert list(decoded.tensors) == list(tensors)
        for name, original in tensors.items():
            assert_bit_equal(decoded.tensors[name], original)


def test_submit_with_every_input_and_every_dtype_at_once():
    dtypes = list(DTYPES.values())
    tensors = {
        name: random_tensor(dtypes[i % len(dtypes)], (1,) * (i % MAX_DIMS) + (i + 1,), seed=i)
        for i, name in enumerate(JOB_INPUTS)
    }
    params = {**SUBMIT_PARAMS, "call": {"true_cfg_scale": 3, "num_frames": 9}, "scheduler": "euler", "preview": False}
    names = list(tensors)
    for start in range(0, len(names), MAX_TENSORS):  # more inputs exist than one message may carry
        chunk = {name: tensors[name] for name in names[start:start + MAX_TENSORS]}
        decoded = decode(on_the_wire(encode(Message("submit", "j", params, chunk))))
        assert decoded.params == params
        for name, original in chunk.items():
            assert_bit_equal(decoded.tensors[name], original)


def test_special_float_bit_patterns_survive():
    """NaN payloads, signed zeros, infinities and subnormals are bytes, not numbers, on the wire."""
    patterns = {
        torch.float32: (torch.int32, [0x7FC00001, 0x7F800001, -1, -(2**31), 0x00000001, 0x7F800000, -8388608, 0]),
        torch.float16: (torch.int16, [0x7E01, 0x7C01, -1, -(2**15), 0x0001, 0x7C00, -1024, 0]),
        torch.bfloat16: (torch.int16, [0x7FC1, 0x7F81, -1, -(2**15), 0x0001, 0x7F80, -128, 0]),
    }
    for dtype, (bits, values) in patterns.items():
        tensor = torch.tensor(values, dtype=bits).view(dtype)
        assert tensor.isnan().any() and tensor.isinf().any()
        decoded = decode(on_the_wire(encode(Message("submit", "", SUBMIT_PARAMS, {"latents": tensor}))))
        assert_bit_equal(decoded.tensors["latents"], tensor)


def test_non_contiguous_and_grad_tensors_are_sent_in_c_order():
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    tensors = {
        "latents": base.transpose(0, 2),
        "prompt_embeds": base[:, 1:, ::2],
        "pooled_prompt_embeds": torch.ones(3, requires_grad=True) * 2,
    }
    decoded = decode(on_the_wire(encode(Message("submit", "", SUBMIT_PARAMS, tensors))))
    for name, original in tensors.items():
        assert_bit_equal(decoded.tensors[name], original.detach().contiguous())


def test_minimal_params_cover_schema():
    """Every client type's required params are in MINIMAL_PARAMS, so the tests below build valid messages."""
    for kind, body in CLIENT_KINDS.items():
        required = {f.name for f in wire_fields(body) if f.required}
        assert required <= set(minimal_params(kind)), f"add {kind!r} to MINIMAL_PARAMS"
        assert decode([pack(header(kind, params=minimal_params(kind)))]).params == minimal_params(kind)


@pytest.mark.parametrize("kind", [k for k in CLIENT_TYPES if k != "submit"])
def test_tensorless_client_messages_round_trip(kind):
    for job in ("", "x", "a" * 64, "job_1.2:3-4"):
        decoded = decode(on_the_wire(encode(Message(kind, job, minimal_params(kind)))))
        assert (decoded.type, decoded.job, decoded.params, decoded.tensors) == (kind, job, minimal_params(kind), {})


@pytest.mark.parametrize("kind", SERVER_MESSAGES)
def test_server_messages_decode_with_from_client_false(kind):
    tensors = {f"out_{name}": random_tensor(dtype, (2, 3), seed=3) for name, dtype in DTYPES.items()}
    params = {"step": 3, "of": 20, "text": "ok", "nested": {"a": [1, 2.5, None, True, b"raw"]}}
    decoded = decode(on_the_wire(encode(Message(kind, "job-9", params, tensors))), from_client=False)
    assert (decoded.type, decoded.job, decoded.params) == (kind, "job-9", params)
    for name, original in tensors.items():
        assert_bit_equal(decoded.tensors[name], original)
    if kind not in CLIENT_MESSAGES:
        rejects(encode(Message(kind, "job-9")), "unknown message type")


@pytest.mark.parametrize("kind", [k for k in CLIENT_TYPES if k not in SERVER_MESSAGES])
def test_client_only_types_are_unknown_to_a_client(kind):
    rejects(encode(Message(kind, "", minimal_params(kind))), "unknown message type", from_client=False)


def test_round_trip_through_real_zmq_sockets():
    zmq = pytest.importorskip("zmq")
    tensors = {name: random_tensor(dtype, (3, 2), seed=5) for name, dtype in zip(JOB_INPUTS, DTYPES.values())}
    message = Message("submit", "z", SUBMIT_PARAMS, tensors)
    context = zmq.Context()
    try:
        sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        sender.bind("inproc://protocol-test")
        receiver.connect("inproc://protocol-test")
        for copy in (True, False):  # bytes, then zmq.Frame objects (decode reads their .buffer)
            sender.send_multipart(encode(message))
            decoded = decode(receiver.recv_multipart(copy=copy))
            for name, original in tensors.items():
                assert_bit_equal(decoded.tensors[name], original)
    finally:
        context.destroy(linger=0)


def test_decoded_tensors_are_writable_copies_of_bytes_frames():
    """A bytes frame is immutable, so decode must copy it; in-place work on the result must not fail."""
    frames = on_the_wire(encode(Message("submit", "", SUBMIT_PARAMS, {"latents": torch.zeros(2, 3)})))
    before = bytes(frames[1])
    latents = decode(frames).tensors["latents"]
    latents.add_(1)
    assert frames[1] == before and torch.equal(latents, torch.ones(2, 3))


@st.composite
def tensors_strategy(draw):
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=MAX_DIMS))
    count = math.prod(shape)
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=count, max_size=count)), dtype=torch.bool).reshape(shape)
    size = count * dtype.itemsize
    # Small tensors get hypothesis-chosen bytes; big ones seeded random bytes (drawing 32 KiB is slow).
    data = draw(st.binary(min_size=size, max_size=size)) if size <= 64 else random_bytes(draw(st.integers(0, 2**32 - 1)), size)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from(JOB_INPUTS), tensors_strategy(), max_size=min(len(JOB_INPUTS), MAX_TENSORS)),
    st.from_regex(protocol._JOB_ID.pattern.replace("$", r"\Z"), fullmatch=True) | st.just(""),
)
def test_property_submit_round_trip(tensors, job):
    decoded = decode(on_the_wire(encode(Message("submit", job, dict(SUBMIT_PARAMS), tensors))))
    assert decoded.job == job
    assert list(decoded.tensors) == list(tensors)
    for name, original in tensors.items():
        assert_bit_equal(decoded.tensors[name], original)

