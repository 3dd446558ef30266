"""This machine's ranks as processes: one launch of them started, watched and ended, on one machine or several.

One machine: the supervisor starts every rank itself (`python -m workers.rank`), with the environment torchrun
would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; one OpenMP thread unless chosen), and the ranks
meet through the store it hosts on loopback (parallel/cli/rendezvous.py). torchrun's agent would add nothing here: the pool
launches with --max-restarts 0, and the supervisor already watches every pid and heartbeat and restarts; but its
stores listen on every interface. Several machines: torchrun's elastic agent per machine, as before, meeting in
the c10d rendezvous node 0's supervisor hosts on the address of --rdzv-endpoint.

Either way a launch is a process group of its own, so one signal reaches every process of it (the agent, the
ranks, their own children), and each process dies with the supervisor thread that started it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from typing import Iterable

from ..engine import launch, rendezvous
from .processes import is_alive
from .spec import PoolSpec

RANK_MODULE = ("-m", "workers.rank")


class Launch:
    """One launch: its processes by name ("rank 1", or "torchrun"), the ranks' pids where known at start, its store."""

    def __init__(self, processes: dict[str, subprocess.Popen], pids: dict[int, int], store: Store | None):
        self.processes, self.pids, self.store = processes, pids, store
        self.group = next(iter(processes.values())).pid  # the first process leads the group

    def exited(self) -> str | None:
        """What ended the launch ("rank 1 exited with code -9", "torchrun exited with code 1"); None while it runs."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                return f"{name} exited with code {process.returncode}"
        return None

    def wait(self, timeout_s: float, pids: Iterable[int] = ()) -> bool:
        """Until every process of the launch, and every rank in `pids`, has exited; False if one is left after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.processes.values()) or any(is_alive(p) for p in pids):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def end(self, pids: Iterable[int]) -> None:
        """Stop every process, whatever state it is in, and wait until they are gone; then close the store.

        The ranks go first (SIGTERM: they exit 0 at once), so an agent sees its workers finish and exits by
        itself (SIGTERM to torchrun would print its SignalException traceback). SIGKILL of the group is the fallback.
        """
        pids = list(pids)
        for pid in pids:
            _signal(pid, signal.SIGTERM)
            _signal(pid, signal.SIGCONT)  # a stopped rank acts on SIGTERM only once it runs
        self.wait(3.0, pids)
        try:
            os.killpg(self.group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait(5.0, pids)
        for pid in pids:  # every rank is in the group; this is only a safety net
            _signal(pid, signal.SIGKILL)
        for process in self.processes.values():
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self.store is not None:
            self.store.close()


def _signal(pid: int, sig: int) -> None:
    if is_alive(pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _in_group(group: int) -> None:
    """In a new rank before it runs: join the launch's process group (0: lead a new one), die with the supervisor."""
    os.setpgid(0, group)
    launch.die_with_parent(signal.SIGKILL)


def start(spec: PoolSpec, arguments: list[str], output) -> Launch:
    """Launch this machine's ranks with `arguments` (the rank command line), their output to `output` (None: ours)."""
    outputs = {"stdout": output, "stderr": subprocess.STDOUT if output else None}
    environment = launch.rank_environment(spec.threads_per_rank, spec.devices)
    if spec.nnodes > 1:
        return _start_torchrun(spec, arguments, environment, outputs)
    store = rendezvous.Store()
    processes: dict[str, subprocess.Popen] = {}
    group = 0
    for rank, env in enumerate(rendezvous.one_machine_environments(spec.nproc, environment)):
        process = subprocess.Popen(
            [sys.executable, *RANK_MODULE, *arguments, "--store", store.address], cwd=launch.ROOT, env=env,
            preexec_fn=functools.partial(_in_group, group), **outputs,
        )
        group = group or process.pid
        processes[f"rank {rank}"] = process
    return Launch(processes, {rank: p.pid for rank, p in enumerate(processes.values())}, store)


def _start_torchrun(spec: PoolSpec, arguments: list[str], environment: dict, outputs: dict) -> Launch:
    """Several machines: node 0 hosts the rendezvous on the address of --rdzv-endpoint (the others reach it there)."""
    host, port = rendezvous.rendezvous_address(spec.rdzv_endpoint)
    store = rendezvous.Store(host, port) if spec.node_rank == 0 else None
    environment |= rendezvous.network_environment(host) | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = launch.torchrun_command(
        spec.nproc, *RANK_MODULE, *arguments, "--store", spec.rdzv_endpoint, nnodes=spec.nnodes,
        rdzv_endpoint=spec.rdzv_endpoint, rdzv_id=spec.rdzv_id, options=("--monitor-interval", "1"),
    )
    process = subprocess.Popen(command, cwd=launch.ROOT, env=environment, start_new_session=True,
                               preexec_fn=functools.partial(launch.die_with_parent, signal.SIGTERM), **outputs)
    return Launch({"torchrun": process}, {}, store)
