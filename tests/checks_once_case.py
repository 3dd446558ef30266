"""A pool job's path on every rank, with the pipeline's own checks counted (torchrun, 2 ranks).

    torchrun --nproc-per-node 2 tests/checks_once_case.py MODEL IN.safetensors OUT_PREFIX

Rank 0 validates each job as its server does at submit (JobRunner.prepare), then every rank runs it
(broadcast_work, JobRunner.run). Once with the validated arguments passed on (`prepared`), once without
(the negative control: rank 0 checks twice). Rank 0 writes OUT_PREFIX.json (checks per rank and mode)
and OUT_PREFIX.<mode>.safetensors (the latents).
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file

from parallel.layout.config import ParallelConfig
from parallel.distributed import destroy_distributed_environment, init_distributed_environment, initialize_model_parallel
from parallel.loading.pipelines import load_pipeline
from parallel.model_executor import wrap_pipeline
from parallel.fields import from_plain
from workers.rank.runner import JobRunner
from workers.rank.work import broadcast_work
from workers.wire.messages import Submit
from workers.wire.protocol import Message

PARAMS = {"steps": 3, "guidance_scale": 5.0, "height": 64, "width": 64, "call": {"guidance_scale_2": 2.0}}


class SilentServer:
    """Rank 0's client server, as far as a job needs it: nobody cancels, nobody listens."""

    def is_cancelled(self, job: str) -> bool:
        return False

    def send(self, client, message) -> None:
        pass


def main(model: str, inputs: str, prefix: str) -> None:
    world = init_distributed_environment()
    initialize_model_parallel(ParallelConfig(ulysses_degree=2))
    pipeline = wrap_pipeline(load_pipeline(model))
    checks = []
    wrapper = type(pipeline)
    check_inputs = wrapper.check_inputs
    wrapper.check_inputs = lambda self, kwargs, batch: (checks.append(1), check_inputs(self, kwargs, batch))[1]
    runner = JobRunner(pipeline, None, SilentServer() if world.rank == 0 else None)
    tensors = load_file(inputs)
    counts = {}
    for mode in ("prepared", "unprepared"):
        checks.clear()
        work, prepared = None, None
        if world.rank == 0:
            submit = runner.for_family(from_plain(Submit, PARAMS, "submit"))  # what rank 0's server does at submit
            validated = runner.prepare(submit, tensors)
            prepared = validated if mode == "prepared" else None
            work = Message.of(submit, f"job-{mode}", tensors)
        latents = runner.run(broadcast_work(work, None), None, prepared)["latents"]
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(world.world_size)]
        torch.distributed.all_gather(every, torch.tensor([len(checks)]))
        counts[mode] = [int(count) for count in every]
        if world.rank == 0:
            save_file({"latents": latents.contiguous()}, f"{prefix}.{mode}.safetensors")
    if world.rank == 0:
        with open(f"{prefix}.json", "w") as out:
            json.dump(counts, out)
    destroy_distributed_environment()


if __name__ == "__main__":
    main(*sys.argv[1:])
