"""Starts, watches and restarts a pool: torchrun as a child process group, plus its control channel.

The supervisor, not torchrun's agent, decides what a rank's death means: it polls every rank's
pid every 50 ms (torchrun's own monitor runs every 2 s), so it sees the rank that died first and
can name it to the client before it stops the others.

The `Pool` object lives in the process that owns the pool (ComfyUI or `python -m workers serve`).
Its supervisor thread is the only user of its ZMQ sockets. It launches torchrun, hands the client
endpoint to rank 0 once rank 0 is up, and meanwhile answers clients itself (a stand-in that says
`starting`), so the endpoint never goes silent: during start-up, and after a crash, when it also
tells the running job's client which rank died. Ranks die with their parent: torchrun gets SIGTERM
when the supervisor thread's process dies (PR_SET_PDEATHSIG), and each rank gets SIGKILL when
torchrun dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from parallel.config import ParallelConfig

from . import protocol
from .control import pack, unpack
from .protocol import Message, ProtocolError

log = logging.getLogger("xdit.launcher")
ROOT = Path(__file__).resolve().parents[1]
JOB_ERROR_GRACE_S = 3.0
DELIVERY_RETRY_S = 5.0


class PoolError(RuntimeError):
    """The pool could not start (the message carries the failing rank's own error)."""


@dataclass
class PoolSpec:
    model: str
    nproc: int
    endpoint: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    text_encoders: bool = False
    dtype: str | None = None
    threads_per_rank: int | None = None
    log_file: str | None = None
    devices: str | None = None  # CUDA_VISIBLE_DEVICES for the ranks, e.g. "0,1,2,3"

    def rank_arguments(self) -> list[str]:
        p = self.parallel
        args = [
            "--model", str(self.model), "--endpoint", self.endpoint,
            "--ulysses-degree", str(p.ulysses_degree), "--ring-degree", str(p.ring_degree),
            "--pipefusion-degree", str(p.pipefusion_degree), "--warmup-steps", str(p.warmup_steps),
            "--dp-degree", str(p.dp_degree),
        ]
        if p.num_patches:
            args += ["--num-patches", str(p.num_patches)]
        if p.cfg_degree > 1:
            args.append("--cfg-parallel")
        if self.text_encoders:
            args.append("--text-encoders")
        if self.dtype:
            args += ["--dtype", self.dtype]
        return args


def _parent_death_signal(sig: int):
    def set_signal():
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)
        except OSError:
            pass

    return set_signal


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


class Pool:
    """A persistent pool of ranks serving `spec.endpoint`."""

    def __init__(self, spec: PoolSpec):
        spec.parallel.check(spec.nproc)
        self.spec = spec
        self.restarts = 0
        self.jobs_done = 0
        self.state = "starting"
        self.error: str | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        self.process: subprocess.Popen | None = None
        self.pids: dict[int, int] = {}

    # -- public -------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 600) -> "Pool":
        self._thread = threading.Thread(target=self._supervise, name="xdit-supervisor", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise PoolError(f"the pool did not become ready within {timeout_s:.0f} s")
        if self.state == "error":
            self.stop()
            raise PoolError(self.error)
        return self

    def stop(self, timeout_s: float = 15) -> None:
        self._stop_requested.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._kill_ranks()

    def wait(self) -> None:
        """Block until the pool stops (a client's `stop`, or stop() from another thread)."""
        self._stopped.wait()

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    def __enter__(self) -> "Pool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the supervisor thread ----------------------------------------------------------------------
    def _supervise(self) -> None:
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.LINGER, 0)
        port = self._control.bind_to_random_port("tcp://127.0.0.1")
        self._control_endpoint = f"tcp://127.0.0.1:{port}"
        self._standin: zmq.Socket | None = None
        self._deliveries: list[tuple[float, bytes, list]] = []
        try:
            self._bind_standin()
            self._launch()
            while not self._stop_requested.is_set():
                self._poll_once()
                self._check_liveness()
            self._shutdown_ranks()
        except Exception as error:  # noqa: BLE001 - the supervisor must never die silently
            log.exception("supervisor failed")
            self.state, self.error = "error", f"supervisor failed: {error}"
        finally:
            self._kill_ranks()
            self._close_standin()
            self._control.close()
            self._context.term()
            self.state = "stopped" if self.state != "error" else self.state
            self._ready.set()
            self._stopped.set()

    def _launch(self) -> None:
        self.state, self.pids = "starting", {}
        self._ranks_ready: set[int] = set()
        self._current_job: tuple[str, bytes] | None = None
        self._job_errors: dict[int, str] = {}
        self._job_error_since = 0.0
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.spec.nproc),
            "--monitor-interval", "2", "-m", "workers.rank", *self.spec.rank_arguments(),
            "--control", self._control_endpoint, "--jobs-done", str(self.jobs_done), "--restarts", str(self.restarts),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        if self.spec.devices:
            env["CUDA_VISIBLE_DEVICES"] = self.spec.devices
        if self.spec.threads_per_rank:
            env["OMP_NUM_THREADS"] = env["XDIT_THREADS_PER_RANK"] = str(self.spec.threads_per_rank)
        output = open(self.spec.log_file, "ab") if self.spec.log_file else None
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
            start_new_session=True, preexec_fn=_parent_death_signal(signal.SIGTERM),
        )
        if output:
            output.close()

    def _poll_once(self) -> None:
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        if self._standin is not None:
            poller.register(self._standin, zmq.POLLIN)
        for sock, _ in poller.poll(50):
            if sock is self._control:
                identity, raw = self._control.recv_multipart()
                self._on_control(identity, unpack(raw))
            elif sock is self._standin:  # not closed by a bind_request handled just before
                self._on_standin(sock.recv_multipart(copy=False))
        self._retry_deliveries()

    def _on_control(self, identity: bytes, message: dict) -> None:
        kind, rank = message["type"], message.get("rank", -1)
        if kind == "hello":
            self.pids[rank] = message["pid"]
        elif kind == "bind_request":
            self._close_standin()
            self._control.send_multipart([identity, pack({"type": "bind_ok"})])
        elif kind == "ready":
            self._ranks_ready.add(rank)
            if len(self._ranks_ready) == self.spec.nproc:
                self.state = "ready"
                self._ready.set()
                log.info("pool ready: %d ranks, restarts=%d", self.spec.nproc, self.restarts)
        elif kind == "failed":
            self._start_failed(f"rank {rank} failed to start: {message['error']}")
        elif kind == "job_started":
            self._current_job = (message["job"], message["client"])
            self._job_errors = {}
        elif kind == "job_ended":
            self._current_job = None
            self.jobs_done = message["jobs_done"]
        elif kind == "stopped":  # a client asked rank 0 to stop the pool; ranks are exiting cleanly
            self._stop_requested.set()
        elif kind == "job_error":
            self._job_errors.setdefault(rank, message["error"])
            self._job_error_since = self._job_error_since or time.monotonic()
            if len(self._job_errors) == self.spec.nproc:  # every rank failed alike: answer and go on
                first = min(self._job_errors)
                verdict = pack({"type": "resume", "rank": first, "error": self._job_errors[first]})
                for r in range(self.spec.nproc):
                    self._control.send_multipart([f"rank{r}".encode(), verdict])
                self._job_errors, self._job_error_since = {}, 0.0

    def _check_liveness(self) -> None:
        if self._job_errors and time.monotonic() - self._job_error_since > JOB_ERROR_GRACE_S:
            rank = min(self._job_errors)
            return self._crashed(f"the job failed on rank {rank} only ({self._job_errors[rank]}); the pool restarts")
        exit_code = self.process.poll() if self.process else None
        dead = sorted(r for r, pid in self.pids.items() if _dead(pid))
        if exit_code is None and not dead:
            return
        if self.state != "ready":
            return self._start_failed(f"torchrun exited with code {exit_code} while the pool was starting")
        what = ", ".join(f"rank {r} (pid {self.pids[r]})" for r in dead) or f"torchrun (exit code {exit_code})"
        self._crashed(f"{what} died; the pool is restarting")

    def _crashed(self, reason: str) -> None:
        log.error("%s", reason)
        self._kill_ranks()
        self.state = "restarting"
        self._bind_standin()
        if self._current_job is not None:
            job, client = self._current_job
            self._queue_delivery(client, Message("error", job, {"message": reason, "rank": -1}))
        self.restarts += 1
        self._launch()

    def _start_failed(self, reason: str) -> None:
        log.error("%s", reason)
        self.state, self.error = "error", reason
        self._kill_ranks()
        self._ready.set()
        self._stop_requested.set()

    def _shutdown_ranks(self) -> None:
        """Let ranks that were asked to stop exit by themselves; then make sure of it."""
        if self.process and self.process.poll() is None:
            try:
                self.process.wait(3 if all(_dead(p) for p in self.pids.values()) else 0.5)
                return
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def _kill_ranks(self) -> None:
        """Stop torchrun and every rank, whatever state they are in; wait until they are gone."""
        if self.process is None:
            return
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and not (self.process.poll() is not None and all(_dead(p) for p in self.pids.values())):
                time.sleep(0.02)
        for pid in self.pids.values():  # ranks are in torchrun's session; this is only a safety net
            if not _dead(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass

    # -- the stand-in endpoint (while rank 0 does not serve) ---------------------------------------
    def _bind_standin(self) -> None:
        if self._standin is not None:
            return
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 8 * protocol.MAX_FRAME_BYTES)
        deadline = time.monotonic() + 10
        while True:
            try:
                sock.bind(self.spec.endpoint)
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    sock.close()
                    raise
                time.sleep(0.05)
        self._standin = sock

    def _close_standin(self) -> None:
        if self._standin is not None:
            self._standin.unbind(self.spec.endpoint)
            self._standin.close(linger=0)
            self._standin = None

    def status(self) -> dict:
        return {
            "state": "error" if self.state == "error" else "starting",
            "world_size": self.spec.nproc,
            "ranks_alive": sum(not _dead(p) for p in self.pids.values()),
            "jobs_done": self.jobs_done,
            "restarts": self.restarts,
            "model": str(self.spec.model),
            "parallel": {**vars(self.spec.parallel), "description": self.spec.parallel.describe()},
            "error": self.error,
        }

    def _on_standin(self, frames: list) -> None:
        if len(frames) < 2:
            return
        client = frames[0].bytes
        try:
            message = protocol.decode(frames[1:])
        except ProtocolError as error:
            return self._queue_delivery(client, Message("error", params={"message": str(error), "rank": -1}))
        if message.type == "status":
            reply = Message("status", message.job, self.status())
        elif message.type == "stop":
            self._stop_requested.set()
            reply = Message("stopping", message.job)
        else:
            text = f"the pool is {self.status()['state']} (restarts: {self.restarts}); retry when status says idle"
            reply = Message("error", message.job, {"message": text, "rank": -1})
        self._queue_delivery(client, reply)

    def _queue_delivery(self, client: bytes, message: Message) -> None:
        self._deliveries.append((time.monotonic() + DELIVERY_RETRY_S, client, protocol.encode(message)))
        self._retry_deliveries()

    def _retry_deliveries(self) -> None:
        """Send queued replies; a client that is reconnecting after a crash gets a few seconds."""
        pending = []
        for deadline, client, frames in self._deliveries:
            try:
                if self._standin is None:
                    raise zmq.ZMQError(zmq.EHOSTUNREACH)
                self._standin.send_multipart([client, *frames], copy=False)
            except zmq.ZMQError:
                if time.monotonic() < deadline:
                    pending.append((deadline, client, frames))
        self._deliveries = pending
