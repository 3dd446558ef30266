"""What rank 0 answers to `status`, and the memory census behind it.

The status is one typed reply (wire/messages.py PoolStatus) built from what this rank knows; the memory of
every rank comes from a census (a gather over the ranks) taken after each job, and between model calls at
most once a second.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..engine import engine, fields
from ..supervisor.processes import is_alive
from ..wire.messages import PoolStatus
from .memory import memory_of_this_rank

if TYPE_CHECKING:
    from .process import Rank


def status_of(rank: "Rank") -> PoolStatus:
    # Ranks on other machines count as alive while the world holds: the probes notice within a second.
    here = rank.args.node_rank
    nodes = tuple({**row, "alive": row["node"] != here or all(map(is_alive, row["pids"]))} for row in rank.nodes)
    alive = sum(sum(map(is_alive, row["pids"])) if row["node"] == here else len(row["pids"]) for row in nodes)
    common = dict(
        state=rank.state, world_size=rank.world_size, ranks_alive=alive, jobs_done=rank.jobs_done,
        model_calls=rank.model_calls, last_cache=rank.last_cache, restarts=rank.args.restarts, model=rank.args.model,
        vae=rank.args.vae, text_encoders=rank.args.text_encoders, dtype=rank.args.dtype or "as saved",
        storage=rank.storage, memory=tuple(rank.memory), pids=tuple(rank.pids), nodes=nodes,
        parallel={**fields.to_plain(rank.config, defaults=True), "description": rank.config.describe()},
        mesh=tuple(rank.layout.coordinates(r) for r in range(rank.world_size)) if rank.layout else (),
        queue=rank.server.queue_length() if rank.server else 0,
        **engine("distributed.devices").status_fields(),  # p2p, cards, mixed_cards: this machine's
    )
    if rank.state == "starting":
        return PoolStatus(**common, loads={"pipeline": 1, "lora": 0})
    pipeline = rank.pipeline
    return PoolStatus(
        **common, pipeline=type(pipeline.module).__name__, inputs=pipeline.input_widths(),
        model_class=pipeline.comfy_model_class(), latent_scale=pipeline.latent_scale(),
        loads={"pipeline": 1, "lora": rank.loras.loads}, loras=tuple(fields.to_plain(spec, defaults=True) for spec in rank.loras.active),
        layout_auto=rank.layouts.report() if rank.layouts is not None else None,
        step=rank.runner.step if rank.state == "busy" else 0,
        compile=engine("model_executor.compile").report() if rank.config.compile else None,
        fp8_matmul=pipeline.fp8_matmul,  # fp8 layers multiplying in fp8
        step_caches={method: engine("model_executor.step_cache").cache_refusal(type(pipeline.transformers()[0].module), method)
                     for method in ("first-block", "taylorseer")},  # --list-supported's reasons (xDiT Cache (model))
    )


def take_census(rank: "Rank") -> None:
    """Every rank's memory (RSS, device, parameters) and rank 0's storage per format, for the status."""
    rank.census_at = time.monotonic()
    transformers = torch.nn.ModuleList(wrapped.module for wrapped in rank.pipeline.transformers())  # all it holds
    rank.storage = engine("loading.checkpoints.fp8").storage_of(transformers)  # e.g. float8_e4m3fn + bfloat16 bytes
    own = memory_of_this_rank(transformers)
    flat = rank.gather_ints([own["rss_bytes"], own["device_bytes"], own["parameter_bytes"]])
    rank.memory = [
        {"rank": r, "rss_bytes": flat[3 * r], "device_bytes": flat[3 * r + 1], "parameter_bytes": flat[3 * r + 2]}
        for r in range(rank.world_size)
    ]
