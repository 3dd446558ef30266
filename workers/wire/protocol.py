"""The pool's wire format: a versioned msgpack header plus raw tensor frames. No pickle, ever.

A message is the multipart [header, frame_0, frame_1, ...] of framing.py. The header is a msgpack map:
    {"v": PROTOCOL_VERSION, "type": ..., "job": ..., "params": {...},
     "tensors": [{"name": ..., "dtype": ..., "shape": [...]}, ...]}
with one frame per tensor spec holding the tensor's bytes (C order, little endian). `params` are the
fields of the message's kind (messages.py), which also names the tensors the kind accepts. Decoding checks
everything before any tensor is built: version, type, sizes, dtypes, shapes against frame lengths, then
the kind's own fields, once; the typed value rides along as `Message.body`. Any violation raises
ProtocolError with one line saying what was wrong, which the server sends back as an `error` reply.

The same codec carries rank 0's work to the other ranks (rank/work.py): `read_header` there, then the
tensors arrive by broadcast, then `assemble` reads the kind's fields, as one decode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .framing import (  # the wire's dtypes and limits are the framing's; protocol users read them here
    MAX_DIMS,
    MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    WIRE_DTYPES,
    ProtocolError,
    check_spec,
    frame_of,
    pack_header,
    tensor_of,
    tensor_specs,
    unpack_header,
)
from ..engine import fields
from .messages import CLIENT_KINDS, MAX_LORAS, MAX_PROMPT_CHARS, SERVER_KINDS, Kind, job_inputs

PROTOCOL_VERSION = 2  # 2: family scalars travel in params["call"]
MAX_TENSORS = 16
# Endpoints let ZMQ drop a sender whose frame passes this, unread; smaller oversize tensors get an error reply.
MAX_WIRE_FRAME_BYTES = 8 * MAX_FRAME_BYTES
CLIENT_MESSAGES = tuple(CLIENT_KINDS)
SERVER_MESSAGES = tuple(SERVER_KINDS)
_JOB_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

__all__ = ["MAX_DIMS", "MAX_HEADER_BYTES", "MAX_LORAS", "MAX_PROMPT_CHARS", "WIRE_DTYPES", "job_inputs"]


@dataclass
class Message:
    """One message as it travels: its type, job id, params (a plain map) and tensors. `body` is the typed value of
    a decoded client message (messages.py), read once where it arrived."""

    type: str
    job: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    body: Kind | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, body: Kind, job: str = "", tensors: dict | None = None) -> "Message":
        """A typed message ready to send."""
        return cls(body.TYPE, job, body.params(), tensors or {}, body)


def encode(message: Message) -> list:
    """Header bytes followed by one zero-copy buffer per tensor."""
    header, tensors = encode_header(message)
    return [header, *map(frame_of, tensors)]


def encode_header(message: Message) -> tuple[bytes, list]:
    """The header bytes and the contiguous CPU tensors whose bytes follow it."""
    specs, tensors = tensor_specs(message.tensors)
    header = {"v": PROTOCOL_VERSION, "type": message.type, "job": message.job, "params": message.params, "tensors": specs}
    return pack_header(header), tensors


@dataclass(frozen=True)
class Header:
    """A header read and checked, its kind's fields typed (`body`), before its tensors are built."""

    type: str
    job: str
    params: dict[str, Any]
    specs: list
    body: Kind | None


def read_header(raw: bytes, kinds: Mapping[str, type[Kind] | None], max_bytes: int = MAX_HEADER_BYTES) -> Header:
    header = unpack_header(raw, max_bytes)
    if type(header.get("v")) is not int or header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not supported; this pool speaks {PROTOCOL_VERSION}")
    kind = header.get("type")
    if not isinstance(kind, str) or kind not in kinds:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {sorted(kinds)}")
    job = header.get("job", "")
    if not isinstance(job, str) or (job and not _JOB_ID.fullmatch(job)):
        raise ProtocolError("job id must be 1-64 characters of letters, digits, '_', '.', ':' or '-'")
    params = header.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolError("params must be a map")
    specs = header.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError(f"tensors must be a list of at most {MAX_TENSORS} specs")
    body_kind = kinds[kind]  # its fields are read before any tensor memory is given
    return Header(kind, job, params, specs, _body(body_kind, params) if body_kind is not None else None)


def _body(kind: type[Kind], params: dict) -> Kind:
    try:
        body = fields.from_plain(kind, params, kind.TYPE)
        body.validate()
    except ValueError as error:
        raise ProtocolError(str(error)) from None
    return body


def assemble(header: Header, tensors: dict[str, Any]) -> Message:
    """The message a checked header and its tensors make."""
    return Message(header.type, header.job, header.params, tensors, header.body)


def decode(frames: list, *, from_client: bool = True, kinds: Mapping[str, type[Kind] | None] | None = None) -> Message:
    """Validate a multipart message (without the ROUTER identity) and build its tensors. From a client, each kind
    is checked against its declaration (`kinds`, default: the client kinds); from the pool, the replies' params are
    kept as sent (a client reads them through their kinds, e.g. PoolStatus)."""
    if not frames:
        raise ProtocolError("empty message")
    frames = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    if kinds is None:
        kinds = CLIENT_KINDS if from_client else dict.fromkeys(SERVER_KINDS)
    header = read_header(bytes(frames[0]), kinds)
    if len(header.specs) != len(frames) - 1:
        raise ProtocolError(f"header lists {len(header.specs)} tensors but {len(frames) - 1} frames arrived")
    kind = kinds[header.type]
    allowed = kind.tensor_names() if kind is not None else None
    tensors = dict(tensor_of(spec, frame, i, allowed) for i, (spec, frame) in enumerate(zip(header.specs, frames[1:])))
    if len(tensors) != len(header.specs):
        raise ProtocolError("tensor names must be unique")
    return assemble(header, tensors)


def check_specs(header: Header, kinds: Mapping[str, type[Kind] | None]) -> list:
    """(name, dtype, shape) of each tensor a header announces, checked as decode checks them."""
    kind = kinds[header.type]
    allowed = kind.tensor_names() if kind is not None else None
    specs = [check_spec(spec, i, allowed) for i, spec in enumerate(header.specs)]
    if len({name for name, _, _ in specs}) != len(specs):
        raise ProtocolError("tensor names must be unique")
    return specs
