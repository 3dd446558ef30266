"""Shared fixtures: tiny pipelines saved once per session, torchrun helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel import tiny_models

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4


def torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` from the repo root with one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDIT_THREADS_PER_RANK": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_models.save_tiny_pipeline(family, root / family) for family in tiny_models.FAMILIES}


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)
