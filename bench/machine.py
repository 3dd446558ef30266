"""How busy the machine is apart from the benchmark: timings on shared cores need a witness.

/proc/stat counts every CPU's busy time; subtracting the CPU time our own ranks used over the same
interval leaves what other processes took, in cores. On a dedicated machine it stays near 0. When
something else runs alongside (another session's test suite on the same two cores), it explains the
spread, and `settle` can wait for it to pass before a round starts. /proc/stat counts in clock ticks
(10 ms), so for runs much shorter than a second (the tiny model) the figure is mostly rounding.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_model() -> str:
    """The CPU's marketing name, for the record next to the timings."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def busy_seconds() -> float:
    """CPU-seconds all cores have spent outside idle and iowait since boot (0 where /proc is missing)."""
    if not _STAT.exists():
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in _STAT.read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS


def foreign_cores(busy_before: float, busy_after: float, own_cpu_seconds: float, wall_seconds: float) -> float:
    """Cores other processes kept busy on average over an interval in which we used `own_cpu_seconds`."""
    return max(0.0, busy_after - busy_before - own_cpu_seconds) / wall_seconds


def settle(limit_seconds: float, threshold_cores: float = 0.25, window_seconds: float = 1.0) -> float:
    """Wait, up to `limit_seconds`, for a window in which other processes use under `threshold_cores`.

    Call while our own ranks are idle. Returns the load of the last window (so the caller can record
    that it gave up waiting).
    """
    deadline = time.monotonic() + limit_seconds
    while True:
        before, own = busy_seconds(), time.process_time()
        time.sleep(window_seconds)
        load = foreign_cores(before, busy_seconds(), time.process_time() - own, window_seconds)
        if load < threshold_cores or time.monotonic() >= deadline:
            return load
