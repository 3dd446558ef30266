"""`--compile`: torch.compile of every transformer block's forward (regional compilation, as diffusers'
`compile_repeated_blocks`), with the engine's attention seam traced inside it.

Each block's `forward` is compiled, not its whole call: the hooks a job puts on blocks (the pool's cancel
checks, FSDP2's gathers, step caches) stay eager around it and never force a recompile. Blocks of one kind
share their code, so each kind compiles once per input shape. What dynamo cannot trace (a collective of
sequence-parallel attention, a context variable) breaks the graph and runs eagerly between compiled regions;
`report()` counts the graphs and the breaks, with their reasons, so their cost is visible.
"""

from __future__ import annotations

import torch

from ..loading.weight_sharding import transformer_blocks
from ..pipeline_transformers import TRANSFORMERS


def compile_blocks(pipeline) -> int:
    """Compile the forward of every block of the pipeline's transformer(s); the number of blocks."""
    count = 0
    for name in TRANSFORMERS:
        transformer = getattr(pipeline, name, None)
        if transformer is None:
            continue
        for block in transformer_blocks(getattr(transformer, "module", transformer)):
            block.forward = torch.compile(block.forward)
            count += 1
    return count


def report() -> dict:
    """Graphs compiled so far in this process and the graph breaks, most frequent reasons first."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    reasons = dict.fromkeys(reason.strip().splitlines()[0] for reason, _ in breaks.most_common())
    return {"graphs": int(counters["stats"]["unique_graphs"]), "breaks": int(sum(breaks.values())),
            "reasons": list(reasons)[:3]}


def describe(summary: dict) -> str:
    reasons = "; ".join(summary["reasons"])
    return f"compiled: {summary['graphs']} graphs, {summary['breaks']} graph breaks" + (f" ({reasons})" if reasons else "")
