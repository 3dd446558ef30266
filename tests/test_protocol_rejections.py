"""The pool's wire format (workers/wire/protocol.py): every rejection path, one line each, and no pickle.

The "Regressions" section keeps the minimal reproductions of defects the fuzzing found (and that are
fixed) so they stay fixed.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import msgpack
import pytest
import torch

from protocol_helpers import (
    CLIENT_TYPES,
    DROP,
    SUBMIT_PARAMS,
    assert_bit_equal,
    header,
    minimal_params,
    on_the_wire,
    pack,
    raw_bytes,
    rejects,
    spec,
    submit_header,
)
from workers.wire import framing, protocol
from workers.wire.protocol import (
    CLIENT_MESSAGES,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_PROMPT_CHARS,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    decode,
    encode,
)


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


@pytest.mark.parametrize("version", [0, 1, 3, -1, "2", None, [2], {"v": 2}, 2.5, b"\x02"])
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
    rejects([pack({"v": PROTOCOL_VERSION})], "unknown message type None")


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
    rejects([pack(submit_header(**{name: DROP}))], f"submit needs '{name}'")


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
        ("scheduler", 1, "scheduler must be str, not int"),
        ("scheduler", b"euler", "scheduler must be str, not bytes"),
        ("preview", 1, "preview must be bool, not int"),
        ("preview", "yes", "preview must be bool, not str"),
        ("preview", None, "preview must be bool, not NoneType"),
    ],
)
def test_wrong_param_type(name, value, match):
    rejects([pack(submit_header(**{name: value}))], f"submit {match}")


@pytest.mark.parametrize(
    "call, match",
    [
        ({"true_cfg_scale": b"1"}, "call true_cfg_scale must be int or float, not bytes"),
        ({"true_cfg_scale": False}, "call true_cfg_scale must be int or float, not bool"),
        ({"num_frames": "9"}, "call num_frames must be int or float, not str"),
        ({"guidance_scale_2": [3.0]}, "call guidance_scale_2 must be int or float, not list"),
        ({"x": None}, "call x must be int or float, not NoneType"),
    ],
)
def test_wrong_call_value_type(call, match):
    """The family's scalars travel in `call`; the wire checks they are numbers, the pool checks the names."""
    rejects([pack(submit_header(call=call))], f"submit {match}")


@pytest.mark.parametrize("call", [[], "true_cfg_scale=2", 2.0, None, True])
def test_call_not_a_map(call):
    rejects([pack(submit_header(call=call))], f"submit call must be dict, not {type(call).__name__}")


def test_family_parameters_outside_call_are_unknown():
    for name, value in (("true_cfg_scale", 2.0), ("num_frames", 9), ("guidance_scale_2", 3.0)):
        rejects([pack(submit_header(**{name: value}))], rf"submit does not take \['{name}'\]")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats(value):
    rejects([pack(submit_header(guidance_scale=value))], "submit guidance_scale must be finite")
    rejects([pack(submit_header(call={"true_cfg_scale": value}))], "submit call true_cfg_scale must be finite")


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
        {"guidance_scale": 0, "call": {"true_cfg_scale": -1.5e308}},
        {"call": {"num_frames": 9, "guidance_scale_2": 3}},
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


def test_encode_takes_reference_images_alone():
    """An edit model's prompt travels with its reference images (`image`), with a seed too (a whole job's inputs);
    no other tensor."""
    image = torch.rand(1, 3, 8, 8)
    message = decode(on_the_wire(encode(Message("encode", "", {"prompt": "cat"}, {"image": image}))))
    assert torch.equal(message.tensors["image"], image)
    rejects(on_the_wire(encode(Message("encode", "", {"prompt": "cat"}, {"latents": image}))),
            r"tensor 'latents' is not accepted here; allowed: \['image'\]")
    whole = decode(on_the_wire(encode(Message("encode", "", {"prompt": "cat", "seed": 1, "height": 8, "width": 8},
                                              {"image": image}))))
    assert torch.equal(whole.tensors["image"], image)


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


@pytest.mark.parametrize("kind", [k for k in CLIENT_TYPES if k not in ("submit", "decode", "evaluate", "encode")])
def test_tensorless_client_types_accept_no_tensors(kind):
    rejects([pack(header(kind, params=minimal_params(kind), tensors=[spec()])), bytes(16)],
            r"tensor 'latents' is not accepted here; allowed: \[\]")


def test_evaluate_accepts_only_model_call_tensors():
    rejects([pack(header("evaluate", params={}, tensors=[spec("negative_prompt_embeds")])), bytes(16)],
            r"tensor 'negative_prompt_embeds' is not accepted here; allowed: \['latents', 'sigma', 'timestep', 'prompt_embeds'")


@pytest.mark.parametrize("conditioning", [{"prompt_embeds": "abc"}, {"init_latents": "0" * 32}, {"prompt_embeds": 7}])
def test_evaluate_names_conditioning_by_model_call_tensor_and_key(conditioning):
    rejects([pack(header("evaluate", params={"conditioning": conditioning}))],
            "evaluate's conditioning maps model-call tensor names to 32-hex-digit keys")


def test_decode_accepts_only_latents_and_audio():
    rejects([pack(header("decode", params=minimal_params("decode"), tensors=[spec("image")])), bytes(16)],
            r"tensor 'image' is not accepted here; allowed: \['latents', 'audio'\]")


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
    monkeypatch.setattr(framing, "MAX_FRAME_BYTES", 32)
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
# Minimal reproductions of defects the fuzzing found in workers/wire/protocol.py, fixed since.


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

