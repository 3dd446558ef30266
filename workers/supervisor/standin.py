"""The supervisor's stand-in on the client endpoint, while rank 0 does not serve it.

During start-up, while the pool waits for its other nodes, and after a crash, clients still get
answers: `status` says what the pool is doing, `stop` stops it, jobs are refused with the state, and
the running job's client is told why it ended. Replies wait a few seconds for a client that is
reconnecting. With `curve_dir` it admits the same clients as rank 0's server.
"""

from __future__ import annotations

import time
from typing import Callable

import zmq

from ..wire import protocol
from ..wire.auth import ServerGuard, ServerKeys, release
from ..wire.messages import Error, PoolStatus, Stopping
from ..wire.protocol import Message, ProtocolError

DELIVERY_RETRY_S = 5.0
BIND_RETRY_S = 10.0  # the port may still be held by a rank 0 that is exiting


class StandIn:
    """Owned by the supervisor thread, like every socket of its context."""

    def __init__(self, context: zmq.Context, endpoint: str, status: Callable[[], PoolStatus], on_stop: Callable[[], None],
                 curve_dir: str | None = None):
        self.context, self.endpoint = context, endpoint
        self.status, self.on_stop = status, on_stop
        self.guard = ServerGuard(context, ServerKeys.load(curve_dir)) if curve_dir else None
        self.socket: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self._deliveries: list[tuple[float, bytes, list]] = []

    def bind(self) -> None:
        if self.socket is not None:
            return
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_WIRE_FRAME_BYTES)
        monitor = self.guard.secure(sock) if self.guard else None
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            try:
                sock.bind(self.endpoint)
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    release(sock, monitor)
                    raise
                time.sleep(0.05)
        self.socket, self.monitor = sock, monitor

    def close(self) -> None:
        if self.socket is not None:
            self.socket.unbind(self.endpoint)
            release(self.socket, self.monitor)
            self.socket = self.monitor = None

    def shutdown(self) -> None:
        self.close()
        if self.guard is not None:
            self.guard.stop()

    def register(self, poller: zmq.Poller) -> None:
        for sock in (self.socket, self.monitor):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)

    def handle(self, sock: zmq.Socket) -> None:
        """Serve one readable socket from register(); one closed in the meantime is ignored."""
        if sock is self.monitor and self.monitor is not None:
            self.guard.on_monitor(sock)
        elif sock is self.socket and self.socket is not None:
            self._on_message(sock.recv_multipart(copy=False))

    def _on_message(self, frames: list) -> None:
        if len(frames) < 2:
            return
        client = frames[0].bytes
        try:
            message = protocol.decode(frames[1:])
        except ProtocolError as error:
            return self.send(client, Message.of(Error(message=str(error), rank=-1)))
        status = self.status()
        if message.type == "status":
            reply = Message.of(status, message.job)
        elif message.type == "stop":
            self.on_stop()
            reply = Message.of(Stopping(), message.job)
        else:
            text = f"the pool is {status.state} (restarts: {status.restarts}); retry when status says idle"
            reply = Message.of(Error(message=text, rank=-1), message.job)
        self.send(client, reply)

    def send(self, client: bytes, message: Message) -> None:
        self._deliveries.append((time.monotonic() + DELIVERY_RETRY_S, client, protocol.encode(message)))
        self.retry()

    def retry(self) -> None:
        """Send queued replies; a client that is reconnecting after a crash gets a few seconds."""
        pending = []
        for deadline, client, frames in self._deliveries:
            try:
                if self.socket is None:
                    raise zmq.ZMQError(zmq.EHOSTUNREACH)
                self.socket.send_multipart([client, *frames], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:  # its pipe is full: the client does not read its replies, so this one is dropped
                continue
            except zmq.ZMQError:
                if time.monotonic() < deadline:
                    pending.append((deadline, client, frames))
        self._deliveries = pending
