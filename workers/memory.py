"""Memory per rank, for the pool's status: resident memory, device memory, model parameters."""

from __future__ import annotations

import os

import torch


def memory_of_this_rank(module: torch.nn.Module | None = None) -> dict[str, int]:
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    device = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    params = sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0
    return {"rss_bytes": rss, "device_bytes": device, "parameter_bytes": params}
