"""Helpers for pool tests: a `serve` process in its own session, references, process checks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import zmq

from parallel.cli.launch import rank_environment
from workers.client import PoolClient
from workers.wire import owner_keys
from workers.wire.auth import ClientKeys, ServerKeys
from workers.wire.endpoints import free_endpoint  # noqa: F401 - the pool tests take it from here
from workers.supervisor.processes import is_alive

from xdit_test_helpers import ROOT, diffusers_latents
PARAMS = {"steps": 4, "guidance_scale": 4.5, "height": 64, "width": 64}


def start_serve(model_dir: Path, endpoint: str, *flags: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "workers", "serve", "--model", str(model_dir), "--endpoint", endpoint,
               "--threads-per-rank", "1", *flags]
    return subprocess.Popen(command, cwd=ROOT, env=rank_environment(), stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def owner_socket(kind: int = zmq.DEALER, server: bool = False) -> zmq.Socket:
    """A raw ZMQ socket with this user's own CURVE keys, as the pools this user starts expect: a client's (hostile
    clients are the owner's own here), or with `server` a server's (a stand-in for a pool)."""
    socket = zmq.Context.instance().socket(kind)
    folder = owner_keys.owner_folder()
    if server:
        keys = ServerKeys.load(folder)
        socket.curve_secretkey, socket.curve_publickey, socket.curve_server = keys.secret, keys.public, True
    else:
        ClientKeys.load(folder).apply(socket)
    return socket


def pool_processes(status: dict) -> list[int]:
    """Every rank's pid plus their parent's (the supervisor's process on one machine)."""
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
    """diffusers' result for a pool job's inputs and parameters."""
    return diffusers_latents(model_dir, family, **inputs, num_inference_steps=params["steps"],
                             guidance_scale=params["guidance_scale"], height=params["height"], width=params["width"],
                             **params.get("call", {}))


def idle_client(endpoint: str, timeout_s: float = 120) -> tuple[PoolClient, dict]:
    client = PoolClient(endpoint)
    return client, client.wait_until_idle(timeout_s)


@contextlib.contextmanager
def serving(model_dir: Path, work: Path, *flags: str):
    """A `serve` pool on a free endpoint (its log in `work`) and an idle client for it; stopped after."""
    endpoint = free_endpoint()
    process = start_serve(model_dir, endpoint, *flags, log=work / "serve.log")
    try:
        client, _ = idle_client(endpoint)
        with client:
            yield client
    finally:
        stop_serve(process)
