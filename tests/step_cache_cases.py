"""Runs step-cache cases in one torchrun job (tests/test_step_cache.py).

    torchrun --nproc-per-node N tests/step_cache_cases.py CASES.json

Each case: {"model", "inputs", "output", "layout": {ParallelConfig fields}, "call": {__call__ kwargs},
"cache": {CacheSettings map}, "fault"}. Rank 0 writes the latents (and the audio of a video with sound); every
rank writes its cache decisions (per cache context) and the job's full/cached counts to output + ".rank<r>.json"; a
failing rank's traceback goes to output + ".error.rank<r>" (xdit_test_helpers.case_errors reads them all).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from parallel.cache_settings import CacheSettings
from parallel.layout.config import ParallelConfig
from parallel.loading.pipelines import load_pipeline
from parallel.model_executor import step_cache
from parallel.model_executor.layout_scope import under_layout
from parallel.request import STEP_CACHE

import engine_cases


def one_shard_metric(residual, previous, groups):
    """Negative control: the relative change of the first rank's shard alone, broadcast so ranks still agree."""
    value = torch.stack([(residual - previous).abs().sum() / previous.abs().sum()]).double()
    for group in groups:
        group.broadcast(value, src=0)
    return value.item()


FAULTS = {"one_shard": one_shard_metric}


def run_case(case: dict, rank: int) -> None:
    pipeline = load_pipeline(case["model"])
    with under_layout(pipeline, ParallelConfig(**case["layout"])) as parallel:
        original = step_cache.reduced_relative_change
        if case.get("fault"):
            step_cache.reduced_relative_change = FAULTS[case["fault"]]
        try:
            cache = CacheSettings.from_params(case["cache"])
            output = parallel(**load_file(case["inputs"]), **case["call"], **{STEP_CACHE: cache},
                              output_type="latent", return_dict=False)
        finally:
            step_cache.reduced_relative_change = original
        report = parallel.cache_report
    Path(f"{case['output']}.rank{rank}.json").write_text(
        json.dumps({"decisions": report.decisions, "full": report.full, "cached": report.cached}))
    if rank == 0:  # the latents, and what the pipeline returns beside them (LTX-2's and MiniMax-H3's audio)
        outputs = {"latents": output[0], **dict(zip(parallel.extra_outputs, output[1:]))}
        save_file({name: tensor.contiguous() for name, tensor in outputs.items()}, case["output"])


if __name__ == "__main__":  # every rank names its own error file
    sys.exit(engine_cases.main(sys.argv[1], run=run_case, error_suffix=lambda rank: f".rank{rank}"))
