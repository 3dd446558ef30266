"""Helpers for pool tests: a `serve` process in its own session, references, process checks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from parallel import tiny_models
from workers.client import PoolClient
from workers.processes import is_alive

from xdit_test_helpers import ROOT
PARAMS = {"steps": 4, "guidance_scale": 4.5, "height": 64, "width": 64}


def free_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def start_serve(model_dir: Path, endpoint: str, *flags: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "workers", "serve", "--model", str(model_dir), "--endpoint", endpoint,
               "--threads-per-rank", "1", *flags]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def pool_processes(status: dict) -> list[int]:
    """Every rank's pid plus torchrun's (the ranks' parent)."""
    pids = list(status["pids"])
    with open(f"/proc/{pids[0]}/stat") as stat:
        pids.append(int(stat.read().rsplit(")", 1)[1].split()[1]))
    return pids




def wait_gone(pids: list[int], timeout_s: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if is_alive(p)]


def stop_serve(process: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if process.poll() is None:
        os.kill(process.pid, sig)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def reference(model_dir: Path, family: str, inputs: dict, params: dict = PARAMS) -> torch.Tensor:
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    with torch.no_grad():
        return pipeline(
            **inputs, **tiny_models.PIPELINE_CALL_DEFAULTS[family], num_inference_steps=params["steps"],
            guidance_scale=params["guidance_scale"], height=params["height"], width=params["width"],
            output_type="latent", return_dict=False, **params.get("call", {}),
        )[0]


def idle_client(endpoint: str, timeout_s: float = 120) -> tuple[PoolClient, dict]:
    client = PoolClient(endpoint)
    return client, client.wait_until_idle(timeout_s)
