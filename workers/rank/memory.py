"""Memory per rank, for the pool's status: resident memory, device memory, model parameters."""

from __future__ import annotations

import os

import torch


def memory_of_this_rank(module: torch.nn.Module | None = None) -> dict[str, int]:
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    device = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    params = sum(_local(p).numel() * p.element_size() for p in module.parameters()) if module is not None else 0
    return {"rss_bytes": rss, "device_bytes": device, "parameter_bytes": params}


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's own shard of a parameter split over the ranks (--shard-weights), else the parameter."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


class PeakMemory:
    """This process's peak memory over a block: the device allocator's peak on CUDA, else the peak RSS
    (Linux's VmHWM, reset through /proc/self/clear_refs), both above what the process held before."""

    def __enter__(self) -> "PeakMemory":
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            self.before = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # VmHWM := VmRSS
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _status_bytes("VmHWM")
        self.bytes = max(0, peak - self.before)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0
