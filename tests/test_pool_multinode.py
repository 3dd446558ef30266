"""A pool over two "machines" on this one: `serve --nnodes 2 --node-rank 0` and `join --node-rank 1`.

Two supervisors, two torchrun elastic agents meeting in a c10d rendezvous that node 0's supervisor hosts
on 127.0.0.1 (nothing listens elsewhere), one rank each (Ulysses 2 across the nodes), CURVE keys on the
endpoint as in the README's two-machine recipe.
Results are compared with diffusers' single-process output. Then node 1 is killed outright (its
supervisor's process group, its torchrun and its rank, all SIGKILL, as when a machine dies), and the
pool must fail the running job naming the node, say `waiting for nodes`, and come back when node 1
joins again.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from parallel.loading import tiny_models
from parallel.cli.launch import rank_environment
from workers.client import JobFailed, PoolClient
from workers.wire.endpoints import free_port

from xdit_test_helpers import TOLERANCE
from pool_helpers import PARAMS, ROOT, free_endpoint, reference, start_serve, stop_serve, wait_gone
from workers.supervisor.processes import is_alive as alive

FAMILY = "pixart-alpha"


def start_join(model_dir, *flags: str, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "workers", "join", "--model", str(model_dir), "--threads-per-rank", "1", *flags]
    return subprocess.Popen(command, cwd=ROOT, env=rank_environment(), stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def wait_for_state(client: PoolClient, state: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    status = {}
    while time.monotonic() < deadline:
        status = client.status()
        if status["state"] == state:
            return status
        time.sleep(0.1)
    raise AssertionError(f"the pool never said {state!r}: {status}")


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("two_nodes")
    keys = work / "keys"
    made = subprocess.run([sys.executable, "-m", "workers", "keys", "--out", str(keys)], cwd=ROOT, capture_output=True,
                          text=True, env=rank_environment(threads_per_rank=None))
    assert made.returncode == 0, made.stderr
    model = tiny_model_dirs[FAMILY]
    endpoint = free_endpoint()
    rendezvous = ("127.0.0.1", free_port())
    shared = ("--nproc", "1", "--ulysses-degree", "2", "--nnodes", "2", "--rdzv-endpoint", "%s:%d" % rendezvous)
    node0 = start_serve(model, endpoint, *shared, "--node-rank", "0", "--curve-dir", str(keys), log=work / "node0.log")
    join = lambda: start_join(model, *shared, "--node-rank", "1", log=work / "node1.log")  # noqa: E731
    state = {"node1": join()}
    client = PoolClient(endpoint, curve_dir=str(keys))
    client.wait_until_idle(180)
    inputs = tiny_models.make_inputs(FAMILY)
    yield {"client": client, "inputs": inputs, "expected": reference(model, FAMILY, inputs), "join": join,
           "state": state, "work": work, "node0": node0, "rendezvous": rendezvous}
    pids = [pid for node in client.status()["nodes"] for pid in node["pids"]]
    client.stop()  # a client's stop ends every machine's share, and each supervisor with it
    client.close()
    try:
        codes = [node0.wait(30), state["node1"].wait(30)]
    finally:
        stop_serve(node0)
        stop_serve(state["node1"])
    assert codes == [0, 0], (work / "node0.log").read_text()[-3000:]
    assert wait_gone(pids) == [], "ranks outlived their supervisors"


def test_two_nodes_equal_diffusers_and_status_lists_both(two_nodes):
    client = two_nodes["client"]
    status = client.status()
    assert status["state"] == "idle" and status["world_size"] == 2 and status["ranks_alive"] == 2
    assert [(n["node"], n["ranks"], n["alive"]) for n in status["nodes"]] == [(0, [0], True), (1, [1], True)]
    assert all(n["host"] == socket.gethostname() and len(n["pids"]) == 1 for n in status["nodes"])
    latents = client.sample(two_nodes["inputs"], PARAMS)
    assert (latents - two_nodes["expected"]).abs().max().item() <= TOLERANCE


def test_every_listener_is_on_the_rendezvous_address(two_nodes):
    """torchrun's agents host no store (theirs would listen on every interface): node 0's supervisor hosts the
    rendezvous on --rdzv-endpoint's address, and gloo listens on the interface towards it (loopback here)."""
    import psutil

    tree = [p for node in (two_nodes["node0"], two_nodes["state"]["node1"])
            for p in (psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True))]
    listening = [(c.laddr.ip, c.laddr.port, p.pid) for p in tree for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 4, listening  # rendezvous, client endpoint, gloo on each rank
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, listening
    assert (two_nodes["rendezvous"][0], two_nodes["rendezvous"][1], two_nodes["node0"].pid) in listening


def test_losing_node_1_fails_the_job_waits_and_recovers_when_it_joins_again(two_nodes):
    client, state = two_nodes["client"], two_nodes["state"]
    before = client.status()
    rank1 = before["nodes"][1]["pids"][0]
    torchrun1 = parent(rank1)
    seen = []

    def kill_node_1_at_step_three(message):
        seen.append(message)
        if len(seen) == 3:  # the whole machine goes: supervisor, torchrun agent and rank, no goodbyes
            os.killpg(state["node1"].pid, signal.SIGKILL)
            os.kill(torchrun1, signal.SIGKILL)
            os.kill(rank1, signal.SIGKILL)

    with pytest.raises(JobFailed, match=r"lost contact with node 1 \(rank 1 on .*\).*every node is back"):
        client.sample(two_nodes["inputs"], {**PARAMS, "steps": 1000}, on_step=kill_node_1_at_step_three)
    state["node1"].wait(10)
    assert not any(alive(p) for p in (rank1, torchrun1))

    waiting = wait_for_state(client, "waiting for nodes")
    assert [(n["node"], n["alive"]) for n in waiting["nodes"]] == [(0, True), (1, False)]
    assert "node 1" in waiting["restart_reason"]
    with pytest.raises(JobFailed, match="waiting for nodes"):
        client.sample(two_nodes["inputs"], PARAMS)

    state["node1"] = two_nodes["join"]()
    status = client.wait_until_idle(180)
    assert status["restarts"] >= before["restarts"] + 1 and status["ranks_alive"] == 2
    assert status["nodes"][1]["pids"] != [rank1]
    latents = client.sample(two_nodes["inputs"], PARAMS)
    assert (latents - two_nodes["expected"]).abs().max().item() <= TOLERANCE



def test_a_rank_lost_on_node_0_restarts_both_nodes_without_help(two_nodes):
    """Node 0 relaunches its share; node 1's rank loses its peer and its `join` relaunches by itself."""
    client, node1 = two_nodes["client"], two_nodes["state"]["node1"]
    before = client.status()
    os.kill(before["nodes"][0]["pids"][0], signal.SIGKILL)
    deadline = time.monotonic() + 180
    status = before
    while status["restarts"] == before["restarts"] or status["state"] != "idle":
        assert time.monotonic() < deadline, f"the pool did not come back: {status}"
        time.sleep(0.2)
        status = client.wait_until_idle(180)
    assert node1.poll() is None, "node 1's join stopped instead of relaunching its share"
    assert all(n["pids"] != b["pids"] for n, b in zip(status["nodes"], before["nodes"]))
    assert "lost contact with node 0 (rank 0" in (two_nodes["work"] / "node1.log").read_text()
    latents = client.sample(two_nodes["inputs"], PARAMS)
    assert (latents - two_nodes["expected"]).abs().max().item() <= TOLERANCE
