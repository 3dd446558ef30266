"""One msgpack framing (workers/wire/framing.py) for every channel: the supervisor's control channel refuses
what the client protocol refuses (no pickle, no extension types, plain maps only), with room for a
rank's traceback; the rank broadcast's specs are checked like the wire's."""

from __future__ import annotations

import pickle

import msgpack
import pytest
import torch

from workers.wire import control, framing


def test_control_messages_round_trip_with_a_long_traceback():
    message = {"type": "failed", "rank": 1, "launch": 0, "error": "RuntimeError: x", "traceback": "line\n" * 40_000,
               "client": b"\x00id", "memory": {"rss_bytes": 2**40}, "fatal": True}
    assert len(control.pack(message)) > framing.MAX_HEADER_BYTES
    assert control.unpack(control.pack(message)) == message


@pytest.mark.parametrize(
    "raw, match",
    [
        (pickle.dumps({"type": "ready"}), "header is not valid msgpack"),
        (msgpack.packb({"type": "ready", "x": msgpack.ExtType(3, b"z")}), "msgpack extension type 3"),
        (msgpack.packb(["ready"]), "header must be a msgpack map"),
        (msgpack.packb({"rank": 0}), "control message must be a map with a type"),
        (msgpack.packb({"type": "ready", "t": msgpack.Timestamp(1, 0)}), "only plain msgpack values"),
    ],
)
def test_control_channel_refuses_what_the_wire_refuses(raw, match):
    with pytest.raises(framing.ProtocolError, match=match) as caught:
        control.unpack(raw)
    assert "\n" not in str(caught.value)


def test_tensor_specs_and_frames_round_trip():
    tensors = {"latents": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "mask": torch.tensor([True, False]),
               # one element expanded (a batch of one's sigma from ComfyUI): stride 0, yet "contiguous" to torch
               "sigma": torch.tensor([0.5]).as_strided((1,), (0,)), "context": torch.ones(1, 1, 3).expand(1, 2, 3)}
    specs, contiguous = framing.tensor_specs(tensors)
    for index, (spec, tensor) in enumerate(zip(specs, contiguous)):
        name, decoded = framing.tensor_of(spec, bytes(framing.frame_of(tensor)), index)
        assert torch.equal(decoded, tensors[name])
    with pytest.raises(framing.ProtocolError, match="tensor x has dtype torch.float64"):
        framing.tensor_specs({"x": torch.zeros(1, dtype=torch.float64)})
    with pytest.raises(framing.ProtocolError, match="has shape"):
        framing.check_spec({"name": "latents", "dtype": "float32", "shape": [-1]}, 0)
