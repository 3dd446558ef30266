"""The pool's wire format (workers/protocol.py): round trips, every rejection path, no pickle, fuzzing.

Everything here is single process and CPU only. The "Regressions" section keeps the minimal
reproductions of defects the fuzzing found (and that are fixed) so they stay fixed.
"""

from __future__ import annotations

import math
import pickle
import random
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers import protocol
from workers.protocol import (
    CLIENT_MESSAGES,
    DTYPE_NAMES,
    DTYPES,
    JOB_INPUTS,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_PROMPT_CHARS,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    SERVER_MESSAGES,
    Message,
    ProtocolError,
    decode,
    encode,
)

CLIENT_TYPES = sorted(CLIENT_MESSAGES)
ALL_TYPES = sorted(set(CLIENT_MESSAGES) | set(SERVER_MESSAGES))
SUBMIT_PARAMS = {"steps": 20, "guidance_scale": 4.5, "height": 64, "width": 48}
# The smallest valid params of each client type that has required ones (see test_minimal_params_cover_schema).
MINIMAL_PARAMS = {"submit": SUBMIT_PARAMS, "encode": {"prompt": "a red cube on a table"}}


def minimal_params(kind: str) -> dict:
    return dict(MINIMAL_PARAMS.get(kind, {}))


# --------------------------------------------------------------------------------------------- helpers


def pack(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def header(kind="status", **fields) -> dict:
    return {"v": PROTOCOL_VERSION, "type": kind, **fields}


def submit_header(tensors=None, **params) -> dict:
    merged = {**SUBMIT_PARAMS, **params}
    built = header("submit", job="job-1", params={k: v for k, v in merged.items() if v is not _DROP})
    return built if tensors is None else {**built, "tensors": tensors}


_DROP = object()


def spec(name="latents", dtype="float32", shape=(2, 2)) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape}


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, whatever its dtype (bfloat16 and bool included)."""
    if tensor.numel() == 0:
        return b""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_equal(decoded: torch.Tensor, original: torch.Tensor) -> None:
    assert decoded.dtype == original.dtype
    assert tuple(decoded.shape) == tuple(original.shape)
    assert raw_bytes(decoded) == raw_bytes(original)


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=generator).bool()
    count = math.prod(shape) * dtype.itemsize
    data = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return data.view(dtype).reshape(tuple(shape)) if count else torch.empty(tuple(shape), dtype=dtype)


def random_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def on_the_wire(frames) -> list[bytes]:
    """What a peer receives with copy=True: plain bytes."""
    return [bytes(frame) for frame in frames]


def rejects(frames, match: str, *, from_client: bool = True) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as caught:
        decode(frames, from_client=from_client)
    text = str(caught.value)
    assert text and "\n" not in text, "errors go back to the client as one line"
    return caught.value


# ------------------------------------------------------------------------------------------ round trip

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
    params = {**SUBMIT_PARAMS, "true_cfg_scale": 3, "scheduler": "euler", "preview": False}
    decoded = decode(on_the_wire(encode(Message("submit", "j", params, tensors))))
    assert decoded.params == params
    for name, original in tensors.items():
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
    for kind, schema in CLIENT_MESSAGES.items():
        required = {name for name, (_, needed) in schema.items() if needed}
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
    st.dictionaries(st.sampled_from(JOB_INPUTS), tensors_strategy(), max_size=len(JOB_INPUTS)),
    st.from_regex(protocol._JOB_ID.pattern.replace("$", r"\Z"), fullmatch=True) | st.just(""),
)
def test_property_submit_round_trip(tensors, job):
    decoded = decode(on_the_wire(encode(Message("submit", job, dict(SUBMIT_PARAMS), tensors))))
    assert decoded.job == job
    assert list(decoded.tensors) == list(tensors)
    for name, original in tensors.items():
        assert_bit_equal(decoded.tensors[name], original)


# ------------------------------------------------------------------------------------------ rejections


def test_empty_message():
    rejects([], "empty message")


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", b"\xc1\x00garbage", b"\x82\xa1v", b"\xde\xff\xff", b"\xdb\xff\xff\xff\xff", bytes(range(256)),
     pack(header()) + b"\x00", b"\x81\xa1v\xd9\x02\xff\xfe"],
    ids=["empty", "never-used-byte", "garbage", "truncated-map", "map16-truncated", "str32-truncated",
         "all-bytes", "trailing-data", "invalid-utf8"],
)
def test_header_that_is_not_msgpack(raw):
    rejects([raw], "header is not valid msgpack")


def test_header_with_non_string_map_keys():
    rejects([pack({1: 2, "v": 1, "type": "status"})], "header is not valid msgpack")


def test_header_size_limit_is_inclusive():
    pad = MAX_HEADER_BYTES - 64
    while len(pack(header(pad="x" * pad))) < MAX_HEADER_BYTES:
        pad += 1
    at_limit = pack(header(pad="x" * pad))
    assert len(at_limit) == MAX_HEADER_BYTES
    assert decode([at_limit]).type == "status"
    over = pack(header(pad="x" * (pad + 1)))
    rejects([over], f"header is {len(over)} bytes; the limit is {MAX_HEADER_BYTES}")
    rejects([b"\x00" * (10 * MAX_HEADER_BYTES)], "the limit is")


@pytest.mark.parametrize("value", [[1, 2], 1, None, "status", b"bytes", 2.5, True])
def test_header_not_a_map(value):
    rejects([pack(value)], "header must be a msgpack map")


@pytest.mark.parametrize("version", [0, 2, -1, "1", None, [1], {"v": 1}, 1.5, b"\x01"])
def test_wrong_version(version):
    rejects([pack(header(v=version))], f"protocol version .* is not supported; this pool speaks {PROTOCOL_VERSION}")


def test_missing_version():
    rejects([pack({"type": "status"})], "protocol version None is not supported")


@pytest.mark.parametrize("kind", ["nope", "", "SUBMIT", "accepted", "step", 5, None, b"submit", 1.0])
def test_unknown_type_from_client(kind):
    if kind in CLIENT_MESSAGES:
        pytest.skip("known type")
    rejects([pack(header(kind))], "unknown message type .*; expected one of")


@pytest.mark.parametrize("kind", ["submit", "cancel", "stop", "nope", 0])
def test_unknown_type_from_server(kind):
    rejects([pack(header(kind))], "unknown message type", from_client=False)


def test_missing_type():
    rejects([pack({"v": 1})], "unknown message type None")


@pytest.mark.parametrize(
    "job", [123, None, True, b"job", ["j"], "a" * 65, "a b", "a/b", "é", "job\x00", "\njob", "a\tb", "🙂"]
)
def test_bad_job_id(job):
    rejects([pack(header("cancel", job=job))], "job id must be 1-64 characters")


@pytest.mark.parametrize("job", ["", "a", "A-z_0.9:x", "a" * 64])
def test_good_job_ids(job):
    assert decode([pack(header("cancel", job=job))]).job == job


@pytest.mark.parametrize("params", [[], "x", None, 1, b"", [["steps", 20]], True])
@pytest.mark.parametrize("from_client", [True, False])
def test_params_not_a_map(params, from_client):
    rejects([pack(header("status", params=params))], "params must be a map", from_client=from_client)


def test_unknown_param():
    rejects([pack(submit_header(sampler="euler"))], r"submit does not take \['sampler'\]; it takes \[")
    rejects([pack(header("cancel", params={"steps": 1}))], r"cancel does not take \['steps'\]; it takes \[\]")
    rejects([pack(header("status", params={b"raw": 1}))], "header map keys must be strings")


@pytest.mark.parametrize("name", ["steps", "guidance_scale", "height", "width"])
def test_missing_required_param(name):
    rejects([pack(submit_header(**{name: _DROP}))], f"submit needs '{name}'")


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("steps", "20", "steps must be int, not str"),
        ("steps", 20.0, "steps must be int, not float"),
        ("steps", True, "steps must be int, not bool"),
        ("steps", None, "steps must be int, not NoneType"),
        ("height", False, "height must be int, not bool"),
        ("width", 64.0, "width must be int, not float"),
        ("width", [64], "width must be int, not list"),
        ("guidance_scale", "7", "guidance_scale must be int or float, not str"),
        ("guidance_scale", True, "guidance_scale must be int or float, not bool"),
        ("guidance_scale", None, "guidance_scale must be int or float, not NoneType"),
        ("true_cfg_scale", b"1", "true_cfg_scale must be int or float, not bytes"),
        ("true_cfg_scale", False, "true_cfg_scale must be int or float, not bool"),
        ("scheduler", 1, "scheduler must be str, not int"),
        ("scheduler", b"euler", "scheduler must be str, not bytes"),
        ("preview", 1, "preview must be bool, not int"),
        ("preview", "yes", "preview must be bool, not str"),
        ("preview", None, "preview must be bool, not NoneType"),
    ],
)
def test_wrong_param_type(name, value, match):
    rejects([pack(submit_header(**{name: value}))], f"submit {match}")


@pytest.mark.parametrize("name", ["guidance_scale", "true_cfg_scale"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats(name, value):
    rejects([pack(submit_header(**{name: value}))], f"submit {name} must be finite")


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("steps", 0, "steps is 0; use 1 to 1000"),
        ("steps", -5, "steps is -5; use 1 to 1000"),
        ("steps", 1001, "steps is 1001; use 1 to 1000"),
        ("steps", 2**64 - 1, "use 1 to 1000"),
        ("height", 7, "height is 7; use 8 to 16384"),
        ("height", 16385, "height is 16385; use 8 to 16384"),
        ("width", 0, "width is 0; use 8 to 16384"),
        ("width", -(2**63), "use 8 to 16384"),
        ("width", 16385, "width is 16385; use 8 to 16384"),
    ],
)
def test_param_out_of_range(name, value, match):
    rejects([pack(submit_header(**{name: value}))], match)


@pytest.mark.parametrize(
    "params",
    [
        {"steps": 1, "height": 8, "width": 8},
        {"steps": 1000, "height": 16384, "width": 16384},
        {"guidance_scale": 0, "true_cfg_scale": -1.5e308},
        {"preview": True, "scheduler": ""},
    ],
)
def test_param_boundaries_are_accepted(params):
    assert decode([pack(submit_header(**params))]).params == {**SUBMIT_PARAMS, **params}


def test_encode_prompt():
    assert decode([pack(header("encode", params={"prompt": ""}))]).params == {"prompt": ""}
    at_limit = "é" * MAX_PROMPT_CHARS  # characters, not bytes
    assert decode([pack(header("encode", params={"prompt": at_limit}))]).params["prompt"] == at_limit
    rejects([pack(header("encode", params={"prompt": "x" * (MAX_PROMPT_CHARS + 1)}))],
            f"prompt is {MAX_PROMPT_CHARS + 1} characters; the limit is {MAX_PROMPT_CHARS}")
    rejects([pack(header("encode"))], "encode needs 'prompt'")
    rejects([pack(header("encode", params={"prompt": b"cat"}))], "encode prompt must be str, not bytes")
    rejects([pack(header("encode", params={"prompt": ["cat"]}))], "encode prompt must be str, not list")
    rejects([pack(header("encode", params={"prompt": "cat", "steps": 2}))], r"encode does not take \['steps'\]")


@pytest.mark.parametrize("tensors", [{}, "latents", None, 3, b"", {"name": "latents"}])
@pytest.mark.parametrize("from_client", [True, False])
def test_tensors_not_a_list(tensors, from_client):
    kind = "submit" if from_client else "result"
    rejects([pack({**submit_header(), "type": kind, "tensors": tensors})], "tensors must be a list of at most 16 specs",
            from_client=from_client)


def test_too_many_tensors():
    specs = [spec(f"t{i}", "bool", [1]) for i in range(MAX_TENSORS + 1)]
    rejects([pack(header("result", tensors=specs)), *[b"\x01"] * len(specs)], "at most 16 specs", from_client=False)
    specs = specs[:MAX_TENSORS]
    assert len(decode([pack(header("result", tensors=specs)), *[b"\x01"] * len(specs)], from_client=False).tensors) == 16


def test_spec_count_differs_from_frame_count():
    frame = bytes(16)
    rejects([pack(submit_header(tensors=[spec()]))], "header lists 1 tensors but 0 frames arrived")
    rejects([pack(submit_header()), frame], "header lists 0 tensors but 1 frames arrived")
    rejects([pack(submit_header(tensors=[spec()])), frame, frame], "header lists 1 tensors but 2 frames arrived")
    rejects([pack(submit_header(tensors=[spec(), spec("prompt_embeds")])), frame],
            "header lists 2 tensors but 1 frames arrived")


@pytest.mark.parametrize(
    "bad",
    [
        ["latents", "float32", [2, 2]],
        "latents",
        None,
        {"name": "latents", "dtype": "float32"},
        {"name": "latents", "shape": [2, 2]},
        {"dtype": "float32", "shape": [2, 2]},
        {**spec(), "extra": 1},
        {**spec(), "device": "cuda"},
        {b"name": "latents", b"dtype": "float32", b"shape": [2, 2]},
        {},
    ],
)
def test_bad_spec_keys(bad):
    expected = "header map keys must be strings" if isinstance(bad, dict) and any(isinstance(k, bytes) for k in bad) else \
        "tensor spec 1 must be a map with exactly name, dtype and shape"
    rejects([pack(submit_header(tensors=[spec("prompt_embeds"), bad])), bytes(16), bytes(16)], expected)


@pytest.mark.parametrize("name", ["mask", "", "LATENTS", "latents ", b"latents", 7, None])
def test_tensor_name_not_accepted_for_submit(name):
    rejects([pack(submit_header(tensors=[spec(name)])), bytes(16)], r"tensor .* is not accepted here; allowed: \['latents'")


@pytest.mark.parametrize("kind", [k for k in CLIENT_TYPES if k != "submit"])
def test_tensorless_client_types_accept_no_tensors(kind):
    rejects([pack(header(kind, params=minimal_params(kind), tensors=[spec()])), bytes(16)],
            r"tensor 'latents' is not accepted here; allowed: \[\]")


@pytest.mark.parametrize("name", [7, None, b"out", ["x"]])
def test_server_tensor_names_must_be_strings(name):
    rejects([pack(header("result", tensors=[spec(name)])), bytes(16)], "is not accepted here", from_client=False)


@pytest.mark.parametrize("dtype", ["float64", "uint8", "int8", "Float32", "torch.float32", "", None, 4, b"float32", 1.5])
def test_unknown_dtype(dtype):
    rejects([pack(submit_header(tensors=[spec(dtype=dtype)])), bytes(16)], "tensor latents has dtype .*; allowed: \\[")


@pytest.mark.parametrize(
    "shape",
    [[-1], [2, -2], [1.0], [2, 2.0], [True], [1, False], [1] * (MAX_DIMS + 1), "2,2", None, 4, {"0": 2}, [None],
     ["2"], [[2]], [protocol.MAX_FRAME_BYTES + 1], [2**64 - 1], [-(2**63)], b"\x02\x02"],
    ids=str,
)
def test_bad_shape(shape):
    rejects([pack(submit_header(tensors=[spec(shape=shape)])), bytes(16)],
            f"tensor latents has shape .*; expected a list of at most {MAX_DIMS} sizes >= 0")


@pytest.mark.parametrize("size", [0, 1, 15, 17, 32])
def test_frame_size_mismatch(size):
    rejects([pack(submit_header(tensors=[spec()])), bytes(size)],
            f"tensor latents float32\\[2, 2\\] needs 16 bytes but its frame has {size}")


def test_truncated_frame_of_a_valid_message():
    frames = on_the_wire(encode(Message("submit", "", SUBMIT_PARAMS, {"latents": torch.ones(3, 5, dtype=torch.bfloat16)})))
    rejects([frames[0], frames[1][:-1]], "tensor latents bfloat16\\[3, 5\\] needs 30 bytes but its frame has 29")
    rejects([frames[0], frames[1] + b"\x00"], "needs 30 bytes but its frame has 31")


def test_empty_tensor_needs_an_empty_frame():
    rejects([pack(submit_header(tensors=[spec(shape=[0, 4])])), b"\x00"], "needs 0 bytes but its frame has 1")
    decoded = decode([pack(submit_header(tensors=[spec(shape=[0, 4])])), b""])
    assert decoded.tensors["latents"].shape == (0, 4)


def test_frame_over_the_size_limit(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_FRAME_BYTES", 32)
    ok = [pack(submit_header(tensors=[spec(shape=[8])])), bytes(32)]
    assert decode(ok).tensors["latents"].shape == (8,)
    rejects([pack(submit_header(tensors=[spec(shape=[16])])), bytes(64)],
            "tensor latents is 64 bytes; the limit per tensor is 32")
    # An oversized frame is reported as oversized even when the spec disagrees with it.
    rejects([pack(submit_header(tensors=[spec(shape=[2])])), bytes(33)], "the limit per tensor is 32")
    # A dimension may not exceed the limit either.
    rejects([pack(submit_header(tensors=[spec(dtype="bool", shape=[33])])), bytes(33)], "has shape")


def test_duplicate_tensor_names():
    specs = [spec(), spec("prompt_embeds"), spec()]
    rejects([pack(submit_header(tensors=specs)), bytes(16), bytes(16), bytes(16)], "tensor names must be unique")
    specs = [spec("x", "bool", [1]), spec("x", "bool", [1])]
    rejects([pack(header("result", tensors=specs)), b"\x01", b"\x00"], "tensor names must be unique", from_client=False)


EXT = msgpack.ExtType(5, b"payload")


@pytest.mark.parametrize(
    "build",
    [
        lambda: {**header(), "x": EXT},
        lambda: header(EXT),
        lambda: {**header(), "v": EXT},
        lambda: submit_header(scheduler=EXT),
        lambda: header("error", params={"deep": [[{"x": EXT}]]}),
        lambda: submit_header(tensors=[spec(shape=[EXT])]),
        lambda: EXT,
        lambda: [EXT],
    ],
)
@pytest.mark.parametrize("from_client", [True, False])
def test_msgpack_ext_types_are_rejected(build, from_client):
    rejects([pack(build())], "header uses msgpack extension type 5; only plain maps, lists, strings and numbers",
            from_client=from_client)


@pytest.mark.parametrize("code", [0, 1, 42, 127, -2, -100, -128])
def test_every_ext_code_is_rejected(code):
    """ExtType only packs codes 0-127, so the ext8 bytes are written by hand: header() plus "x": ext."""
    base = pack(header())
    assert base[0] == 0x82
    raw = bytes([0x83]) + base[1:] + pack("x") + bytes([0xC7, 8, code & 0xFF]) + b"12345678"
    rejects([raw], f"extension type {code};")


# ---------------------------------------------------------------------------------------------- pickle


def _side_effect(path: str) -> int:
    """What unpickling an armed payload does: create a file we can look for."""
    Path(path).write_text("unpickled")
    return 0


class _Armed:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (_side_effect, (self.path,))


@pytest.mark.parametrize("pickle_protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payloads_are_never_unpickled(tmp_path, pickle_protocol, monkeypatch):
    control, target = tmp_path / "control", tmp_path / "target"
    # The payload is armed: unpickling it really does have the side effect.
    pickle.loads(pickle.dumps(_Armed(control), protocol=pickle_protocol))
    assert control.exists()
    payload = pickle.dumps(_Armed(target), protocol=pickle_protocol)
    tensor_payload = pickle.dumps({"latents": torch.ones(2), "evil": _Armed(target)}, protocol=pickle_protocol)

    def forbidden(*args, **kwargs):
        raise AssertionError("decode must never unpickle")

    for module, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, forbidden)

    for from_client in (True, False):
        # As the header: not msgpack (or msgpack that is not a map).
        for blob in (payload, tensor_payload):
            with pytest.raises(ProtocolError):
                decode([blob], from_client=from_client)
            with pytest.raises(ProtocolError):
                decode([blob, blob], from_client=from_client)
        # As a parameter: a client may not send bytes; a server's bytes stay bytes.
        rejects([pack(submit_header(scheduler=payload))], "scheduler must be str, not bytes")
        assert decode([pack(header("error", params={"blob": payload}))], from_client=False).params["blob"] == payload
        # As a tensor frame: with a matching spec the bytes are just tensor data.
        frames = [pack(submit_header(tensors=[spec(dtype="bool", shape=[len(payload)])])), payload]
        assert raw_bytes(decode(frames).tensors["latents"]) == payload
        frames = [pack(header("result", tensors=[spec("out", "bool", [len(tensor_payload)])])), tensor_payload]
        assert raw_bytes(decode(frames, from_client=False).tensors["out"]) == tensor_payload
        # ... and with a mismatched spec it is a size error.
        rejects([pack(submit_header(tensors=[spec()])), payload], "needs 16 bytes but its frame has")
    assert not target.exists()


# ---------------------------------------------------------------------------------------------- regressions
# Minimal reproductions of defects the fuzzing found in workers/protocol.py, fixed since.


def _unhashable_type_frames():
    return [pack(header(["submit"]))]


def _unhashable_dtype_frames():
    return [pack(header("result", tensors=[spec("out", ["float32"], [1])])), bytes(4)]


def _mixed_key_params_frames():
    return [pack(header("status", params={"a": 1, b"b": 2}))]


def _overflowing_empty_shape_frames():
    return [pack(submit_header(tensors=[spec(shape=[0, 2**21, 2**21, 2**21])])), b""]


@pytest.mark.parametrize("from_client", [True, False])
def test_defect_unhashable_message_type(from_client):
    rejects(_unhashable_type_frames(), "unknown message type", from_client=from_client)


def test_defect_unhashable_dtype():
    rejects(_unhashable_dtype_frames(), "has dtype", from_client=False)
    rejects([pack(submit_header(tensors=[spec(dtype={"a": 1})])), bytes(16)], "has dtype")


def test_defect_mixed_str_and_bytes_param_names():
    rejects(_mixed_key_params_frames(), "header map keys must be strings")


def test_defect_empty_tensor_with_huge_dims():
    rejects(_overflowing_empty_shape_frames(), "latents")


def test_defect_job_id_with_trailing_newline():
    rejects([pack(header("cancel", job="job\n"))], "job id must be")


def test_defect_timestamp_ext_type_is_accepted():
    rejects([pack(header("error", params={"t": msgpack.Timestamp(1, 0)}))], "only plain msgpack values", from_client=False)


def test_defect_zero_dim_tensors_do_not_encode():
    scalar = torch.tensor(1.5)
    decoded = decode(on_the_wire(encode(Message("submit", "", SUBMIT_PARAMS, {"latents": scalar}))))
    assert_bit_equal(decoded.tensors["latents"], scalar)


def test_zero_dim_tensors_decode():
    """The decode side of the scalar case works: shape [] means one element."""
    decoded = decode([pack(submit_header(tensors=[spec(shape=[])])), bytes(4)])
    assert decoded.tensors["latents"].shape == () and decoded.tensors["latents"].item() == 0.0
    assert_bit_equal(decode(encode(Message("result", "", {}, {"b": torch.tensor(True)})), from_client=False).tensors["b"],
                     torch.tensor(True))


# ------------------------------------------------------------------------------------------------ fuzzing


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
            assert name in JOB_INPUTS and message.type == "submit"
    if from_client:
        schema = CLIENT_MESSAGES[message.type]
        assert set(message.params) <= set(schema)
        assert all(needed <= (name in message.params) for name, (_, needed) in schema.items())
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
        "true_cfg_scale": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**63), 2**63),
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
    if from_client and kind != "submit":
        names = []
    elif from_client:
        names = draw(st.lists(st.sampled_from(JOB_INPUTS), unique=True, max_size=4))
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
    tensors = {name: random_tensor(dtype, (2, 3), seed=i) for i, (name, dtype) in enumerate(zip(JOB_INPUTS, DTYPES.values()))}
    submit = Message("submit", "job-1", {**SUBMIT_PARAMS, "true_cfg_scale": 2.0, "scheduler": "x", "preview": True}, tensors)
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
