"""The private channel between the supervisor (launcher) and its ranks.

The supervisor binds a ROUTER; each rank connects a DEALER whose identity is `rank<N>`. Messages
are single header maps of framing.py (no tensors). Ranks report hello/ready/failed, job
start/end/error; the supervisor grants rank 0 the client endpoint (`bind_ok`) and decides after a
job error whether ranks resume or the pool restarts. Only processes of this pool talk here, but it is still msgpack, not pickle.
Every message names the launch it comes from (the supervisor's restart count when it started the
rank), so a late message from a rank of a previous launch cannot act on the current one.
"""

from __future__ import annotations

from typing import Any

import zmq

from .framing import ProtocolError, pack_header, unpack_header

MAX_CONTROL_BYTES = 16 * 1024 * 1024  # a rank's start-up failure carries its traceback
pack = pack_header


def unpack(raw: bytes) -> dict[str, Any]:
    message = unpack_header(raw, MAX_CONTROL_BYTES)
    if "type" not in message:
        raise ProtocolError("control message must be a map with a type")
    return message


class RankChannel:
    """A rank's end of the control channel."""

    def __init__(self, context: zmq.Context, endpoint: str, rank: int, launch: int):
        self.rank, self.launch = rank, launch
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.connect(endpoint)

    def send(self, kind: str, **fields: Any) -> None:
        self.socket.send(pack({"type": kind, "rank": self.rank, "launch": self.launch, **fields}))

    def receive(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        if timeout_s is not None and not self.socket.poll(int(timeout_s * 1000)):
            return None
        return unpack(self.socket.recv())

    def close(self) -> None:
        self.socket.close()
