"""The pool's one msgpack framing: a header map plus one raw frame per tensor. No pickle, ever.

Every channel uses it: client ↔ rank 0 (protocol.py), the supervisor's control channel (control.py)
and the work broadcast from rank 0 to the other ranks (rank/work.py). A header holds only plain msgpack
values (maps with string keys, lists, strings, bytes, numbers, booleans, nil); a tensor travels as a spec
{"name", "dtype", "shape"} in the header and its bytes (C order, little endian) in its own frame.
torch is imported only where a tensor is made or read, so the pool's light commands (status, stop) run
without it.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import msgpack

MAX_HEADER_BYTES = 64 * 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_DIMS = 6
MAX_DEPTH = 16
WIRE_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")


@cache
def _dtypes() -> dict:
    import torch

    return {name: getattr(torch, name) for name in WIRE_DTYPES}


def __getattr__(name: str):
    """DTYPES (wire name → torch dtype) and DTYPE_NAMES (its inverse), made when first read."""
    if name == "DTYPES":
        return _dtypes()
    if name == "DTYPE_NAMES":
        return {dtype: key for key, dtype in _dtypes().items()}
    raise AttributeError(name)


class ProtocolError(ValueError):
    """A message that breaks the framing or the protocol; the text is one line, safe to send back."""


def pack_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _reject_ext(code, data):
    raise ProtocolError(f"header uses msgpack extension type {code}; only plain maps, lists, strings and numbers are allowed")


def unpack_header(raw: bytes, max_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """A header map of plain values, or ProtocolError saying what is wrong with it."""
    if len(raw) > max_bytes:
        raise ProtocolError(f"header is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_reject_ext)
    except ProtocolError:
        raise
    except Exception as error:  # msgpack raises many types for garbage; all mean the same here
        raise ProtocolError(f"header is not valid msgpack ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    _check_plain(header)
    return header


def _check_plain(value: Any, depth: int = 0) -> None:
    """Only maps with string keys, lists, strings, bytes, numbers, booleans and nil may appear."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"header nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise ProtocolError("header map keys must be strings")
        for item in value.values():
            _check_plain(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_plain(item, depth + 1)
    elif value is not None and not isinstance(value, (str, bytes, int, float, bool)):
        raise ProtocolError(f"header holds a {type(value).__name__}; only plain msgpack values are allowed")


def tensor_specs(tensors: dict) -> tuple[list[dict[str, Any]], list]:
    """Header specs and the contiguous CPU tensors whose bytes are the frames."""
    specs, contiguous = [], []
    if not tensors:  # a control or status message: no torch import (the light CLI commands)
        return specs, contiguous
    import torch

    names = {dtype: key for key, dtype in _dtypes().items()}
    for name, tensor in tensors.items():
        if tensor.dtype not in names:
            raise ProtocolError(f"tensor {name} has dtype {tensor.dtype}; the wire carries {list(WIRE_DTYPES)}")
        tensor = tensor.detach().to("cpu")
        if not tensor.is_contiguous() or tensor.numel() and tensor.reshape(-1).stride(0) != 1:
            tensor = tensor.clone(memory_format=torch.contiguous_format)  # one element expanded: stride 0 still counts as contiguous
        specs.append({"name": name, "dtype": names[tensor.dtype], "shape": list(tensor.shape)})
        contiguous.append(tensor)
    return specs, contiguous


def frame_of(tensor):
    """A zero-copy buffer of a contiguous CPU tensor's bytes."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b""


def check_spec(spec: Any, index: int, allowed_names: tuple[str, ...] | None = None) -> tuple[str, Any, list[int]]:
    """A tensor spec's name, dtype and shape, checked before any memory is given to it."""
    if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape"}:
        raise ProtocolError(f"tensor spec {index} must be a map with exactly name, dtype and shape")
    name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
    if not isinstance(name, str) or (allowed_names is not None and name not in allowed_names):
        raise ProtocolError(f"tensor {name!r} is not accepted here; allowed: {list(allowed_names or [])}")
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor {name} has dtype {dtype!r}; allowed: {list(WIRE_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_FRAME_BYTES for d in shape)
        or math.prod(d for d in shape if d) > MAX_FRAME_BYTES
    ):
        raise ProtocolError(f"tensor {name} has shape {shape!r}; expected a list of at most {MAX_DIMS} sizes >= 0")
    return name, _dtypes()[dtype], shape


def tensor_of(spec: Any, frame, index: int, allowed_names: tuple[str, ...] | None = None) -> tuple[str, Any]:
    """The named tensor a spec and its frame describe; the frame's length must match the spec."""
    import torch

    name, dtype, shape = check_spec(spec, index, allowed_names)
    expected = math.prod(shape) * dtype.itemsize
    size = len(frame)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"tensor {name} is {size} bytes; the limit per tensor is {MAX_FRAME_BYTES}")
    if size != expected:
        raise ProtocolError(f"tensor {name} {spec['dtype']}{shape} needs {expected} bytes but its frame has {size}")
    if expected == 0:
        return name, torch.empty(shape, dtype=dtype)
    data = torch.frombuffer(bytearray(frame) if isinstance(frame, bytes) else frame, dtype=torch.uint8)
    return name, data.view(dtype).reshape(shape)
