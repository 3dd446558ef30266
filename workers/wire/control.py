"""The private channel between the supervisor (supervisor/pool.py) and its ranks, and its typed messages.

The supervisor binds a ROUTER; each rank connects a DEALER whose identity is `rank<N>`. A message is one
framing.py header map: its type, the sending rank and launch, and the fields of its kind below (no tensors).
Ranks report hello/ready/failed, job start/end/error; the supervisor grants rank 0 the client endpoint
(`bind_ok`) and decides after a job error whether ranks resume or the pool restarts. Only processes of this
pool talk here, but it is still msgpack, not pickle, and every message is read against its kind.
Every message names the launch it comes from (the supervisor's restart count when it started the
rank), so a late message from a rank of a previous launch cannot act on the current one.

Each rank also beats (Heartbeat: its own thread and socket, identity `rank<N>-beat`) every
BEAT_EVERY_S, so the supervisor's watchdog notices a rank that is stopped or wedged even while its
peers wait for it in a collective that gloo would let hang for 30 minutes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import zmq

from ..engine import fields
from .framing import ProtocolError, pack_header, unpack_header

MAX_CONTROL_BYTES = 16 * 1024 * 1024  # a rank's start-up failure carries its traceback
BEAT_EVERY_S = 1.0
pack = pack_header
declared = fields.declared


def unpack(raw: bytes) -> dict[str, Any]:
    message = unpack_header(raw, MAX_CONTROL_BYTES)
    if "type" not in message:
        raise ProtocolError("control message must be a map with a type")
    return message


class Control:
    """A typed control message: `class Hello(Control, kind="hello")` names its kind and is made a frozen dataclass of
    its declared fields (see wire/messages.py's Kind)."""

    TYPE: ClassVar[str]

    def __init_subclass__(cls, kind: str, **options):
        super().__init_subclass__(**options)
        cls.TYPE = kind
        dataclass(frozen=True)(cls)


# -- rank → supervisor ----------------------------------------------------------------------------------
class Hello(Control, kind="hello"):
    """A rank started; its pid, for the supervisor's watch."""

    pid: int = declared()


class Ready(Control, kind="ready"):
    """Every rank has loaded and rank 0 takes jobs; `nodes`: the world's machines (status), from rank 0."""

    pid: int = declared()
    memory: dict[str, int] = declared(factory=dict)
    nodes: tuple[dict[str, Any], ...] = declared(())


class Failed(Control, kind="failed"):
    """Start-up failed; `fatal`: retrying cannot help (one machine, or a refused world), else the world broke;
    `mistake`: what the pool was asked to run cannot work (a layout, a model), which the CLI exits 2 for."""

    error: str = declared()
    traceback: str = declared("")
    fatal: bool = declared(True)
    mistake: bool = declared(False)


class WorldLost(Control, kind="world_lost"):
    """A collective failed: a peer died or its machine is gone."""

    error: str = declared()


class JobStarted(Control, kind="job_started"):
    """Rank 0 started a job of this client."""

    job: str = declared()
    client: bytes = declared()


class JobEnded(Control, kind="job_ended"):
    """Rank 0 finished a job."""

    job: str = declared()
    jobs_done: int = declared()


class JobError(Control, kind="job_error"):
    """A job failed on this rank (the supervisor judges whether every rank failed alike)."""

    job: str = declared()
    error: str = declared()


class Stopped(Control, kind="stopped"):
    """A client asked rank 0 to stop the pool; the ranks are exiting cleanly."""



class Beat(Control, kind="beat"):
    """A rank's heartbeat: its state and step, and whether a client asked to stop."""

    state: str = declared()
    step: int = declared(0)
    stopping: bool = declared(False)


class BindRequest(Control, kind="bind_request"):
    """Rank 0 asks for the client endpoint the supervisor's stand-in holds."""



# -- supervisor → rank ----------------------------------------------------------------------------------
class BindOk(Control, kind="bind_ok"):
    """The stand-in let the endpoint go: rank 0 binds it."""



class Resume(Control, kind="resume"):
    """Every rank failed the job alike: answer the client with the first rank's error and go on."""

    rank: int = declared()
    error: str = declared()


REPORTS = {kind.TYPE: kind for kind in (Hello, Ready, Failed, WorldLost, JobStarted, JobEnded, JobError, Stopped,
                                        Beat, BindRequest)}
ORDERS = {kind.TYPE: kind for kind in (BindOk, Resume)}


@dataclass(frozen=True)
class Report:
    """A rank's control message: who sent it, from which launch, and what."""

    rank: int
    launch: int
    body: Control


def read_report(raw: bytes) -> Report:
    message = unpack(raw)
    kind = REPORTS.get(message.pop("type"))
    rank, launch = message.pop("rank", -1), message.pop("launch", -1)
    if kind is None or type(rank) is not int or type(launch) is not int:
        raise ProtocolError("control message of an unknown type, or without its rank and launch")
    try:
        return Report(rank, launch, fields.from_plain(kind, message, kind.TYPE))
    except ValueError as error:
        raise ProtocolError(str(error)) from None


def order(body: Control) -> bytes:
    return pack({"type": body.TYPE, **fields.to_plain(body)})


class RankChannel:
    """A rank's end of the control channel."""

    def __init__(self, context: zmq.Context, endpoint: str, rank: int, launch: int):
        self.rank, self.launch = rank, launch
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.connect(endpoint)

    def send(self, body: Control) -> None:
        self.socket.send(report_bytes(body, self.rank, self.launch))

    def receive(self, timeout_s: float | None = None) -> Control | None:
        """The supervisor's next order, or None when none came within `timeout_s`."""
        if timeout_s is not None and not self.socket.poll(int(timeout_s * 1000)):
            return None
        message = unpack(self.socket.recv())
        kind = ORDERS[message.pop("type")]
        return fields.from_plain(kind, message, kind.TYPE)

    def close(self) -> None:
        self.socket.close()


def report_bytes(body: Control, rank: int, launch: int) -> bytes:
    return pack({"type": body.TYPE, "rank": rank, "launch": launch, **fields.to_plain(body)})


class Heartbeat(threading.Thread):
    """A rank's beat to its supervisor, with `progress()` (a Beat: state, step) for the watchdog's message.

    `beat_now()` sends the next beat at once: a client's stop reaches the supervisor without waiting a beat."""

    def __init__(self, context: zmq.Context, endpoint: str, rank: int, launch: int, progress: Callable[[], Beat]):
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
                    socket.send(report_bytes(self.progress(), self.rank, self.launch), flags=zmq.NOBLOCK)
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
