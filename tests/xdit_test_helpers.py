"""Constants and launchers shared by the test modules (imported as a top-level module by pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4


def torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` from the repo root with one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDIT_THREADS_PER_RANK": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
