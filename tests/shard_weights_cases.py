"""Runs many (family, layout) cases with `--shard-weights` in one torchrun job.

    torchrun --nproc-per-node N tests/shard_weights_cases.py CASES.json

As tests/engine_cases.py, but every case loads its pipeline sharded (a sharded transformer is not
un-sharded afterwards, so each case loads its own). Fault "stale_shard": the last rank's shard of the
first block's first weight is zeroed after sharding, i.e. one rank serving a wrong shard, which the
comparison with diffusers must catch. "cache": the job's step cache settings (the wire's `cache` map).
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file, save_file

from parallel.cache_settings import CacheSettings
from parallel.layout.config import ParallelConfig
from parallel.distributed import destroy_model_parallel, initialize_model_parallel
from parallel.loading.pipelines import load_pipeline
from parallel.model_executor import wrap_pipeline
from parallel.request import STEP_CACHE
from parallel.loading.weight_sharding import transformer_blocks

import engine_cases


def run_case(case: dict, rank: int) -> None:
    initialize_model_parallel(ParallelConfig(**case["layout"], shard_weights=True))
    try:
        pipeline = load_pipeline(case["model"], shard_weights=True, offload=case["layout"].get("offload", False))
        if case.get("fault") == "stale_shard" and rank == torch.distributed.get_world_size() - 1:
            with torch.no_grad():
                next(transformer_blocks(pipeline.transformer)[0].parameters()).to_local().zero_()
        parallel = wrap_pipeline(pipeline)
        cache = {STEP_CACHE: CacheSettings.from_params(case["cache"])} if case.get("cache") else {}
        latents = parallel(**load_file(case["inputs"]), **case["call"], **cache, output_type="latent", return_dict=False)[0]
    finally:
        destroy_model_parallel()
    if rank == 0:
        save_file({"latents": latents.contiguous()}, case["output"])


if __name__ == "__main__":
    sys.exit(engine_cases.main(sys.argv[1], run=run_case))
