"""`python -m parallel.run --nproc-per-node N ...`: contract E's ranks started by the engine itself, on this machine.

Under torchrun a rank cannot choose the run's exit status: torchrun answers any failed worker with exit 1 and a
ChildFailedError traceback, so rank 0 stops its agent instead (torchrun_exit.py) and the shell reads 137, as if
memory had run out. Here the launcher is the parent: it checks what it can before any rank starts (the
arguments, the files, the layout against N ranks: one `error:` line, exit 2), then starts the N ranks with the
environment torchrun would give them, meeting through a store it hosts on loopback only (rendezvous.py; torchrun's
stores listen on every interface). It exits as the ranks did: 0; 2 where a rank refused the job (rank 0 printed
the one line); 1 where the job failed; 128 + N where a rank was killed by signal N (or the launcher was). When one
rank ends in failure the others get a few seconds to end alike, then are stopped, as torchrun stops them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .launch import ROOT, die_with_parent, rank_environment
from .rendezvous import Store, one_machine_environments

STORE_ENV = "XDIT_STORE"  # HOST:PORT of the store a launcher hosts for its ranks
FAILED_PEERS_WAIT_S = 5.0  # after a rank fails: the others' time to fail alike (a refused layout) before they are stopped


def nproc_of(argv: list[str]) -> tuple[int | None, list[str]]:
    """`--nproc-per-node N` (or `=N`) taken out of `argv`: (N or None, the rest)."""
    rest, nproc, args = [], None, iter(argv)
    for arg in args:
        if arg == "--nproc-per-node":
            nproc = next(args, "")
        elif arg.startswith("--nproc-per-node="):
            nproc = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if nproc is None:
        return None, argv
    if not nproc.isdigit() or int(nproc) < 1:
        print(f"error: --nproc-per-node {nproc!r}: give the number of ranks to start, 1 or more", file=sys.stderr)
        raise SystemExit(2)
    return int(nproc), rest


def launch(nproc: int, argv: list[str]) -> int:
    """Start `nproc` ranks of `python -m parallel.run argv` and return the run's exit status."""
    store = Store()
    environments = one_machine_environments(nproc, rank_environment(threads_per_rank=None) | {STORE_ENV: store.address})
    ranks = [subprocess.Popen([sys.executable, "-m", "parallel.run", *argv], cwd=ROOT, preexec_fn=_own_group, env=env)
             for env in environments]
    received: list[int] = []

    def forward(number, _frame):  # Ctrl-C or a kill of the launcher ends the ranks and the run as that signal
        received.append(number)
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, forward)
    try:
        first = _first_failure(ranks)
    finally:
        store.close()
    if received:
        return 128 + received[0]
    return exit_status(first)


def _own_group() -> None:
    """In a rank before it runs: out of the terminal's process group (the launcher hears Ctrl-C and ends the ranks
    itself, without a KeyboardInterrupt traceback from each), and dying with the launcher."""
    os.setpgid(0, 0)
    die_with_parent()


def _first_failure(ranks: list[subprocess.Popen]) -> int:
    """The exit code of the first rank seen to fail (0: none failed); the others get FAILED_PEERS_WAIT_S to end,
    then are killed (their codes say nothing more: a peer lost, or the kill)."""
    first, failed_at = 0, None
    while any(process.poll() is None for process in ranks):
        codes = [process.poll() for process in ranks]
        if failed_at is None and any(code not in (None, 0) for code in codes):
            first, failed_at = next(code for code in codes if code not in (None, 0)), time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_PEERS_WAIT_S:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.05)
    if failed_at is None:
        first = next((process.returncode for process in ranks if process.returncode != 0), 0)
    return first


def exit_status(code: int) -> int:
    """A rank's exit code as the run's status: 0, 2 (a refusal), 1 (a failure), or 128 + N for signal N."""
    return 128 - code if code < 0 else code
