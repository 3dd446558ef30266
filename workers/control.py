"""The private channel between the supervisor (launcher) and its ranks.

The supervisor binds a ROUTER; each rank connects a DEALER whose identity is `rank<N>`. Messages
are single header maps of framing.py (no tensors). Ranks report hello/ready/failed, job
start/end/error; the supervisor grants rank 0 the client endpoint (`bind_ok`) and decides after a
job error whether ranks resume or the pool restarts. Only processes of this pool talk here, but it is still msgpack, not pickle.
Every message names the launch it comes from (the supervisor's restart count when it started the
rank), so a late message from a rank of a previous launch cannot act on the current one.

Each rank also beats (Heartbeat: its own thread and socket, identity `rank<N>-beat`) every
BEAT_EVERY_S, so the supervisor's watchdog notices a rank that is stopped or wedged even while its
peers wait for it in a collective that gloo would let hang for 30 minutes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import zmq

from .framing import ProtocolError, pack_header, unpack_header

MAX_CONTROL_BYTES = 16 * 1024 * 1024  # a rank's start-up failure carries its traceback
BEAT_EVERY_S = 1.0
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


class Heartbeat(threading.Thread):
    """A rank's beat to its supervisor, with `progress()` (state, step) for the watchdog's message.

    `beat_now()` sends the next beat at once: a client's stop reaches the supervisor without waiting a beat."""

    def __init__(self, context: zmq.Context, endpoint: str, rank: int, launch: int, progress: Callable[[], dict]):
        super().__init__(name="xdit-heartbeat", daemon=True)
        self.context, self.endpoint, self.rank, self.launch, self.progress = context, endpoint, rank, launch, progress
        self._stopped, self._wake = threading.Event(), threading.Event()

    def run(self) -> None:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, f"rank{self.rank}-beat".encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.endpoint)
        try:
            while True:
                self._wake.wait(BEAT_EVERY_S)
                self._wake.clear()
                if self._stopped.is_set():
                    break
                try:
                    socket.send(pack({"type": "beat", "rank": self.rank, "launch": self.launch, **self.progress()}),
                                flags=zmq.NOBLOCK)
                except zmq.Again:  # the supervisor is busy: the next beat says the same
                    pass
        finally:
            socket.close()

    def beat_now(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        self.join(timeout=2 * BEAT_EVERY_S)
