"""The pool's wire format: a versioned msgpack header plus raw tensor frames. No pickle, ever.

A message is the multipart [header, frame_0, frame_1, ...]. The header is a msgpack map:
    {"v": PROTOCOL_VERSION, "type": ..., "job": ..., "params": {...},
     "tensors": [{"name": ..., "dtype": ..., "shape": [...]}, ...]}
with one frame per tensor spec holding the tensor's bytes (C order, little endian). Decoding checks
everything before any tensor is built: version, type, sizes, dtypes, shapes against frame lengths,
and the parameters each message type takes. Any violation raises ProtocolError with one line saying
what was wrong, which the server sends back as an `error` reply.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from .engine import PIPELINE_TENSOR_INPUTS

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_TENSORS = 16
MAX_DIMS = 6
MAX_PROMPT_CHARS = 20_000
MAX_LORAS = 16

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
JOB_INPUTS = (*PIPELINE_TENSOR_INPUTS, "init_latents")  # init_latents: img2img's starting point

# type -> {param: (python types, required)}; anything else in params is an error.
_NUMBER = (int, float)
CLIENT_MESSAGES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "submit": {
        "steps": ((int,), True),
        "guidance_scale": (_NUMBER, True),
        "height": ((int,), True),
        "width": ((int,), True),
        "true_cfg_scale": (_NUMBER, False),
        "scheduler": ((str,), False),
        "preview": ((bool,), False),
        "denoise": (_NUMBER, False),
        "num_frames": ((int,), False),
        "loras": ((list,), False),
    },
    # With seed (and height, width): the whole inputs of a job, negative prompt and initial noise included.
    "encode": {"prompt": ((str,), True), "negative_prompt": ((str,), False), "seed": ((int,), False),
               "height": ((int,), False), "width": ((int,), False)},
    "cancel": {},
    "status": {},
    "stop": {},
}
SERVER_MESSAGES = ("accepted", "step", "result", "error", "cancelled", "status", "stopping")
_JOB_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text is safe to send back to the client."""


@dataclass
class Message:
    type: str
    job: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def encode(message: Message) -> list:
    """Header bytes followed by one zero-copy buffer per tensor."""
    specs, frames = [], []
    for name, tensor in message.tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise ProtocolError(f"tensor {name} has dtype {tensor.dtype}; the wire carries {list(DTYPES)}")
        tensor = tensor.detach().to("cpu").contiguous()
        specs.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)})
        frames.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b"")
    header = {"v": PROTOCOL_VERSION, "type": message.type, "job": message.job, "params": message.params, "tensors": specs}
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _reject_ext(code, data):
    raise ProtocolError(f"header uses msgpack extension type {code}; only plain maps, lists, strings and numbers are allowed")


def _decode_header(raw: bytes) -> dict:
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(raw)} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_reject_ext)
    except ProtocolError:
        raise
    except Exception as error:  # msgpack raises many types for garbage; all mean the same here
        raise ProtocolError(f"header is not valid msgpack ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    _check_plain(header)
    if type(header.get("v")) is not int or header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not supported; this pool speaks {PROTOCOL_VERSION}")
    return header


def _check_plain(value: Any, depth: int = 0) -> None:
    """Only maps with string keys, lists, strings, bytes, numbers, booleans and nil may appear."""
    if depth > 16:
        raise ProtocolError("header nests deeper than 16 levels")
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


def _tensor(spec: Any, frame, index: int, allowed_names: tuple[str, ...] | None) -> tuple[str, torch.Tensor]:
    if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape"}:
        raise ProtocolError(f"tensor spec {index} must be a map with exactly name, dtype and shape")
    name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
    if not isinstance(name, str) or (allowed_names is not None and name not in allowed_names):
        raise ProtocolError(f"tensor {name!r} is not accepted here; allowed: {list(allowed_names or [])}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"tensor {name} has dtype {dtype!r}; allowed: {list(DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_FRAME_BYTES for d in shape)
        or math.prod(d for d in shape if d) > MAX_FRAME_BYTES
    ):
        raise ProtocolError(f"tensor {name} has shape {shape!r}; expected a list of at most {MAX_DIMS} sizes >= 0")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    size = len(frame)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"tensor {name} is {size} bytes; the limit per tensor is {MAX_FRAME_BYTES}")
    if size != expected:
        raise ProtocolError(f"tensor {name} {dtype}{shape} needs {expected} bytes but its frame has {size}")
    if expected == 0:
        return name, torch.empty(shape, dtype=DTYPES[dtype])
    data = torch.frombuffer(bytearray(frame) if isinstance(frame, bytes) else frame, dtype=torch.uint8)
    return name, data.view(DTYPES[dtype]).reshape(shape)


def decode(frames: list, *, from_client: bool = True) -> Message:
    """Validate a multipart message (without the ROUTER identity) and build its tensors."""
    if not frames:
        raise ProtocolError("empty message")
    frames = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    header = _decode_header(bytes(frames[0]))
    kind = header.get("type")
    known = CLIENT_MESSAGES if from_client else dict.fromkeys(SERVER_MESSAGES)
    if not isinstance(kind, str) or kind not in known:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {sorted(known)}")
    job = header.get("job", "")
    if not isinstance(job, str) or (job and not _JOB_ID.fullmatch(job)):
        raise ProtocolError("job id must be 1-64 characters of letters, digits, '_', '.', ':' or '-'")
    params = header.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolError("params must be a map")
    if from_client:
        _check_params(kind, params)
    specs = header.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError(f"tensors must be a list of at most {MAX_TENSORS} specs")
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"header lists {len(specs)} tensors but {len(frames) - 1} frames arrived")
    allowed = (JOB_INPUTS if kind == "submit" else ()) if from_client else None
    tensors = dict(_tensor(spec, frame, i, allowed) for i, (spec, frame) in enumerate(zip(specs, frames[1:])))
    if len(tensors) != len(specs):
        raise ProtocolError("tensor names must be unique")
    return Message(kind, job, params, tensors)


def _check_loras(loras: list) -> None:
    if len(loras) > MAX_LORAS:
        raise ProtocolError(f"{len(loras)} LoRAs in one job; the limit is {MAX_LORAS}")
    for lora in loras:
        if (
            not isinstance(lora, dict)
            or set(lora) != {"path", "strength"}
            or not isinstance(lora["path"], str)
            or not isinstance(lora["strength"], _NUMBER)
            or isinstance(lora["strength"], bool)
            or not math.isfinite(lora["strength"])
        ):
            raise ProtocolError("each LoRA must be a map {path: string, strength: finite number}")


def _check_params(kind: str, params: dict) -> None:
    schema = CLIENT_MESSAGES[kind]
    unknown = sorted(set(params) - set(schema))
    if unknown:
        raise ProtocolError(f"{kind} does not take {unknown}; it takes {sorted(schema)}")
    for name, (types, required) in schema.items():
        if name not in params:
            if required:
                raise ProtocolError(f"{kind} needs {name!r}")
            continue
        value = params[name]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise ProtocolError(f"{kind} {name} must be {' or '.join(t.__name__ for t in types)}, not {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(f"{kind} {name} must be finite")
    if kind == "encode":
        for name in ("prompt", "negative_prompt"):
            if len(params.get(name, "")) > MAX_PROMPT_CHARS:
                raise ProtocolError(f"{name} is {len(params[name])} characters; the limit is {MAX_PROMPT_CHARS}")
        if "seed" in params and not {"height", "width"} <= set(params):
            raise ProtocolError("encode with a seed needs height and width (the size of the initial noise)")
    if kind == "submit":
        _check_loras(params.get("loras", []))
        if "denoise" in params and not 0.0 < params["denoise"] <= 1.0:
            raise ProtocolError(f"denoise is {params['denoise']}; use a value above 0 and at most 1")
        if not 1 <= params["steps"] <= 1000:
            raise ProtocolError(f"steps is {params['steps']}; use 1 to 1000")
        for side in ("height", "width"):
            if not 8 <= params[side] <= 16384:
                raise ProtocolError(f"{side} is {params[side]}; use 8 to 16384")
