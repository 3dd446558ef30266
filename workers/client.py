"""The client side of the pool (used by the ComfyUI nodes and the CLI): one DEALER socket.

`PoolClient.sample(...)` submits a job and yields nothing but a result: it calls `on_step` for each
streamed step, raises JobFailed / JobCancelledError, and notices a pool that stopped answering.
A client has a fixed identity, so it keeps receiving its replies across the pool's restarts.
A pool answers only clients with an allowed CURVE key (auth.py), so a client speaks CURVE with the keys in
`curve_dir`, or by default with its user's own (owner_keys.py), which the pools that user starts serve with;
only `insecure=True` speaks plain TCP, to a pool served with --insecure-tcp. The client watches its own
handshakes, because a refused client gets no reply at all, and says at once what was refused and why
instead of waiting for a timeout; an ipc:// socket it may not open is named as such, permission denied.
"""

from __future__ import annotations

import errno
import socket
import time
import uuid
from typing import TYPE_CHECKING, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .engine import fields
from .wire import protocol
from .wire import owner_keys
from .wire.auth import HANDSHAKE_FAILURES, ClientKeys
from .wire.messages import Cancel, Decode, Encode, PoolStatus, StatusQuery, Stop, key_of
from .wire.protocol import Message

if TYPE_CHECKING:  # torch only where tensors are: `status` and `stop` run without it
    import torch

PING_EVERY_S = 5.0
MISSED_PINGS = 3
HANDSHAKE_WITHIN_S = 5.0  # a live pool completes it in milliseconds, CURVE included
CONNECT_WITHIN_S = 2.0  # a pool that neither accepts nor refuses a client by then: the replies' timeouts speak instead
LINK_STATES = {zmq.EVENT_CONNECTED: "connected", zmq.EVENT_HANDSHAKE_SUCCEEDED: "ready",
               zmq.EVENT_CONNECT_RETRIED: "refused", zmq.EVENT_DISCONNECTED: "down"}
LINK_EVENTS = sum(LINK_STATES)  # one bit each
ACCEPT_WITHIN_S = 10.0  # the pool acknowledges every submit at once (accepted or error)
UNKNOWN_PINGS = 2  # pings in a row saying the pool has no such job: its result is not coming


class PoolUnreachable(RuntimeError):
    pass


class NothingListening(PoolUnreachable):
    """No process accepts connections at the endpoint: no pool runs there (not a key or a timeout problem)."""


class PoolRefused(PoolUnreachable):
    """The pool's endpoint refused this client's keys (or their absence), or its socket may not be opened: retrying
    will not help."""


class JobFailed(RuntimeError):
    def __init__(self, message: str, rank: int, missing: bool = False, mistake: bool = False):
        super().__init__(message if rank < 0 else f"rank {rank}: {message}")
        self.rank = rank
        self.missing = missing  # a model call named conditioning the pool does not hold (conditioning.py)
        self.mistake = mistake  # refused at submit: it cannot run as asked (messages.Error)


class JobCancelledError(RuntimeError):
    def __init__(self, step: int):
        super().__init__(f"the job was cancelled at step {step}")
        self.step = step


class PoolClient:
    def __init__(self, endpoint: str, context: zmq.Context | None = None, curve_dir: str | None = None,
                 insecure: bool = False):
        self.endpoint, self.implicit_keys = endpoint, curve_dir is None and not insecure
        self.curve_dir = None if insecure else curve_dir or str(owner_keys.owner_folder())
        keys = ClientKeys.load(self.curve_dir) if self.curve_dir else None  # a key mistake before any socket exists
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
        if keys is not None:
            keys.apply(self.socket)
        self._events = self.socket.get_monitor_socket(HANDSHAKE_FAILURES | LINK_EVENTS)
        self._link: str | None = None  # what the monitor last said of the connection (see _take_events)
        self._denied = self._ipc_denied()
        self.socket.connect(endpoint)

    def close(self) -> None:
        self.socket.disable_monitor()
        self._events.close(linger=0)
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
            self._take_events()
            raise PoolUnreachable(f"the pool at {self.endpoint} took no message within "
                                  f"{self.socket.getsockopt(zmq.SNDTIMEO) / 1000:.0f} s") from None

    def receive(self, timeout_s: float) -> Message | None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._events, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            ready = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self._events in ready:
                self._take_events()
            if self.socket in ready:
                return protocol.decode(self.socket.recv_multipart(copy=False), from_client=False)
            if time.monotonic() >= deadline:
                return None

    def _take_events(self) -> None:
        """Read what the socket's monitor said of its connection (`_link`); a failed handshake raises."""
        while self._events.poll(0):
            event = recv_monitor_message(self._events)
            if event["event"] in LINK_STATES:
                self._link = LINK_STATES[event["event"]]
            else:
                raise self._handshake_failed(event)

    def _handshake_failed(self, event: dict) -> PoolUnreachable:
        where = f"the pool at {self.endpoint}"
        timed_out = event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and event["value"] == errno.EAGAIN
        if timed_out:  # nothing answered, so no key was judged (a refused one ends the connection: EPIPE)
            return PoolUnreachable(f"{where} accepted the connection but did not complete the ZMQ handshake within "
                                   f"{HANDSHAKE_WITHIN_S:.0f} s: the process serving it is hung or stopped (the pool's "
                                   "watchdog restarts a hung rank after --hang-timeout)")
        named = ("pass --curve-dir DIR with that pool's server.key and an allowed client.key_secret, from "
                 "`python -m workers keys`")
        if not self.curve_dir:
            why = f"requires CURVE keys (this client used --insecure-tcp): drop it to use your own keys, or {named}"
        elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            why = "does not use CURVE keys (it was served with --insecure-tcp): connect with --insecure-tcp"
        elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"refused this client's key: its public key ({self.curve_dir}/client.key) is not in the pool's clients/ folder"
        else:  # another server key; or no keys at all, where the pool hung up before this client read its greeting
            plain = (", or none (one served with --insecure-tcp: connect with --insecure-tcp)"
                     if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL else "")
            why = (f"refused this client: it serves other keys than your own in {self.curve_dir} (another user's pool, "
                   f"or one served with --curve-dir){plain}; to reach a pool served with --curve-dir, {named}"
                   if self.implicit_keys else
                   f"did not accept the handshake: is {self.curve_dir}/server.key that pool's server key?{plain}")
        return PoolRefused(f"{where} {why}")

    def _ipc_denied(self) -> PoolRefused | None:
        """An ipc:// socket this user may not open: ZMQ would retry it in silence, as if nothing listened there."""
        if not self.endpoint.startswith("ipc://"):
            return None
        try:
            with socket.socket(socket.AF_UNIX) as unix:
                unix.connect(self.endpoint[len("ipc://"):])
        except PermissionError:
            return PoolRefused(f"permission denied opening {self.endpoint}: it is a private socket of another "
                               "user's pool (its folder is closed to you)")
        except OSError:
            pass  # nothing there: the monitor says so like for tcp://
        return None

    def check_listening(self, wait_s: float = CONNECT_WITHIN_S) -> None:
        """Before sending, and after a silence: raise NothingListening when the endpoint refuses connections (ZMQ
        would queue and wait), PoolRefused when the pool refuses this client (its handshake) or its socket may not
        be opened. Waits up to `wait_s` for the handshake's outcome: sent after a refusal, a message would wait for
        a pipe that is gone. The monitor tells, not a connection of our own: a pool logs every connection that
        ends inside its handshake as a refused client."""
        if self._denied is not None:
            raise self._denied
        deadline = time.monotonic() + wait_s
        self._take_events()
        while self._link not in ("ready", "refused"):
            if not self._events.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                break
            self._take_events()
        if self._link == "refused":
            raise NothingListening(f"nothing is listening at {self.endpoint}: no pool runs there; start one with "
                                   "`python -m workers serve --model M --endpoint ...` or check the address")

    def request(self, kind: StatusQuery | Stop, job: str = "", timeout_s: float = 10.0) -> Message:
        """Send a status or stop message and return the reply that belongs to it."""
        self.check_listening(min(timeout_s, CONNECT_WITHIN_S))
        tag = job or f"{kind.TYPE}-{uuid.uuid4().hex[:12]}"
        self.send(Message.of(kind, tag))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            reply = self.receive(left)
            if reply is not None and reply.job == tag and reply.type != "step":
                return reply
        self.check_listening()
        keys = ("; a pool answers only clients with one of its CURVE keys (yours by default, a pool's own with "
                "--curve-dir)" if self.curve_dir else "; a pool with CURVE keys answers only clients with an allowed key "
                "(drop --insecure-tcp, or pass --curve-dir)")
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
                 expert: str = "", cache: dict | None = None) -> dict[str, torch.Tensor]:
        """One model call (xDiT Model): `tensors` latents and sigma, `conditioning` by name, on the pipeline's
        `expert` transformer ("": its first); its predictions by name (`prediction`, and a video-with-sound model's
        `audio`); `cache`: the sampling run's step cache (ModelCallCache's plain map), its counts in `last_result`. Conditioning travels once: later calls name it by key, and send it again only if the pool no longer
        holds it."""
        keys = {name: self._key(name, tensor) for name, tensor in conditioning.items()}
        send = {name: tensor for name, tensor in conditioning.items() if keys[name] not in self._held}
        params = {"conditioning": keys, **({"loras": list(loras)} if loras else {}), **({"expert": expert} if expert else {}),
                  **({"cache": cache} if cache else {})}
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
            self.last_result = reply.params
            return reply.tensors

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
        reply = self.decode_streams({"latents": latents}, tile, on_step=on_step, should_cancel=should_cancel)
        return reply.tensors["images"], reply.params

    def decode_audio(self, audio: torch.Tensor, should_cancel: Callable[[], bool] | None = None) -> torch.Tensor:
        """Decode audio latents (the audio VAE's own space, [B, C, frames, mel bins]) with the pool's audio VAE and
        vocoder: waveforms [B, channels, samples], as the pipeline's own decode makes them."""
        return self.decode_streams({"audio": audio}, should_cancel=should_cancel).tensors["audio"]

    def decode_streams(self, tensors: dict[str, torch.Tensor], tile: int = 0, model_latents: bool = False,
                       on_step: Callable[[Message], None] | None = None,
                       should_cancel: Callable[[], bool] | None = None) -> Message:
        """Decode `latents` and/or `audio` in one job (a video with its sound); `model_latents`: given in the sampling
        loop's space (xDiT Sampler's). The reply: `images` and `audio` (waveforms), its params `sample_rate` and the
        ranks' shares."""
        self.check_listening()
        job = f"decode-{uuid.uuid4().hex[:16]}"
        self.send(Message.of(Decode(tile=tile, model_latents=model_latents), job, tensors))
        return self._follow(job, on_step, should_cancel)

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
                                reply.params.get("missing", False) is True, reply.params.get("mistake", False) is True)
