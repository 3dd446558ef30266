"""The CUDA tests (scripts/gpu_check.sh runs them on a lent GPU; the README's CPU command does not collect this folder:
pyproject.toml's norecursedirs). Without CUDA the session stops at once with one line and exit status 2.

Shared here: a one-rank world in this process (NCCL on the card), the FLUX.1-width bench model (bench/model.py's
`large`: FLUX.1-dev's width, heads and embeddings, 12 of its blocks) and its references: diffusers' own pipeline on
this GPU in fp32 and in bf16, 2 steps at 1024². `record(name, value)` keeps a measurement for bench/RESULTS.md
(bench/gpu_report.py reads $XDIT_GPU_OUT/tests.json).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch

STEPS = 2
FACTOR = 1.5  # as tests/test_bf16_fp8.py: within 1.5× diffusers' own bf16 error from fp32
_RECORDS: dict = {}


def pytest_configure(config):
    if not torch.cuda.is_available():
        pytest.exit("tests/gpu needs a CUDA GPU (torch.cuda.is_available() is False): run scripts/gpu_check.sh on one",
                    returncode=2)


def relative_l2(result: torch.Tensor, reference: torch.Tensor) -> float:
    result, reference = result.float().cpu(), reference.float().cpu()
    return ((result - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="session")
def record():
    def keep(name: str, value) -> None:
        _RECORDS[name] = value
        out = os.environ.get("XDIT_GPU_OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "tests.json").write_text(json.dumps(_RECORDS, indent=1, default=str))

    return keep


@pytest.fixture(scope="session")
def world():
    """A one-rank world in this process, on the card (the engine's layouts need a mesh)."""
    from parallel.distributed import init_distributed_environment

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(name, value)
    return init_distributed_environment()


def bench_model(blocks: tuple[int, int] | None = None):
    """bench/model.py's FLUX.1-width model (`large`), with (double, single) blocks where given."""
    from bench.model import MODELS

    large = MODELS["large"]
    if blocks is None:
        return large
    return replace(large, transformer={**large.transformer, "num_layers": blocks[0], "num_single_layers": blocks[1]})


def call_of(model) -> dict:
    return {**model.call_kwargs(true_cfg=False), "num_inference_steps": STEPS}


def inputs_of(model, pipeline) -> dict:
    return {k: v for k, v in model.inputs(pipeline).items() if not k.startswith("negative")}


@torch.no_grad()
def diffusers_run(pipeline, inputs: dict, dtype: torch.dtype, call: dict) -> torch.Tensor:
    """diffusers' own pipeline on this GPU in `dtype`, the inputs cast to it; the pipeline is left on the CPU."""
    pipeline.to("cuda", dtype)
    try:
        return pipeline(**{k: v.to("cuda", dtype) for k, v in inputs.items()}, **call)[0].float().cpu()
    finally:
        pipeline.to("cpu", torch.float32)
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def flux_width(tmp_path_factory):
    """The FLUX.1-width model saved in bf16 (a pool loads it), its inputs, and diffusers' fp32 and bf16 results."""
    model = bench_model()
    pipeline = model.pipeline()
    inputs, call = inputs_of(model, pipeline), call_of(model)
    folder = tmp_path_factory.mktemp("flux_width") / "model"
    reference = {"fp32": diffusers_run(pipeline, inputs, torch.float32, call),
                 "bf16": diffusers_run(pipeline, inputs, torch.bfloat16, call)}
    pipeline.to(torch.bfloat16).save_pretrained(folder)
    return {"model": model, "folder": folder, "inputs": inputs, "call": call, "reference": reference,
            "own_error": relative_l2(reference["bf16"], reference["fp32"])}
