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
wrong shard, which the dtype-aware bound must catch (negative control).
"""

from __future__ import annotations

import sys

import torch

import parallel.distributed
import parallel.run
from parallel.model_executor import hooks

import engine_cases

PERTURBATION = 2.0 ** -3  # noise of 1/8 of the shard's RMS
_SHARD = hooks.shard
_DESTROY = parallel.distributed.destroy_distributed_environment


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


def run_case(case: dict, rank: int) -> None:
    parallel.distributed.destroy_distributed_environment = parallel.distributed.destroy_model_parallel
    parallel.run.exit_quietly = _refuse
    if case.get("fault") == "perturbed_shard":
        hooks.shard = _perturbed_on_last_rank
    try:
        code = parallel.run.main(case["argv"])
    finally:
        hooks.shard = _SHARD
        parallel.distributed.destroy_distributed_environment = _DESTROY
    if code:
        raise CaseRefused(f"contract E returned {code}")


if __name__ == "__main__":
    engine_cases.exit_after_work(engine_cases.main(sys.argv[1], run=run_case))
