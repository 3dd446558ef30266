"""Rank 0's client endpoint: a ZMQ ROUTER served by its own thread while the main thread samples.

The thread owns the ROUTER socket (ZMQ sockets are not thread-safe): it validates every message,
queues jobs FIFO, answers status at any time, records cancels, and forwards what the main thread
produces (step / result / error messages) through an inproc PULL socket. A client that has gone
away is noticed when a message to it fails (ROUTER_MANDATORY), and its running job is cancelled.

No client can stall the others: every send is non-blocking, so a client that does not read its
replies (its pipe full at SNDHWM) has them dropped, with a log line, and loses its jobs; it hears why
once it reads again. Each client may hold MAX_QUEUED_PER_CLIENT waiting jobs, the pool MAX_QUEUED.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import zmq

from ..wire import protocol
from ..wire.auth import ServerGuard, ServerKeys
from ..wire.messages import Accepted, Cancelled, Error, PoolStatus, Stopping
from ..wire.protocol import Message, ProtocolError

log = logging.getLogger("xdit.server")
MAX_QUEUED_PER_CLIENT = 16
MAX_QUEUED = 64


@dataclass
class Job:
    client: bytes
    message: Message
    prepared: Any = None  # what validate returned: the pipeline's checked arguments, reused when it runs
    received: float = field(default_factory=time.perf_counter)

    @property
    def id(self) -> str:
        return self.message.job


class ClientServer(threading.Thread):
    """Serve clients on `endpoint`; `validate(message)` raises ValueError for a job that can't run and
    returns what the job keeps for its run (Job.prepared).

    With `curve_dir`, only clients holding an allowed key get through (auth.ServerGuard).
    """

    def __init__(self, context: zmq.Context, endpoint: str, status: Callable[[], PoolStatus],
                 validate: Callable[[Message], Any], curve_dir: str | None = None,
                 on_stop: Callable[[], None] = lambda: None):
        super().__init__(name="xdit-client-server", daemon=True)
        self.context, self.endpoint = context, endpoint
        self.status, self.validate = status, validate
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self._queued: dict[str, Job] = {}
        self.cancelled: set[str] = set()
        self.running: Job | None = None
        self.stop_requested, self.on_stop = threading.Event(), on_stop
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._outbox_address = f"inproc://xdit-outbox-{id(self)}"
        self._outbox = context.socket(zmq.PULL)
        self._outbox.bind(self._outbox_address)
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_WIRE_FRAME_BYTES)  # per frame: ZMQ drops the sender of a larger one
        self._router.setsockopt(zmq.LINGER, 1000)
        self._dropped: dict[bytes, int] = {}  # replies dropped per client that does not read
        self._owed: dict[bytes, Message] = {}  # the error a non-reading client gets once it reads again
        self._guard = ServerGuard(context, ServerKeys.load(curve_dir)) if curve_dir else None
        self._monitor = self._guard.secure(self._router) if self._guard else None
        self._router.bind(endpoint)
        self._local = threading.local()

    # -- used by the main thread --------------------------------------------------------------------
    def send(self, client: bytes, message: Message) -> None:
        """Queue a message for a client; safe from any thread (one PUSH socket per thread)."""
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.connect(self._outbox_address)
        push.send_multipart([client, *protocol.encode(message)], copy=False)

    def next_job(self, timeout_s: float) -> Job | None | bool:
        """The next job in FIFO order; None when stop was requested; False when none came in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if job is None:
                return None
            with self._lock:
                if self._queued.get(job.id) is job:  # else it was cancelled while queued
                    del self._queued[job.id]
                    self.running = job
                    return job

    def job_finished(self) -> None:
        with self._lock:
            if self.running is not None:
                self.cancelled.discard(self.running.id)
            self.running = None

    def is_cancelled(self, job_id: str) -> bool:
        return job_id in self.cancelled

    def queue_length(self) -> int:
        return len(self._queued)

    def close(self) -> None:
        self._closed.set()
        self.join(timeout=5)

    # -- the thread ---------------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._closed.is_set():
            for sock, _ in poller.poll(100):
                if sock is self._outbox:
                    client, *frames = self._outbox.recv_multipart(copy=False)
                    self._deliver(client.bytes, frames)
                elif sock is self._monitor:
                    self._guard.on_monitor(self._monitor)
                else:
                    self._handle(self._router.recv_multipart(copy=False))
        if self._monitor is not None:
            self._router.disable_monitor()
            self._monitor.close(linger=0)
            self._guard.stop()
        self._router.close(linger=1000)
        self._outbox.close()

    def _deliver(self, client: bytes, frames: list) -> bool:
        owed = self._owed.pop(client, None)
        if owed is not None and not self._send(client, protocol.encode(owed)):
            self._owed[client] = owed
            return False
        return self._send(client, frames)

    def _send(self, client: bytes, frames: list) -> bool:
        try:
            self._router.send_multipart([client, *frames], copy=False, flags=zmq.NOBLOCK)
            self._dropped.pop(client, None)
            return True
        except zmq.Again:  # the client's pipe is full: it does not read its replies
            self._not_reading(client)
        except zmq.ZMQError as error:  # EHOSTUNREACH: the client went away
            log.info("client %r unreachable (%s)", client, error)
            self._cancel_jobs_of(client)
        return False

    def _not_reading(self, client: bytes) -> None:
        dropped = self._dropped[client] = self._dropped.get(client, 0) + 1
        if dropped == 1:
            log.warning("client %r does not read its replies: dropping them and cancelling its jobs", client)
        jobs = self._cancel_jobs_of(client)
        if jobs:
            self._owed[client] = Message.of(Error(rank=0, message=(
                f"job {jobs[0]} was cancelled: this client stopped reading the pool's replies "
                f"({dropped} dropped); read replies while a job runs")), jobs[0])

    def _cancel_jobs_of(self, client: bytes) -> list[str]:
        with self._lock:
            jobs = [job for job, queued in self._queued.items() if queued.client == client]
            for job in jobs:
                del self._queued[job]
            if self.running is not None and self.running.client == client:
                self.cancelled.add(self.running.id)
                jobs.insert(0, self.running.id)
        return jobs

    def _reply(self, client: bytes, message: Message) -> None:
        self._deliver(client, protocol.encode(message))

    def _handle(self, frames: list) -> None:
        if len(frames) < 2:
            return
        client, body = frames[0].bytes, frames[1:]
        try:
            message = protocol.decode(body)
        except ProtocolError as error:
            self._reply(client, Message.of(Error(message=str(error), rank=0)))
            return
        try:
            getattr(self, f"_on_{message.type}")(client, message)
        except (ProtocolError, ValueError) as error:
            missing = getattr(error, "missing", False)  # conditioning.NotHeld: the client sends it again
            mistake = not missing and not isinstance(error, ProtocolError)  # the job's own checks refused it
            self._reply(client, Message.of(Error(message=str(error), rank=0, missing=missing, mistake=mistake),
                                           message.job))

    def _on_submit(self, client: bytes, message: Message) -> None:
        if not message.job:
            raise ProtocolError("submit needs a job id")
        with self._lock:
            busy = message.job in self._queued or (self.running is not None and self.running.id == message.job)
        if busy:
            raise ProtocolError(f"job {message.job} is already queued or running")
        if self.stop_requested.is_set():
            raise ProtocolError("the pool is stopping")
        with self._lock:
            mine = sum(job.client == client for job in self._queued.values())
        if mine >= MAX_QUEUED_PER_CLIENT:
            raise ProtocolError(f"this client already has {mine} jobs waiting (the limit per client is "
                                f"{MAX_QUEUED_PER_CLIENT}); wait for their results before submitting more")
        if len(self._queued) >= MAX_QUEUED:
            raise ProtocolError(f"the pool's queue is full ({MAX_QUEUED} jobs waiting); try again when it is shorter")
        job = Job(client, message, self.validate(message))
        with self._lock:
            self._queued[job.id] = job
            position = len(self._queued) + (self.running is not None) - 1
        self.jobs.put(job)
        self._reply(client, Message.of(Accepted(position=position), job.id))

    def _on_encode(self, client: bytes, message: Message) -> None:
        """Text encoding runs on rank 0 alone, between sampling jobs, in FIFO order with them."""
        self._on_submit(client, message)

    def _on_evaluate(self, client: bytes, message: Message) -> None:
        """One model call (xDiT Model) runs on every rank, in FIFO order with sampling jobs."""
        self._on_submit(client, message)

    def _on_decode(self, client: bytes, message: Message) -> None:
        """A VAE decode runs on every rank, in FIFO order with sampling jobs."""
        self._on_submit(client, message)

    def _on_cancel(self, client: bytes, message: Message) -> None:
        with self._lock:
            queued = self._queued.pop(message.job, None)
            running = self.running is not None and self.running.id == message.job
            if running:
                self.cancelled.add(message.job)
        if queued is not None:
            self._reply(queued.client, Message.of(Cancelled(step=0), message.job))
        elif not running:
            self._reply(client, Message.of(Error(message=f"no job {message.job!r} to cancel", rank=0), message.job))

    def _on_status(self, client: bytes, message: Message) -> None:
        status, asked = self.status(), message.body.job
        if asked is not None:
            status = replace(status, job_state=self._state_of(asked))
        self._reply(client, Message.of(status, message.job))

    def _state_of(self, job_id: str) -> str:
        with self._lock:
            if self.running is not None and self.running.id == job_id:
                return "running"
            return "queued" if job_id in self._queued else "unknown"

    def _on_stop(self, client: bytes, message: Message) -> None:
        """Waiting jobs are refused, the running one cancelled; the supervisor ends ranks that do not exit in time."""
        self.stop_requested.set()
        self.on_stop()
        with self._lock:
            queued, self._queued = list(self._queued.values()), {}
            if self.running is not None:
                self.cancelled.add(self.running.id)
        for job in queued:
            self._reply(job.client, Message.of(Error(message="the pool is stopping; the job did not run", rank=0), job.id))
        self._reply(client, Message.of(Stopping(), message.job))
        self.jobs.put(None)
