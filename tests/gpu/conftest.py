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


def _keep(name: str, value) -> None:
    _RECORDS[name] = value
    out = os.environ.get("XDIT_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "tests.json").write_text(json.dumps(_RECORDS, indent=1, default=str))


def pytest_runtest_logreport(report):
    """Each test's seconds (setup, call and teardown), kept as it ends: a check stopped at its time limit still
    says where the time went (the first lent H200 ran 11 of 13 tests in the 250 s)."""
    durations = _RECORDS.get("durations_s", {})
    durations[report.nodeid] = round(durations.get(report.nodeid, 0.0) + report.duration, 2)
    _keep("durations_s", durations)


@pytest.fixture(scope="session")
def record():
    return _keep


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
    from bench.model import MODELS, with_blocks

    return with_blocks(MODELS["large"], blocks)


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
    sigmas = pipeline.scheduler.sigmas.cpu()  # the bf16 run's steps (on the card): xDiT Model's test steps through them
    pipeline.to(torch.bfloat16).save_pretrained(folder)
    return {"model": model, "folder": folder, "inputs": inputs, "call": call, "reference": reference, "sigmas": sigmas,
            "own_error": relative_l2(reference["bf16"], reference["fp32"])}
