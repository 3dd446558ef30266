"""The pool's wire format: a versioned msgpack header plus raw tensor frames. No pickle, ever.

A message is the multipart [header, frame_0, frame_1, ...] of framing.py. The header is a msgpack map:
    {"v": PROTOCOL_VERSION, "type": ..., "job": ..., "params": {...},
     "tensors": [{"name": ..., "dtype": ..., "shape": [...]}, ...]}
with one frame per tensor spec holding the tensor's bytes (C order, little endian). A submit's params
are a SampleRequest (parallel/request.py: steps, guidance_scale, height, width, denoise and `call`, the
family's own scalars) plus the pool's own scheduler, preview and loras. Decoding checks
everything before any tensor is built: version, type, sizes, dtypes, shapes against frame lengths,
and the parameters each message type takes. Any violation raises ProtocolError with one line saying
what was wrong, which the server sends back as an `error` reply.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .conditioning import KEY as CONDITIONING_KEY
from .engine import MODEL_CALL_TENSORS, PIPELINE_TENSOR_INPUTS, request
from .framing import (  # the wire's dtypes and limits are the framing's; protocol users read them here
    DTYPE_NAMES,
    DTYPES,
    MAX_DIMS,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    ProtocolError,
    frame_of,
    pack_header,
    tensor_of,
    tensor_specs,
    unpack_header,
)

PROTOCOL_VERSION = 2  # 2: family scalars travel in params["call"]
MAX_TENSORS = 16
# Endpoints let ZMQ drop a sender whose frame passes this, unread; smaller oversize tensors get an error reply.
MAX_WIRE_FRAME_BYTES = 8 * MAX_FRAME_BYTES
MAX_PROMPT_CHARS = 20_000
MAX_LORAS = 16
JOB_INPUTS = (*PIPELINE_TENSOR_INPUTS, "init_latents")  # init_latents: img2img's starting point

# type -> {param: (python types, required)}; anything else in params is an error. A submit's request
# fields (parallel/request.py) are checked by SampleRequest; the rest here.
_NUMBER = (int, float)
POOL_PARAMS: dict[str, tuple[tuple[type, ...], bool]] = {
    "scheduler": ((str,), False),
    "preview": ((bool,), False),
    "model_latents": ((bool,), False),  # the result as the pipeline's loop keeps latents (xDiT Sampler's conversion)
    "loras": ((list,), False),
}
CLIENT_MESSAGES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "submit": {**{name: (spec.types, spec.required) for name, spec in request.FIELDS.items()}, **POOL_PARAMS},
    # With seed (and height, width): the whole inputs of a job, negative prompt and initial noise included. An `image`
    # tensor ([N, 3, H, W] in [0, 1]) is encoded with the prompts where the text encoder sees images (edit models).
    "encode": {"prompt": ((str,), True), "negative_prompt": ((str,), False), "seed": ((int,), False),
               "height": ((int,), False), "width": ((int,), False)},
    # One model evaluation (ComfyUI's samplers through xDiT Model): latents, sigma and the conditioning, each
    # conditioning tensor named by its key (conditioning.py) and sent only when the pool may not hold it.
    "evaluate": {"conditioning": ((dict,), False), "loras": ((list,), False)},
    # Decode LATENT tensors with the pool's VAE, tiles over the ranks (parallel/vae_decode.py); tile in latent pixels.
    "decode": {"tile": ((int,), False)},
    "cancel": {},
    "status": {"job": ((str,), False)},  # with job: also that job's state (queued, running, unknown)
    "stop": {},
}
SERVER_MESSAGES = ("accepted", "step", "result", "error", "cancelled", "status", "stopping")
_JOB_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass
class Message:
    type: str
    job: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def encode(message: Message) -> list:
    """Header bytes followed by one zero-copy buffer per tensor."""
    specs, tensors = tensor_specs(message.tensors)
    header = {"v": PROTOCOL_VERSION, "type": message.type, "job": message.job, "params": message.params, "tensors": specs}
    return [pack_header(header), *map(frame_of, tensors)]


def _decode_header(raw: bytes) -> dict:
    header = unpack_header(raw)
    if type(header.get("v")) is not int or header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not supported; this pool speaks {PROTOCOL_VERSION}")
    return header


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
    allowed = {"submit": JOB_INPUTS, "decode": ("latents",), "evaluate": MODEL_CALL_TENSORS,
               "encode": ("image",)}.get(kind, ()) if from_client else None
    tensors = dict(tensor_of(spec, frame, i, allowed) for i, (spec, frame) in enumerate(zip(specs, frames[1:])))
    if len(tensors) != len(specs):
        raise ProtocolError("tensor names must be unique")
    return Message(kind, job, params, tensors)


def _check_loras(loras: list) -> None:
    if len(loras) > MAX_LORAS:
        raise ProtocolError(f"{len(loras)} LoRAs in one job; the limit is {MAX_LORAS}")
    for lora in loras:
        if (
            not isinstance(lora, dict)
            or set(lora) - {"expert"} != {"path", "strength"}
            or not isinstance(lora["path"], str)
            or not isinstance(lora.get("expert", ""), str)
            or not isinstance(lora["strength"], _NUMBER)
            or isinstance(lora["strength"], bool)
            or not math.isfinite(lora["strength"])
        ):
            raise ProtocolError("each LoRA must be a map {path: string, strength: finite number, expert: optional string}")


def _check_params(kind: str, params: dict) -> None:
    schema = CLIENT_MESSAGES[kind]
    unknown = sorted(set(params) - set(schema))
    if unknown:
        raise ProtocolError(f"{kind} does not take {unknown}; it takes {sorted(schema)}")
    own = POOL_PARAMS if kind == "submit" else schema
    try:
        request.check_fields({name: request.Field(types, required) for name, (types, required) in own.items()}, params)
        if kind == "submit":
            sample_request(params)
    except ValueError as error:
        raise ProtocolError(f"{kind} {error}") from None
    if kind == "encode":
        for name in ("prompt", "negative_prompt"):
            if len(params.get(name, "")) > MAX_PROMPT_CHARS:
                raise ProtocolError(f"{name} is {len(params[name])} characters; the limit is {MAX_PROMPT_CHARS}")
        if "seed" in params and not {"height", "width"} <= set(params):
            raise ProtocolError("encode with a seed needs height and width (the size of the initial noise)")
    if kind in ("submit", "evaluate"):
        _check_loras(params.get("loras", []))
    if kind == "evaluate":
        for name, key in params.get("conditioning", {}).items():
            if name not in MODEL_CALL_TENSORS or not isinstance(key, str) or not CONDITIONING_KEY.fullmatch(key):
                raise ProtocolError("evaluate's conditioning maps model-call tensor names to 32-hex-digit keys (conditioning.key_of)")


def sample_request(params: dict, declared=None, model: str = "this model") -> request.SampleRequest:
    """The SampleRequest a submit's params carry (its other params are the pool's: scheduler, preview,
    loras); `declared`: the family's call_parameters, which only the pool knows."""
    return request.SampleRequest.from_params({k: v for k, v in params.items() if k in request.FIELDS}, declared, model)
