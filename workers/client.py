"""The client side of the pool (used by the ComfyUI nodes and the CLI): one DEALER socket.

`PoolClient.sample(...)` submits a job and yields nothing but a result: it calls `on_step` for each
streamed step, raises JobFailed / JobCancelledError, and notices a pool that stopped answering.
A client has a fixed identity, so it keeps receiving its replies across the pool's restarts.
A pool with CURVE keys (auth.py) answers only clients with an allowed key, so a client given
`curve_dir` speaks CURVE; the client watches its own handshakes, because a refused client gets no
reply at all, and says at once what is wrong with its keys instead of waiting for a timeout.
"""

from __future__ import annotations

import errno
import socket
import time
import uuid
from urllib.parse import urlsplit
from typing import TYPE_CHECKING, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .engine import fields
from .wire import protocol
from .wire.auth import ENV, HANDSHAKE_FAILURES, ClientKeys
from .wire.messages import Cancel, Decode, Encode, PoolStatus, StatusQuery, Stop, key_of
from .wire.protocol import Message

if TYPE_CHECKING:  # torch only where tensors are: `status` and `stop` run without it
    import torch

PING_EVERY_S = 5.0
MISSED_PINGS = 3
HANDSHAKE_WITHIN_S = 5.0  # a live pool completes it in milliseconds, CURVE included
ACCEPT_WITHIN_S = 10.0  # the pool acknowledges every submit at once (accepted or error)
UNKNOWN_PINGS = 2  # pings in a row saying the pool has no such job: its result is not coming


class PoolUnreachable(RuntimeError):
    pass


class NothingListening(PoolUnreachable):
    """No process accepts connections at the endpoint: no pool runs there (not a key or a timeout problem)."""


class PoolRefused(PoolUnreachable):
    """The pool's endpoint refused this client's keys (or their absence): retrying will not help."""


class JobFailed(RuntimeError):
    def __init__(self, message: str, rank: int, missing: bool = False):
        super().__init__(message if rank < 0 else f"rank {rank}: {message}")
        self.rank = rank
        self.missing = missing  # a model call named conditioning the pool does not hold (conditioning.py)


class JobCancelledError(RuntimeError):
    def __init__(self, step: int):
        super().__init__(f"the job was cancelled at step {step}")
        self.step = step


class PoolClient:
    def __init__(self, endpoint: str, context: zmq.Context | None = None, curve_dir: str | None = None):
        self.endpoint, self.curve_dir = endpoint, curve_dir
        self.last_result: dict = {}  # the last sample's result params (sample returns its latents)
        self.last_call_bytes = 0  # tensor bytes the last model call sent (conditioning only when not held)
        self._held: set[str] = set()  # conditioning keys this client has sent to the pool
        self._last_keys: dict[str, tuple[torch.Tensor, str]] = {}  # per conditioning name: its last tensor, key
        self._context = context or zmq.Context.instance()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, f"client-{uuid.uuid4().hex}".encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 10_000)
        self.socket.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_WITHIN_S * 1000))
        if curve_dir:
            ClientKeys.load(curve_dir).apply(self.socket)
        self._handshakes = self.socket.get_monitor_socket(HANDSHAKE_FAILURES)
        # Checked before connecting: a check between connect and the first send would let a refused
        # handshake tear the pipe down first, and the send would block instead of reporting the refusal.
        self._listening = self._accepts_connections()
        self.socket.connect(endpoint)

    def close(self) -> None:
        self.socket.disable_monitor()
        self._handshakes.close(linger=0)
        self.socket.close(linger=0)

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------------
    def send(self, message: Message) -> None:
        try:
            self.socket.send_multipart(protocol.encode(message), copy=False)
        except zmq.Again:  # no pipe to queue on within SNDTIMEO: a refused handshake tore it down
            if self._handshakes.poll(0):
                raise self._handshake_failed(recv_monitor_message(self._handshakes)) from None
            raise PoolUnreachable(f"the pool at {self.endpoint} took no message within "
                                  f"{self.socket.getsockopt(zmq.SNDTIMEO) / 1000:.0f} s") from None

    def receive(self, timeout_s: float) -> Message | None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._handshakes, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if self._handshakes in ready:
            raise self._handshake_failed(recv_monitor_message(self._handshakes))
        if self.socket not in ready:
            return None
        return protocol.decode(self.socket.recv_multipart(copy=False), from_client=False)

    def _handshake_failed(self, event: dict) -> PoolUnreachable:
        where = f"the pool at {self.endpoint}"
        timed_out = event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and event["value"] == errno.EAGAIN
        if timed_out:  # nothing answered, so no key was judged (a refused one ends the connection: EPIPE)
            return PoolUnreachable(f"{where} accepted the connection but did not complete the ZMQ handshake within "
                                   f"{HANDSHAKE_WITHIN_S:.0f} s: the process serving it is hung or stopped (the pool's "
                                   "watchdog restarts a hung rank after --hang-timeout)")
        if not self.curve_dir:
            why = (f"requires CURVE keys: pass --curve-dir DIR (or set {ENV}) with its server.key and an "
                   "allowed client.key_secret, from `python -m workers keys`")
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"refused this client's key: its public key ({self.curve_dir}/client.key) is not in the pool's clients/ folder"
        elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            why = "does not use CURVE keys: connect without --curve-dir"
        else:
            why = f"did not accept the handshake: is {self.curve_dir}/server.key that pool's server key?"
        return PoolRefused(f"{where} {why}")

    def _accepts_connections(self) -> bool:
        address = urlsplit(self.endpoint)
        if address.scheme != "tcp" or address.hostname in (None, "*", "0.0.0.0"):
            return True
        try:
            socket.create_connection((address.hostname, address.port), timeout=2).close()
        except OSError:
            return False
        return True

    def check_listening(self) -> None:
        """Raise NothingListening when a tcp:// endpoint refuses connections (ZMQ would queue and wait)."""
        self._listening = self._listening or self._accepts_connections()
        if not self._listening:
            raise NothingListening(f"nothing is listening at {self.endpoint}: no pool runs there; start one with "
                                   "`python -m workers serve --model M --endpoint ...` or check the address")

    def request(self, kind: StatusQuery | Stop, job: str = "", timeout_s: float = 10.0) -> Message:
        """Send a status or stop message and return the reply that belongs to it."""
        self.check_listening()
        tag = job or f"{kind.TYPE}-{uuid.uuid4().hex[:12]}"
        self.send(Message.of(kind, tag))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            reply = self.receive(left)
            if reply is not None and reply.job == tag and reply.type != "step":
                return reply
        self._listening = False
        self.check_listening()
        keys = "" if self.curve_dir else f"; a pool with CURVE keys answers only clients with an allowed key (--curve-dir or {ENV})"
        raise PoolUnreachable(f"no reply from the pool at {self.endpoint} within {timeout_s:.0f} s: it may be hung or overloaded{keys}")

    def status(self, timeout_s: float = 10.0) -> PoolStatus:
        return fields.from_plain(PoolStatus, self.request(StatusQuery(), timeout_s=timeout_s).params, "status")

    def stop(self, timeout_s: float = 10.0) -> None:
        self.request(Stop(), timeout_s=timeout_s)

    def wait_until_idle(self, timeout_s: float = 120.0) -> PoolStatus:
        """Poll status until the pool says idle (after start-up or a restart)."""
        return self.wait_for_state("idle", timeout_s)

    def wait_for_state(self, state: str, timeout_s: float = 120.0) -> PoolStatus:
        """Poll status until the pool is in `state` (idle, busy); a pool that failed raises."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.status(timeout_s=2.0)
            except PoolRefused:
                raise
            except PoolUnreachable:  # not up yet, or restarting: ask again
                time.sleep(0.1)
                continue
            if last.state == state:
                return last
            if last.state == "error":
                raise PoolUnreachable(f"the pool failed: {last.error}")
            time.sleep(0.1)
        raise PoolUnreachable(f"the pool at {self.endpoint} did not become {state} in {timeout_s:.0f} s (last: {last})")

    # -- jobs ---------------------------------------------------------------------------------------
    def submit(self, tensors: dict[str, torch.Tensor], params: dict, job: str | None = None) -> str:
        self.check_listening()
        job = job or f"job-{uuid.uuid4().hex[:16]}"
        self.send(Message("submit", job, params, tensors))
        return job

    def cancel(self, job: str) -> None:
        self.send(Message.of(Cancel(), job))

    def sample(
        self,
        tensors: dict[str, torch.Tensor],
        params: dict,
        on_step: Callable[[Message], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Run one sampling job to the end and return its latents."""
        return self.sample_outputs(tensors, params, on_step, should_cancel)["latents"]

    def sample_outputs(
        self,
        tensors: dict[str, torch.Tensor],
        params: dict,
        on_step: Callable[[Message], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run one sampling job to the end: its `latents` and what the pipeline returns beside them, by the pipeline's
        names (LTX-2: `audio`, the audio latents)."""
        job = self.submit(tensors, params)
        result = self._follow(job, on_step, should_cancel)
        self.last_result = result.params
        return result.tensors

    def evaluate(self, tensors: dict[str, torch.Tensor], conditioning: dict[str, torch.Tensor],
                 loras: list[dict] | tuple = (), should_cancel: Callable[[], bool] | None = None,
                 expert: str = "") -> torch.Tensor:
        """One model call (xDiT Model): `tensors` latents and sigma, `conditioning` by name, on the pipeline's
        `expert` transformer ("": its first). Conditioning travels once: later calls name it by key, and send it
        again only if the pool no longer holds it."""
        keys = {name: self._key(name, tensor) for name, tensor in conditioning.items()}
        send = {name: tensor for name, tensor in conditioning.items() if keys[name] not in self._held}
        params = {"conditioning": keys, **({"loras": list(loras)} if loras else {}), **({"expert": expert} if expert else {})}
        while True:
            self.check_listening()
            job = f"call-{uuid.uuid4().hex[:16]}"
            sent = {**tensors, **send}
            self.send(Message("evaluate", job, params, sent))
            try:
                reply = self._follow(job, None, should_cancel)
            except JobFailed as failed:
                if not failed.missing or len(send) == len(conditioning):
                    raise
                self._held.difference_update(keys.values())
                send = dict(conditioning)
                continue
            self._held.update(keys.values())
            self.last_call_bytes = sum(t.nbytes for t in sent.values())
            return reply.tensors["prediction"]

    def _key(self, name: str, tensor: torch.Tensor) -> str:
        """key_of(tensor), hashed only when it differs from this name's last tensor: a sampler sends the same
        conditioning every step, and comparing is ~20× cheaper than hashing (10 MB: ~1 ms against ~20 ms)."""
        last = self._last_keys.get(name)
        same = last is not None and last[0].shape == tensor.shape and last[0].dtype == tensor.dtype
        if same and last[0].equal(tensor):
            return last[1]
        key = key_of(tensor)
        self._last_keys[name] = (tensor.detach().clone(), key)
        return key

    def encode(self, prompt: str, image: torch.Tensor | None = None, **job_inputs) -> dict[str, torch.Tensor]:
        """The pool pipeline's own text encoding of `prompt` (prompt_embeds, pooled / mask); with `image`
        ([N, 3, H, W] in [0, 1]), encoded with those reference images, their latents as `image` (edit models whose
        text encoder sees images); with `negative_prompt`, `seed`, `height` and `width`: a whole job's inputs,
        latents included."""
        self.check_listening()
        job = f"encode-{uuid.uuid4().hex[:16]}"
        tensors = {} if image is None else {"image": image.float().contiguous()}
        self.send(Message.of(Encode(prompt=prompt, **job_inputs), job, tensors))
        return self._follow(job, None, None).tensors

    def decode(self, latents: torch.Tensor, tile: int = 0, on_step: Callable[[Message], None] | None = None,
               should_cancel: Callable[[], bool] | None = None) -> tuple[torch.Tensor, dict]:
        """Decode `latents` (the VAE's own space) with the pool's VAE, its tiles over the ranks (`tile`: the
        tile side in latent pixels, a multiple of 8; 0: about 1/⌈√ranks⌉ of the longer side, a tile per rank at least); the VAE's sample in [-1, 1] and what each rank held."""
        self.check_listening()
        job = f"decode-{uuid.uuid4().hex[:16]}"
        self.send(Message.of(Decode(tile=tile), job, {"latents": latents}))
        reply = self._follow(job, on_step, should_cancel)
        return reply.tensors["images"], reply.params

    def decode_audio(self, audio: torch.Tensor, should_cancel: Callable[[], bool] | None = None) -> torch.Tensor:
        """Decode audio latents (the audio VAE's own space, [B, C, frames, mel bins]) with the pool's audio VAE and
        vocoder: waveforms [B, channels, samples], as the pipeline's own decode makes them."""
        self.check_listening()
        job = f"decode-{uuid.uuid4().hex[:16]}"
        self.send(Message.of(Decode(), job, {"audio": audio}))
        return self._follow(job, None, should_cancel).tensors["audio"]

    def _follow(self, job: str, on_step, should_cancel) -> Message:
        """Wait for the job's final message, passing steps on; raise for errors and cancels.

        Every wait is bounded: a job the pool does not acknowledge within ACCEPT_WITHIN_S, a pool that
        stops answering pings, and a pool that answers pings but no longer has the job all raise."""
        cancel_sent = False
        sent_at = last_heard = time.monotonic()
        acknowledged, missed, unknown = False, 0, 0
        ping = None
        while True:
            if should_cancel is not None and not cancel_sent and should_cancel():
                self.cancel(job)
                cancel_sent = True
            if not acknowledged and time.monotonic() - sent_at > ACCEPT_WITHIN_S:
                raise PoolUnreachable(
                    f"the pool at {self.endpoint} did not acknowledge job {job} within {ACCEPT_WITHIN_S:.0f} s: ZMQ "
                    f"drops a message with a frame over {protocol.MAX_WIRE_FRAME_BYTES >> 20} MiB without a reply, or the "
                    "pool is overloaded; nothing of the job runs")
            reply = self.receive(0.1)
            if reply is None:
                if time.monotonic() - last_heard > PING_EVERY_S:
                    if ping is not None:
                        missed += 1
                        if missed >= MISSED_PINGS:
                            self._listening = False
                            self.check_listening()
                            raise PoolUnreachable(f"the pool at {self.endpoint} stopped answering during job {job}")
                    ping = f"ping-{uuid.uuid4().hex[:12]}"
                    self.send(Message.of(StatusQuery(job=job), ping))
                    last_heard = time.monotonic()
                continue
            last_heard, missed = time.monotonic(), 0
            if reply.job == ping:
                ping = None
                unknown = unknown + 1 if reply.params.get("job_state") == "unknown" else 0
                if unknown >= UNKNOWN_PINGS:
                    raise JobFailed(f"the pool at {self.endpoint} no longer has job {job} (neither queued nor "
                                    "running) and sent no result; submit it again", -1)
                continue
            if reply.job not in (job, ""):
                continue
            acknowledged = True
            if reply.type == "step" and on_step is not None:
                on_step(reply)
            elif reply.type == "result":
                return reply
            elif reply.type == "cancelled":
                raise JobCancelledError(reply.params.get("step", 0))
            elif reply.type == "error":
                raise JobFailed(reply.params.get("message", "unknown error"), reply.params.get("rank", -1),
                                reply.params.get("missing", False) is True)
