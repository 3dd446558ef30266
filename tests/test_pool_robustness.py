"""Malformed input never kills or wedges a running pool (real pool, real ZMQ sockets).

Each bad message gets an `error` reply (or is dropped by ZMQ), the pool stays idle with no
restart, and a normal job afterwards still equals diffusers' single-process result. Well-formed messages
with nonsense values (NaN or infinite tensors, integer or boolean latents and embeddings, a prompt of no
token) are refused at submit with one line, before any compute.
"""

from __future__ import annotations

import pickle
import time
import uuid

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallel.loading import tiny_models
from workers.wire import protocol
from workers.wire.protocol import Message

from xdit_test_helpers import TOLERANCE
from pool_helpers import PARAMS, free_endpoint, idle_client, owner_socket, reference, start_serve, stop_serve

FAMILY = "sd3"
SIDE_EFFECTS: list[str] = []


class Exploit:
    """Unpickling this would record a side effect: proof that nothing unpickled it."""

    def __reduce__(self):
        return (SIDE_EFFECTS.append, ("unpickled!",))


@pytest.fixture(scope="module")
def pool(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("robust")
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs[FAMILY], endpoint, "--nproc", "2", "--ring-degree", "2", log=work / "serve.log")
    client, _ = idle_client(endpoint)
    inputs = tiny_models.make_inputs(FAMILY)
    yield {"endpoint": endpoint, "client": client, "inputs": inputs,
           "expected": reference(tiny_model_dirs[FAMILY], FAMILY, inputs)}
    client.close()
    stop_serve(process)


@pytest.fixture(scope="module")
def raw(pool):
    socket = owner_socket()
    socket.setsockopt(zmq.IDENTITY, f"fuzz-{uuid.uuid4().hex}".encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(pool["endpoint"])
    yield socket
    socket.close()


def exchange(socket, frames: list, timeout_s: float = 5.0) -> Message | None:
    socket.send_multipart(frames)
    if not socket.poll(int(timeout_s * 1000)):
        return None
    return protocol.decode(socket.recv_multipart(), from_client=False)


def header(**fields) -> bytes:
    return msgpack.packb({"v": protocol.PROTOCOL_VERSION, "type": "submit", "job": "bad", "params": dict(PARAMS), "tensors": [], **fields})


def assert_pool_healthy(pool):
    status = pool["client"].status()
    assert status["state"] == "idle" and status["restarts"] == 0 and status["ranks_alive"] == 2
    latents = pool["client"].sample(pool["inputs"], PARAMS)
    assert (latents - pool["expected"]).abs().max().item() <= TOLERANCE


LATENTS_SPEC = {"name": "latents", "dtype": "float32", "shape": [1, 16, 8, 8]}
BAD_MESSAGES = {
    "random bytes": [bytes(range(256)) * 3],
    "empty frame": [b""],
    "truncated multipart": [header(tensors=[LATENTS_SPEC, {**LATENTS_SPEC, "name": "prompt_embeds"}]), bytes(4096)],
    "truncated frame": [header(tensors=[LATENTS_SPEC]), bytes(100)],
    "100 MB frame": [header(tensors=[{"name": "latents", "dtype": "float32", "shape": [25_000_000]}]), bytes(100_000_000)],
    "wrong dtype": [header(tensors=[{**LATENTS_SPEC, "dtype": "float64"}]), bytes(8192)],
    "wrong shape for the model": [header(tensors=[{**LATENTS_SPEC, "shape": [1, 4, 8, 8]}]), bytes(1024)],
    "unknown message type": [header(type="format_disk")],
    "old protocol version": [header(v=0)],
    "pickle header": [pickle.dumps(Exploit())],
    "pickle frame": [header(tensors=[{"name": "latents", "dtype": "float32", "shape": [len(pickle.dumps(Exploit())) // 4]}]),
                     pickle.dumps(Exploit())[: 4 * (len(pickle.dumps(Exploit())) // 4)]],
    "missing latents": [header()],
}


@pytest.mark.parametrize("name", list(BAD_MESSAGES))
def test_bad_message_gets_an_error_and_the_pool_stays_healthy(pool, raw, name):
    reply = exchange(raw, BAD_MESSAGES[name])
    assert reply is not None and reply.type == "error", reply
    assert reply.params["message"]
    assert SIDE_EFFECTS == []
    assert_pool_healthy(pool)


def _nan_latents(inputs):
    latents = inputs["latents"].clone()
    latents[0, 0, 0, 0] = float("nan")
    return {**inputs, "latents": latents}


NONSENSE_VALUES = {  # name: (inputs → bad inputs, the one line that refuses them)
    "NaN latents": (_nan_latents, "latents has 1 NaN or infinite values of 1024; send finite values"),
    "infinite embeddings": (lambda i: {**i, "prompt_embeds": torch.full_like(i["prompt_embeds"], float("inf"))},
                            "prompt_embeds has .* NaN or infinite values"),
    "int64 latents": (lambda i: {**i, "latents": i["latents"].round().long()},
                      "latents is int64; send floating-point values"),
    "bool latents": (lambda i: {**i, "latents": i["latents"] > 0}, "latents is bool; send floating-point values"),
    "int64 embeddings": (lambda i: {**i, "prompt_embeds": i["prompt_embeds"].long()},
                         "prompt_embeds is int64; send floating-point values"),
    "0-token prompt": (lambda i: {**i, "prompt_embeds": i["prompt_embeds"][:, :0]},
                       "prompt_embeds has no tokens; encode the prompt with this model's text encoders"),
}


@pytest.mark.parametrize("case", NONSENSE_VALUES)
def test_nonsense_values_get_one_clear_error_and_no_result(pool, case):
    from workers.client import JobFailed

    spoil, message = NONSENSE_VALUES[case]
    with pytest.raises(JobFailed, match=message) as refused:
        pool["client"].sample(spoil(pool["inputs"]), PARAMS)
    assert "\n" not in str(refused.value)
    assert_pool_healthy(pool)


def test_client_that_disappears_mid_job_frees_the_pool(pool):
    socket = owner_socket()
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(pool["endpoint"])
    socket.send_multipart(protocol.encode(Message("submit", "vanishing", {**PARAMS, "steps": 1000}, pool["inputs"])))
    while protocol.decode(socket.recv_multipart(), from_client=False).type != "step":
        pass
    socket.close()
    deadline = time.monotonic() + 10
    while pool["client"].status()["state"] != "idle":
        assert time.monotonic() < deadline, "the job of a vanished client kept running"
        time.sleep(0.05)
    assert_pool_healthy(pool)


frames_strategy = st.lists(st.binary(max_size=512), min_size=1, max_size=4)
json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
VERSION = protocol.PROTOCOL_VERSION
headers_strategy = st.fixed_dictionaries(
    {"v": st.sampled_from([VERSION, VERSION, VERSION + 1, str(VERSION)]), "type": st.sampled_from(["submit", "cancel", "status", "??"]),
     "job": st.text(max_size=70), "params": json_like, "tensors": json_like}
).map(msgpack.packb)  # "stop" is left out: it is valid and would end the pool


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(frames_strategy, st.tuples(headers_strategy, st.lists(st.binary(max_size=256), max_size=3)).map(lambda t: [t[0], *t[1]])))
def test_fuzz_random_messages_never_break_the_pool(pool, raw, frames):
    reply = exchange(raw, frames, timeout_s=5.0)
    assert reply is not None and reply.type in ("error", "status")


def test_pool_is_healthy_after_the_fuzzing(pool):
    assert SIDE_EFFECTS == []
    assert_pool_healthy(pool)
