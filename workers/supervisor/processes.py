"""Whether a process is still alive, as the pool's supervisor and rank 0 need to know it.

A zombie (exited, not yet reaped by torchrun) counts as dead: `kill(pid, 0)` would still succeed.
"""

from __future__ import annotations


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
