"""Runs many (family, layout) cases with `--shard-weights` in one torchrun job.

    torchrun --nproc-per-node N tests/shard_weights_cases.py CASES.json

As tests/engine_cases.py, but every case loads its pipeline sharded (a sharded transformer is not
un-sharded afterwards, so each case loads its own). Fault "stale_shard": the last rank's shard of the
first block's first weight is zeroed after sharding, i.e. one rank serving a wrong shard, which the
comparison with diffusers must catch. "cache": the job's step cache settings (the wire's `cache` map).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from parallel.cache_settings import CacheSettings
from parallel.config import ParallelConfig
from parallel.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
from parallel.loading import load_pipeline
from parallel.model_executor import wrap_pipeline
from parallel.request import STEP_CACHE
from parallel.weight_sharding import transformer_blocks


def run_case(case: dict, rank: int, world_size: int) -> None:
    initialize_model_parallel(ParallelConfig(**case["layout"], shard_weights=True))
    try:
        pipeline = load_pipeline(case["model"], shard_weights=True)
        if case.get("fault") == "stale_shard" and rank == world_size - 1:
            with torch.no_grad():
                next(transformer_blocks(pipeline.transformer)[0].parameters()).to_local().zero_()
        parallel = wrap_pipeline(pipeline)
        cache = {STEP_CACHE: CacheSettings.from_params(case["cache"])} if case.get("cache") else {}
        latents = parallel(**load_file(case["inputs"]), **case["call"], **cache, output_type="latent", return_dict=False)[0]
    finally:
        destroy_model_parallel()
    if rank == 0:
        save_file({"latents": latents.contiguous()}, case["output"])


def main(spec: str) -> int:
    torch.set_num_threads(1)
    world = init_distributed_environment()
    for case in json.loads(Path(spec).read_text()):
        try:
            run_case(case, world.rank, world.world_size)
        except Exception:  # recorded per case (rank 0's, else the failing rank's); the matrix goes on
            suffix = "" if world.rank == 0 else f".rank{world.rank}"
            Path(case["output"] + ".error" + suffix).write_text(traceback.format_exc())
    destroy_distributed_environment()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
