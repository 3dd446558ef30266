"""Runs many contract E invocations in one torchrun job: `parallel.run.main(argv)` per case, as
`torchrun -m parallel.run ARGV` runs it, but in one world for the whole list.

    torchrun --nproc-per-node N tests/contract_e_cases.py CASES.json

Each case in CASES.json: {"argv": [contract E's arguments, --output included], "fault"}. A torchrun launch
per invocation would cost ~10 s of start-up each; here the ranks start once and each case goes through
contract E's own code (its argument parsing, loading with --dtype, the request, the cast of the inputs,
the output file). Between cases only the mesh is torn down (`destroy_model_parallel`, where contract E
destroys the world), and a mistake raises instead of ending the run (`exit_quietly`), so that the matrix
goes on. Fault "perturbed_shard": every shard the last rank takes of the plan's split inputs (its image tokens,
their rotary table, the text where it splits) gets noise of PERTURBATION times its RMS, i.e. one rank working on a slightly
wrong shard, which the dtype-aware bound must catch (negative control). "stale_shard": NAME zeroes the last rank's shard
of the first block's first weight of the pipeline's transformer NAME once contract E has loaded it sharded (one rank
serving a wrong shard of that transformer); "report_storage": rank 0 writes every transformer's parameter bytes
per storage format on every rank to output + ".storage.json".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import parallel.distributed
import parallel.run
from parallel.model_executor import hooks

import engine_cases

PERTURBATION = 2.0 ** -3  # noise of 1/8 of the shard's RMS
_SHARD = hooks.shard
_DESTROY = parallel.distributed.destroy_distributed_environment
_LOAD = parallel.run.load_pipeline


class CaseRefused(RuntimeError):
    """Contract E ended the case with a user error (its `error:` line is on stderr)."""


def _refuse(code: int) -> None:
    raise CaseRefused(f"contract E exited with {code}")


def _perturbed_on_last_rank(tensor, dim, group, what, uneven=False):
    part = _SHARD(tensor, dim, group, what, uneven)
    if group.rank_in_group == group.world_size - 1 and part.is_floating_point():
        noise = torch.randn(part.shape, generator=torch.Generator().manual_seed(0)).to(part)
        return part + PERTURBATION * part.float().pow(2).mean().sqrt().to(part) * noise
    return part


def _loading(case: dict, rank: int):
    """Contract E's load_pipeline, then the case's wrong shard or storage report on what it loaded."""
    from parallel.loading.checkpoints.fp8 import storage_of
    from parallel.loading.weight_sharding import transformer_blocks
    from parallel.pipeline_transformers import TRANSFORMERS

    def load(*args, **kwargs):
        pipeline = _LOAD(*args, **kwargs)
        world = torch.distributed.get_world_size()
        if case.get("stale_shard"):  # every rank checks, so that a whole transformer ends the case on all alike
            weight = next(transformer_blocks(getattr(pipeline, case["stale_shard"]))[0].parameters())
            if not hasattr(weight, "to_local"):
                raise ValueError(f"{case['stale_shard']} is not sharded: it has no shard to make wrong")
            if rank == world - 1:
                with torch.no_grad():
                    weight.to_local().zero_()
        if case.get("report_storage"):
            mine = {name: storage_of(getattr(pipeline, name)) for name in TRANSFORMERS
                    if getattr(pipeline, name, None) is not None}
            every = [None] * world
            torch.distributed.all_gather_object(every, mine)
            if rank == 0:
                Path(case["argv"][case["argv"].index("--output") + 1] + ".storage.json").write_text(json.dumps(every))
        return pipeline
    return load


def run_case(case: dict, rank: int) -> None:
    parallel.distributed.destroy_distributed_environment = parallel.distributed.destroy_model_parallel
    parallel.run.exit_quietly = _refuse
    if case.get("fault") == "perturbed_shard":
        hooks.shard = _perturbed_on_last_rank
    parallel.run.load_pipeline = _loading(case, rank)
    try:
        code = parallel.run.main(case["argv"])
    finally:
        hooks.shard = _SHARD
        parallel.run.load_pipeline = _LOAD
        parallel.distributed.destroy_distributed_environment = _DESTROY
    if code:
        raise CaseRefused(f"contract E returned {code}")


if __name__ == "__main__":
    engine_cases.exit_after_work(engine_cases.main(sys.argv[1], run=run_case))
