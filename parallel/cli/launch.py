"""Starting ranks: the one place that builds torchrun command lines and the environment of a rank.

The demo, the benchmarks, the tests and a pool over several machines start ranks through torchrun here; a
one-machine pool starts its ranks itself (workers/supervisor/ranks.py) with this environment. So how a rank is
launched (standalone or a c10d rendezvous across machines, threads per rank, the repo root on the path) is
decided here. Light on purpose: launchers import it without torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THREADS_ENV = "XDIT_THREADS_PER_RANK"


def torchrun_command(nproc: int, *args: str, nnodes: int = 1, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "xdit-pool", options: tuple[str, ...] = ()) -> list[str]:
    """`python -m torch.distributed.run` with `nproc` ranks on this machine, then `options` (torchrun's
    own) and `args` (the module or script and its arguments). One machine: --standalone. Several: a
    c10d rendezvous whose store the launcher hosts at `rdzv_endpoint` itself (no agent hosts it: an
    agent's store would listen on every interface)."""
    if nnodes == 1:
        launch = ["--standalone", "--nproc-per-node", str(nproc)]
    else:
        # c10d orders nodes its own way (it ignores --node-rank); the ranks put node 0 first themselves.
        launch = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", str(rdzv_endpoint), "--rdzv-id", rdzv_id, "--rdzv-conf", "is_host=0",
                  "--max-restarts", "0"]
    return [sys.executable, "-m", "torch.distributed.run", *launch, *options, *args]


def rank_environment(threads_per_rank: int | None = 1, devices: str | None = None) -> dict[str, str]:
    """This process's environment with the repo root first on PYTHONPATH and, when given, the threads
    of each rank (OMP and torch, see `apply_threads_per_rank`) and the GPUs it may see."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if threads_per_rank:
        env["OMP_NUM_THREADS"] = env[THREADS_ENV] = str(threads_per_rank)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends this process `sig` when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG):
    ranks die with their torchrun agent, the agent with its supervisor."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)
    except OSError:
        pass


def apply_threads_per_rank() -> None:
    """In a rank: use the thread count its launcher chose (`rank_environment`), if it chose one."""
    import torch

    if os.environ.get(THREADS_ENV):
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
