"""Starts, watches and restarts this machine's share of a pool: its ranks (ranks.py) and its control channel.

The supervisor decides what a rank's death means: it polls every rank's pid every 50 ms, so it sees the
rank that died first and can name it to the client before it stops the others. A rank that lives but stops
beating (SIGSTOP, a wedge that even its heartbeat thread cannot get past) for `hang_timeout_s` is declared hung
the same way, and a pool a client asked to stop is ended STOP_GRACE_S later if its ranks are still busy.

The `Pool` object lives in the process that owns the pool (ComfyUI, `python -m workers serve` or
`join`). Its supervisor thread is the only user of its ZMQ sockets. It launches the ranks, hands the
client endpoint to rank 0 once rank 0 is up, and meanwhile answers clients itself (standin.StandIn),
so the endpoint never goes silent: during start-up, and after a crash, when it also tells the running
job's client what happened. Ranks die with their parent (PR_SET_PDEATHSIG), even when it is SIGKILLed.

Nothing here listens beyond what it must: the client endpoint is CURVE-authenticated (the owner's own keys
unless --curve-dir; plain only with --insecure-tcp, on loopback), the control channel is an ipc:// socket in
a fresh folder only this user may open, and the ranks' store listens on loopback (parallel/cli/rendezvous.py).

Several machines (nnodes > 1): each runs a supervisor over its own ranks, under torchrun's elastic
agent with the c10d rendezvous, whose store node 0's supervisor hosts on the --rdzv-endpoint address.
Node 0 (`serve`) also owns the client endpoint; the others `join`. Every launch is `--max-restarts 0`:
when the world breaks (a rank or a whole node is lost, which the ranks notice in their collectives and
report as `world_lost`), every supervisor stops its share and launches it again. Node 0's new launch hosts
a fresh rendezvous, the others' agents exit when their world is gone and are relaunched into it, and the
world forms again as soon as every node is back; until then node 0's stand-in says `waiting for nodes`. The
control channel stays on each machine: node 0's supervisor knows the other nodes only from rank 0's reports.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import replace

import zmq

from ..wire.control import MAX_CONTROL_BYTES, read_report
from ..wire.framing import ProtocolError
from ..wire.messages import Error, PoolStatus
from ..wire.protocol import Message
from . import ranks
from .processes import is_alive
from .reports import STOP_GRACE_S, WAITING, Reports
from .spec import PoolSpec
from .standin import StandIn

log = logging.getLogger("xdit.launcher")
JOB_ERROR_GRACE_S = 3.0
JOIN_RELAUNCH_DELAY_S = 2.0  # lets node 0 notice the break first and host the fresh rendezvous
RENDEZVOUS_RETRY_S = 1.0
DEATH_REPORT_S = 0.5  # a rank's peers can notice its death before /proc shows it


class PoolError(RuntimeError):
    """The pool could not start (the message carries the failing rank's own error)."""


class SettingsRefused(PoolError):
    """The ranks refused what the pool was asked to run (a layout that cannot work, a model that cannot load): the
    user's mistake, not a failure."""


__all__ = ["Pool", "PoolError", "PoolSpec", "SettingsRefused"]


def describe_node(row: dict) -> str:
    ranks = row["ranks"]
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}–{ranks[-1]}"
    return f"node {row['node']} ({span}{' on ' + row['host'] if row.get('host') else ''})"


class Pool(Reports):
    """This machine's share of a persistent pool; on node 0 it also owns `spec.endpoint`."""

    def __init__(self, spec: PoolSpec):
        spec.check()
        self.spec = replace(spec, curve_dir=spec.key_folder())  # the keys it serves with, the owner's by default
        self.restarts = 0
        self.jobs_done = 0
        self.state = "starting"
        self.error: str | None = None
        self.refused = False  # the error is the ranks' refusal of the settings (SettingsRefused)
        self.restart_reason: str | None = None
        self.nodes: list[dict] = []  # the world's nodes, as rank 0 last reported them
        self.host = socket.gethostname()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        self._ranks: ranks.Launch | None = None
        self.pids: dict[int, int] = {}

    # -- public -------------------------------------------------------------------------------------
    def spawn(self) -> "Pool":
        """Start supervising without waiting for the ranks (see `ready`, `state`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._supervise, name="xdit-supervisor", daemon=True)
            self._thread.start()
        return self

    def start(self, timeout_s: float = 600) -> "Pool":
        self.spawn()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise PoolError(f"the pool did not become ready within {timeout_s:.0f} s")
        if self.state == "error":
            self.stop()
            raise (SettingsRefused if self.refused else PoolError)(self.error)
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
    def ready(self) -> bool:
        return self._ready.is_set()

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
        self._control.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self._private = tempfile.mkdtemp(prefix="xdit-pool-")  # 0700: no other user may open the socket in it
        self._control_endpoint = f"ipc://{self._private}/control"
        self._control.bind(self._control_endpoint)
        self._standin: StandIn | None = None
        self._launch_at: float | None = None
        try:
            if self.spec.endpoint is not None:
                self._standin = StandIn(self._context, self.spec.endpoint, self.status, self._stop_requested.set,
                                        self.spec.curve_dir)
                self._standin.bind()
            self._launch()
            while not self._stop_requested.is_set():
                self._poll_once()
                if self._launch_at is not None and time.monotonic() >= self._launch_at:
                    self._launch()
                self._check_liveness()
            self._shutdown_ranks()
        except Exception as error:  # noqa: BLE001 - the supervisor must never die silently
            log.exception("supervisor failed")
            self.state, self.error = "error", f"supervisor failed: {error}"
        finally:
            self._kill_ranks()
            if self._standin is not None:
                self._standin.shutdown()
            self._control.close()
            self._context.term()
            shutil.rmtree(self._private, ignore_errors=True)
            self.state = "stopped" if self.state != "error" else self.state
            self._ready.set()
            self._stopped.set()

    def _launch(self) -> None:
        self.state, self.pids, self._launch_at = WAITING if self.spec.nnodes > 1 else "starting", {}, None
        self._ranks_ready: set[int] = set()
        self._current_job: tuple[str, bytes] | None = None
        self._job_errors: dict[int, str] = {}
        self._job_error_since = 0.0
        self._beats: dict[int, float] = {}  # rank -> when its heartbeat last came (control.Heartbeat)
        self._stop_deadline: float | None = None
        arguments = [*self.spec.rank_arguments(), "--control", self._control_endpoint, "--jobs-done",
                     str(self.jobs_done), "--restarts", str(self.restarts)]
        output = open(self.spec.log_file, "ab") if self.spec.log_file else None
        try:
            self._ranks = ranks.start(self.spec, arguments, output)
        finally:
            if output:
                output.close()
        self.pids = dict(self._ranks.pids)  # ranks started here are known at once; torchrun's say hello

    def _relaunch_after(self, delay_s: float) -> None:
        self._ranks, self._launch_at = None, time.monotonic() + delay_s

    def _poll_once(self) -> None:
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        if self._standin is not None:
            self._standin.register(poller)
        for sock, _ in poller.poll(50):
            if sock is self._control:
                self._drain_control()
            elif self._standin is not None:
                self._standin.handle(sock)
        if self._standin is not None:
            self._standin.retry()

    def _drain_control(self) -> None:
        """Every control message queued, before the liveness checks run: a rank that said "stopped" and exited must
        be read as stopped, not as dead (one message per poll let its exit overtake its word on a busy machine)."""
        while True:
            try:
                frames = self._control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, raw = frames
                report = read_report(raw)
            except (ValueError, ProtocolError) as error:  # only this pool's ranks speak here; still, never die of it
                log.warning("dropped a malformed control message (%d frames): %s", len(frames), error)
                continue
            if report.launch == self.restarts:  # else sent by a rank of a launch that has since been stopped
                self._handlers[type(report.body)](identity, report)

    def _dead_ranks(self) -> list[int]:
        return sorted(r for r, pid in self.pids.items() if not is_alive(pid))

    def _check_liveness(self) -> None:
        if self._ranks is None or self._stop_requested.is_set():
            return
        if self._job_errors and time.monotonic() - self._job_error_since > JOB_ERROR_GRACE_S:
            rank = min(self._job_errors)
            return self._crashed(f"the job failed on rank {rank} only ({self._job_errors[rank]}); the pool restarts")
        if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
            log.warning("ranks still busy %.0f s after a client's stop: ending them", STOP_GRACE_S)
            return self._stop_requested.set()
        if hung := self._hung_ranks():
            what = ", ".join(f"rank {r} (pid {self.pids.get(r)})" for r in hung)
            return self._crashed(f"{what} stopped responding: no heartbeat for {self.spec.hang_timeout_s:g} s "
                                 "(hung, stopped or starved); the pool is restarting")
        exited = self._ranks.exited()
        dead = self._dead_ranks()
        if exited is None and not dead:
            return
        self._drain_control()  # a "stopped" that came in since the poll: the exit is that stop
        if self._stop_requested.is_set():
            return
        if self._stop_deadline is not None:  # the ranks said a client stopped the pool: their exit is that stop
            return self._stop_requested.set()
        if self.state == WAITING:
            self.restart_reason = f"{exited} while waiting for the other nodes at {self.spec.rdzv_endpoint}; waiting again"
            log.warning("%s", self.restart_reason)
            self._kill_ranks()
            return self._relaunch_after(RENDEZVOUS_RETRY_S)
        if self.spec.nnodes == 1 and self.state != "ready":
            what = exited or ", ".join(f"rank {r} (pid {self.pids[r]}) died" for r in dead)
            return self._start_failed(f"{what} while the pool was starting")
        if dead:
            what = ", ".join(f"rank {r} (pid {self.pids[r]})" for r in dead)
            return self._crashed(f"{what} died; the pool is restarting")
        if self.spec.nnodes > 1:
            return self._world_broke(None, exited)
        self._crashed(f"{exited}; the pool is restarting")

    def _hung_ranks(self) -> list[int]:
        """Ranks of a ready pool whose heartbeat stopped: the watchdog that gloo's 30-minute timeout is not."""
        if self.state != "ready":
            return []
        now = time.monotonic()
        return sorted(r for r, beat in self._beats.items() if now - beat > self.spec.hang_timeout_s)

    def _world_broke(self, rank: int | None, error: str) -> None:
        """A rank here lost its peers: name a rank here that died, or else the other nodes.

        The reporting rank itself may die meanwhile (torchrun stops its ranks when it loses the
        rendezvous): that is a consequence, not the cause.
        """
        deadline = time.monotonic() + DEATH_REPORT_S
        while not (dead := [r for r in self._dead_ranks() if r != rank]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:
            what = ", ".join(f"rank {r} (pid {self.pids[r]}) died" for r in dead)
        elif self.spec.nnodes > 1:
            what = f"lost contact with {self._other_nodes()}: {error}"
        else:
            what = f"rank {rank} lost contact with the other ranks: {error}"
        self._crashed(f"{what}; the pool restarts when every node is back" if self.spec.nnodes > 1 else
                      f"{what}; the pool is restarting")

    def _other_nodes(self) -> str:
        rows = self.nodes or [{"node": n, "ranks": self.spec.ranks_of(n)} for n in range(self.spec.nnodes)]
        return ", ".join(describe_node(row) for row in rows if row["node"] != self.spec.node_rank)

    def _crashed(self, reason: str) -> None:
        log.error("%s", reason)
        self.restart_reason = reason
        self._kill_ranks()
        self.state = "restarting"
        if self._standin is not None:
            self._standin.bind()
            if self._current_job is not None:
                job, client = self._current_job
                self._standin.send(client, Message.of(Error(message=reason, rank=-1), job))
        self.restarts += 1
        self._relaunch_after(JOIN_RELAUNCH_DELAY_S if self.spec.node_rank else 0.0)

    def _start_failed(self, reason: str, refused: bool = False) -> None:
        log.error("%s", reason)
        self.state, self.error, self.refused = "error", reason, refused
        self._kill_ranks()
        self._ready.set()
        self._stop_requested.set()

    def _shutdown_ranks(self) -> None:
        """Let ranks that were asked to stop exit by themselves; then make sure of it."""
        if self._ranks is not None:
            self._ranks.wait(3 if not any(is_alive(p) for p in self.pids.values()) else 0.5)
        self._kill_ranks()

    def _kill_ranks(self) -> None:
        """Stop every process of the launch, whatever state it is in; wait until they are gone (ranks.Launch.end)."""
        if self._ranks is not None:
            self._ranks.end(self.pids.values())

    # -- what the stand-in answers ------------------------------------------------------------------
    def status(self) -> PoolStatus:
        return PoolStatus(
            state={"error": "error", WAITING: WAITING}.get(self.state, "starting"),
            world_size=self.spec.world_size, ranks_alive=sum(is_alive(p) for p in self.pids.values()),
            jobs_done=self.jobs_done, restarts=self.restarts, model=str(self.spec.model),
            parallel=self.spec.layout_status(), nodes=tuple(self.node_table()), error=self.error,
            restart_reason=self.restart_reason,
        )

    def node_table(self) -> list[dict]:
        """Nodes as last reported; this one takes part while its supervisor runs, others once the world formed."""
        formed = self.state in ("starting", "ready")
        rows = self.nodes or [{"node": n, "host": self.host if n == self.spec.node_rank else None,
                               "ranks": self.spec.ranks_of(n), "pids": []} for n in range(self.spec.nnodes)]
        return [{**row, "alive": row["node"] == self.spec.node_rank or formed} for row in rows]
