"""Times several layouts inside one torchrun job, interleaved round by round.

    torchrun --nproc-per-node N -m bench.driver SPEC.json RESULT.json

SPEC: {"model": "medium"|"tiny"|"large", "layouts": [names], "runs": R, "settle_s": S, "link": {"name": LINK,
"gpu_tflops": F} or absent}; with a link, every timed call's collectives run under it (emulated_link.py). One untimed pass over every layout
comes first (it also records bytes sent and each output's distance from its 1-rank baseline), then R
rounds; round r starts at layout r mod L, so no layout always runs first after the set-up of another.
Our engine's mesh is built and torn down around every run (as the pool does when it switches layout);
only the pipeline call is timed, from a world barrier to the slowest rank's return. With S > 0, each
round first waits up to S seconds for other processes on the machine to go quiet. Rank 0 writes
RESULT: per layout the times, the bytes each rank sent per step, and max |latents − baseline|.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from parallel.distributed import destroy_distributed_environment, init_distributed_environment
from parallel.cli.torchrun_exit import exit_after_work
from parallel.distributed.parallel_state import all_coordinators
from parallel.model_executor.layout_scope import under_layout

from . import machine
from .emulated_link import EmulatedLink, emulating, from_spec
from .diffusers_cp import FunctionalCollectiveBytes, enable_context_parallel
from .layouts import LAYOUTS, Layout
from .model import MODELS, BenchModel, on_gpu, synchronize


@dataclass
class Run:
    """One prepared layout: `call` returns the latents (None on ranks that sit a 1-rank run out)."""

    call: Callable[[], torch.Tensor | None]
    bytes_sent: Callable[[], int]


class Runners:
    """Prepares each engine's run of the same pipeline and inputs on this rank."""

    def __init__(self, model: BenchModel, rank: int, layouts: list[Layout]):
        self.model, self.rank = model, rank
        self.pipeline = model.pipeline()
        self.inputs = on_gpu(self.pipeline, model.inputs(self.pipeline))  # on a GPU: this rank's device, bf16
        # diffusers' enable_parallelism cannot be undone, so each CP layout gets its own copy, set up
        # before any of our layouts has run (every rank builds the meshes in the same order).
        # If diffusers refuses (a version whose CP this CPU shim no longer fits), the layout is reported
        # unavailable with diffusers' one-line reason; every rank fails alike, so all skip it together.
        self.cp, self.unavailable = {}, {}
        for layout in layouts:
            if layout.engine == "diffusers-cp":
                try:
                    self.cp[layout.name] = self._context_parallel_copy(layout)
                except Exception as error:  # noqa: BLE001 - any failure of diffusers' CP is reported, not fatal
                    self.unavailable[layout.name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"

    def _context_parallel_copy(self, layout: Layout):
        pipeline = self.model.pipeline()
        on_gpu(pipeline, {})
        enable_context_parallel(pipeline.transformer, ulysses_degree=layout.ulysses, ring_degree=layout.ring)
        return pipeline

    def _call(self, pipeline, layout: Layout) -> torch.Tensor:
        return pipeline(**self.inputs, **self.model.call_kwargs(layout.true_cfg))[0]

    @contextlib.contextmanager
    def prepare(self, layout: Layout) -> Iterator[Run]:
        if layout.engine == "diffusers":
            yield Run(lambda: self._call(self.pipeline, layout) if self.rank < layout.replicas else None, lambda: 0)
        elif layout.engine == "xdit":
            with under_layout(self.pipeline, layout.parallel_config()) as wrapped:
                yield Run(lambda: self._call(wrapped, layout), _xdit_bytes_sent)
        else:
            counter = FunctionalCollectiveBytes()
            with counter.counting():
                yield Run(lambda: self._call(self.cp[layout.name], layout), lambda: counter.bytes_sent)


def _xdit_bytes_sent() -> int:
    return sum(coordinator.bytes_sent for coordinator in all_coordinators().values())


def timed(run: Run, link: EmulatedLink | None = None) -> tuple[float, torch.Tensor | None, list[int], float]:
    """Seconds from a world barrier to the slowest rank's return, the latents, bytes sent per rank, and
    the cores other processes kept busy meanwhile (see machine.py); the call's collectives under `link`."""
    before = run.bytes_sent()
    dist.barrier()
    busy, cpu, start = machine.busy_seconds(), time.process_time(), time.perf_counter()
    with emulating(link):
        latents = run.call()
    synchronize()  # on a GPU: the queued kernels count
    wire = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    finished = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64, device=wire)
    sent = torch.tensor([run.bytes_sent() - before], dtype=torch.int64, device=wire)
    elapsed, own_cpu = finished.clone(), finished.clone()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.all_reduce(own_cpu, op=dist.ReduceOp.SUM)
    foreign = machine.foreign_cores(busy, machine.busy_seconds(), own_cpu[1].item(), elapsed[0].item())
    per_rank = [torch.zeros_like(sent) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, sent)
    return elapsed[0].item(), latents, [int(t) for t in per_rank], foreign


def settle(limit_seconds: float, rank: int) -> None:
    """Rank 0 waits for the other processes on the machine to quiet down while every rank idles."""
    if limit_seconds > 0 and rank == 0:
        machine.settle(limit_seconds)
    dist.barrier()


def main(spec_path: str, result_path: str) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)  # diffusers' own funcol deprecations
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    model = MODELS[spec["model"]]
    layouts = sorted((LAYOUTS[name] for name in spec["layouts"]), key=lambda l: l.engine != "diffusers")
    world = init_distributed_environment()
    runners = Runners(model, world.rank, layouts)
    link, own_tflops = from_spec(spec, world.rank)
    results: dict[str, dict] = {name: {"unavailable": why} for name, why in runners.unavailable.items()}
    layouts = [layout for layout in layouts if layout.name not in runners.unavailable]
    results.update({layout.name: {"times_s": [], "foreign_cores": []} for layout in layouts})
    outputs: dict[str, torch.Tensor] = {}
    for layout in layouts:  # warm-up, traffic and correctness
        with runners.prepare(layout) as run:
            _, latents, sent, _ = timed(run, link)
        if latents is not None:
            outputs[layout.name] = latents
        results[layout.name]["bytes_per_step_per_rank"] = [b / model.steps for b in sent]
        if world.rank == 0:
            results[layout.name]["max_abs_diff"] = (latents - outputs[layout.baseline]).abs().max().item()
    for round_index in range(spec["runs"]):
        shift = round_index % len(layouts)
        settle(spec.get("settle_s", 0), world.rank)
        for layout in layouts[shift:] + layouts[:shift]:
            with runners.prepare(layout) as run:
                seconds, _, _, foreign = timed(run, link)
            results[layout.name]["times_s"].append(seconds)
            results[layout.name]["foreign_cores"].append(foreign)
    if world.rank == 0:
        meta = {
            "world_size": world.world_size, "threads_per_rank": torch.get_num_threads(), "model": model.name,
            "height": model.height, "width": model.width, "steps": model.steps, "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "dims": asdict(model.dims(runners.pipeline)),
            "link": link.describe() if link else None, "cpu_tflops": own_tflops,
        }
        Path(result_path).write_text(json.dumps({"meta": meta, "layouts": results}, indent=1))
    destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    exit_after_work(main(*sys.argv[1:3]))
