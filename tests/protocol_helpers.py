"""Shared pieces of the protocol tests (test_protocol_round_trip / _rejections / _fuzz): valid
headers to start from, byte-level tensor comparisons, and `rejects`, which also checks that every
error is one line."""

from __future__ import annotations

import math
import random

import msgpack
import pytest
import torch

from workers.wire.protocol import CLIENT_MESSAGES, PROTOCOL_VERSION, SERVER_MESSAGES, ProtocolError, decode

CLIENT_TYPES = sorted(CLIENT_MESSAGES)
ALL_TYPES = sorted(set(CLIENT_MESSAGES) | set(SERVER_MESSAGES))
SUBMIT_PARAMS = {"steps": 20, "guidance_scale": 4.5, "height": 64, "width": 48}
# The smallest valid params of each client type that has required ones (see test_minimal_params_cover_schema).
MINIMAL_PARAMS = {"submit": SUBMIT_PARAMS, "encode": {"prompt": "a red cube on a table"}}


def minimal_params(kind: str) -> dict:
    return dict(MINIMAL_PARAMS.get(kind, {}))


def pack(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def header(kind="status", **fields) -> dict:
    return {"v": PROTOCOL_VERSION, "type": kind, **fields}


def submit_header(tensors=None, **params) -> dict:
    merged = {**SUBMIT_PARAMS, **params}
    built = header("submit", job="job-1", params={k: v for k, v in merged.items() if v is not DROP})
    return built if tensors is None else {**built, "tensors": tensors}


DROP = object()


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

