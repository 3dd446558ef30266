"""Only the owner reaches a pool (issue #39): real pools, real processes, real sockets, a real second user.

Default pools (`serve`, the one-shot `sample --model`, and a managed pool as the ComfyUI nodes start it through
nodes/pools.PoolRegistry), started with no key flags, listen nowhere but loopback and nowhere unauthenticated:
every TCP listener of the pool's processes (read with psutil) is on a loopback address, the control channel is
an ipc:// socket in a folder only the owner may open, and a raw ZMQ client without keys that tries every one of
those ports gets nothing back, while the pool logs the refusal once per reason.

Another Unix user of this machine (`nobody`, by setpriv, so these tests need root, as CI has) cannot submit a job,
read the status, stop the pool, read the owner's keys, open the control socket, or grow rank 0 with a 2 GiB
message; the owner, with no flags at all, does all of it through the CLI. One `serve` pool is shared, in order.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import zmq
from safetensors.torch import load_file, save_file

from parallel.layout.config import ParallelConfig
from parallel.loading import tiny_models
from workers.supervisor import PoolSpec
from workers.wire import owner_keys, protocol
from workers.wire.protocol import Message

from xdit_test_helpers import TOLERANCE, import_node_module
from pool_helpers import PARAMS, ROOT, free_endpoint, idle_client, reference, start_serve, stop_serve

FAMILY = "pixart-alpha"
LAYOUT = ("--nproc", "2", "--ulysses-degree", "2")
NOBODY = 65534
NO_KEYS = ("it offered no CURVE keys", "it hung up inside the handshake")  # which one: who reads the greeting first
SMALL = ["--steps", "4", "--guidance-scale", "4.5", "--height", "64", "--width", "64"]


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m workers ...` as the owner, with nothing about keys in its arguments or environment."""
    env = {k: v for k, v in os.environ.items() if k != "XDIT_CURVE_DIR"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "workers", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def one_error(run: subprocess.CompletedProcess) -> str:
    output = run.stdout + run.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def pool(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("access")
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs[FAMILY], endpoint, *LAYOUT, log=work / "serve.log")
    client, status = idle_client(endpoint)
    inputs = tiny_models.make_inputs(FAMILY)
    save_file(inputs, work / "in.safetensors")
    yield {"endpoint": endpoint, "client": client, "process": process, "log": work / "serve.log", "work": work,
           "inputs": inputs, "expected": reference(tiny_model_dirs[FAMILY], FAMILY, inputs)}
    client.close()
    stop_serve(process)


# -- what a pool's processes listen on ----------------------------------------------------------------------------
def listeners(pids: list[int]) -> tuple[list[tuple[str, int]], list[str]]:
    """Every listening TCP (address, port) and Unix socket path of these processes."""
    tcp, unix = [], []
    for pid in pids:
        for connection in psutil.Process(pid).net_connections(kind="all"):
            if connection.family == socket.AF_UNIX:
                if connection.laddr and not connection.raddr and connection.status == psutil.CONN_NONE:
                    unix.append(connection.laddr)
            elif connection.status == psutil.CONN_LISTEN:
                tcp.append((connection.laddr.ip, connection.laddr.port))
    return tcp, unix


def replies_without_keys(addresses: list[tuple[str, int]], wait_s: float = 2.0) -> list[tuple[str, int]]:
    """A raw ZMQ client without keys sends a valid status request to every address; the ones that answered."""
    context = zmq.Context.instance()
    sockets = {}
    for host, port in addresses:
        probe = context.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        probe.send_multipart(protocol.encode(Message("status", "probe")), flags=zmq.NOBLOCK)
        sockets[host, port] = probe
    poller = zmq.Poller()
    for probe in sockets.values():
        poller.register(probe, zmq.POLLIN)
    answered, deadline = set(), time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(left * 1000)))
        answered |= {address for address, probe in sockets.items() if probe in ready}
    for probe in sockets.values():
        probe.close()
    return sorted(answered)


def refusals(log: Path, *reasons: str, timeout_s: float = 10.0) -> list[str]:
    """The pool's log lines refusing a client for one of `reasons`, once at least one came."""
    deadline = time.monotonic() + timeout_s
    while not (found := [line for line in log.read_text(errors="replace").splitlines()
                         if "refused a client without an allowed key" in line and any(r in line for r in reasons)]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return found


def assert_only_the_owner_can_listen(pids: list[int], log: Path) -> int:
    """Everything the pool listens on is private (see the module); the client endpoint's port."""
    tcp, unix = listeners(pids)
    assert len(tcp) >= 3, tcp  # the client endpoint, the ranks' store, gloo between the ranks
    assert all(ipaddress.ip_address(host).is_loopback for host, _ in tcp), f"listening beyond loopback: {tcp}"
    assert unix, "no control socket found"
    for path in set(unix):
        folder = Path(path).parent.stat()
        assert folder.st_uid == os.getuid() and stat.S_IMODE(folder.st_mode) == 0o700, (path, oct(folder.st_mode))
    assert replies_without_keys(tcp) == []
    lines = refusals(log, *NO_KEYS)
    assert lines and all(sum(reason in line for line in lines) <= 1 for reason in NO_KEYS), lines  # once per reason
    return int(re.search(r"on tcp://127\.0\.0\.1:(\d+)", lines[0]).group(1))


def test_serve_listens_on_loopback_only_and_answers_no_client_without_keys(pool):
    status = pool["client"].status()
    port = assert_only_the_owner_can_listen([pool["process"].pid, *status["pids"]], pool["log"])
    assert pool["endpoint"].endswith(f":{port}")
    after = pool["client"].status()
    assert after["state"] == "idle" and after["restarts"] == 0  # probing the store and gloo ports broke nothing
    assert (pool["client"].sample(pool["inputs"], PARAMS) - pool["expected"]).abs().max().item() <= TOLERANCE


def test_a_one_shot_sample_pool_listens_on_loopback_only_and_a_failed_job_exits_1(tiny_model_dirs, pool):
    output = pool["work"] / "one-shot.safetensors"
    run = subprocess.Popen(
        [sys.executable, "-m", "workers", "sample", "--model", str(tiny_model_dirs[FAMILY]), *LAYOUT,
         "--threads-per-rank", "1", "--inputs", str(pool["work"] / "in.safetensors"), "--output", str(output),
         *SMALL, "--steps", "1000"],  # the last --steps counts: a job that lasts while its pool is looked at
        cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    log = Path(tempfile.gettempdir()) / f"xdit-sample-{run.pid}.log"  # the ranks' output (pool_commands.sample)
    try:
        for line in run.stderr:  # the job runs: its pool is up
            if line.startswith("step 1/"):
                break
        ranks = [child.pid for child in psutil.Process(run.pid).children()]
        assert_only_the_owner_can_listen([run.pid, *ranks], log)
        os.kill(ranks[1], signal.SIGKILL)  # the job fails: not the user's mistake, and no signal of the command's own
        _, rest = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
        log.unlink(missing_ok=True)
    assert run.returncode == 1
    assert re.search(r"^error: rank \d \(pid \d+\) died", rest, re.M), rest[-2000:]


def test_a_managed_pool_as_comfyui_starts_it_listens_on_loopback_only(tiny_model_dirs, tmp_path, monkeypatch):
    registry = import_node_module(monkeypatch, "pools").PoolRegistry()
    log = tmp_path / "managed.log"
    key = PoolSpec(model=str(tiny_model_dirs[FAMILY]), nproc=2, endpoint=None, parallel=ParallelConfig(ulysses_degree=2),
                   threads_per_rank=1, log_file=str(log))
    try:
        handle = registry.acquire(key, timeout_s=300)
        assert_only_the_owner_can_listen([os.getpid(), *handle.status["pids"]], log)
        assert registry.client(handle.endpoint).status()["state"] == "idle"
    finally:
        registry.stop_all()


def test_gloo_and_nccl_are_told_loopback_on_one_machine_and_the_way_to_node_0_on_several(monkeypatch):
    from parallel.cli.rendezvous import network_environment, rendezvous_address

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert network_environment() == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}  # whatever is set
    assert network_environment("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "eth9", "NCCL_SOCKET_IFNAME": "lo"}
    assert network_environment("::1")["NCCL_SOCKET_IFNAME"] == "lo"
    assert rendezvous_address("[::1]:29400") == ("::1", 29400)
    with pytest.raises(ValueError, match="give HOST:PORT"):
        rendezvous_address("192.168.1.10")


# -- another user of this machine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_user():
    """A home of its own for `nobody`, and a way to run this Python as it."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root (setpriv); run as root, as CI does")
    home = Path(tempfile.mkdtemp(prefix="xdit-nobody-"))
    os.chown(home, NOBODY, NOBODY)

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {"HOME": str(home), "PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                               *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    works = run("-c", "import zmq, workers.cli")
    if works.returncode != 0:
        pytest.skip(f"user nobody cannot run this Python from {ROOT}: {works.stderr.strip()[-300:]}")
    yield {"run": run, "home": home}
    shutil.rmtree(home, ignore_errors=True)


def test_another_user_cannot_submit_read_the_status_or_stop_the_pool(pool, other_user):
    before = pool["client"].status()
    inputs = other_user["home"] / "in.safetensors"
    shutil.copy(pool["work"] / "in.safetensors", inputs)
    os.chown(inputs, NOBODY, NOBODY)
    endpoint = pool["endpoint"]
    for command in (["status", "--endpoint", endpoint], ["stop", "--endpoint", endpoint],
                    ["sample", "--endpoint", endpoint, "--inputs", str(inputs), "--output",
                     str(other_user["home"] / "out.safetensors"), *SMALL]):
        run = other_user["run"]("-m", "workers", *command)
        assert run.returncode == 1, (command, run.stdout, run.stderr[-2000:])
        assert "refused this client: it serves other keys than your own" in one_error(run), command
    assert not (other_user["home"] / "out.safetensors").exists()
    assert refusals(pool["log"], "it used another server key")  # and the pool said so
    after = pool["client"].status()
    assert (after["state"], after["restarts"], after["jobs_done"]) == ("idle", 0, before["jobs_done"])


def test_another_user_can_open_neither_the_owners_keys_nor_the_control_socket(pool, other_user):
    stolen = other_user["run"]("-m", "workers", "status", "--endpoint", pool["endpoint"], "--curve-dir",
                               str(owner_keys.owner_folder()))
    assert stolen.returncode == 2 and "permission denied" in one_error(stolen)
    _, unix = listeners([pool["process"].pid])
    control = other_user["run"]("-m", "workers", "status", "--endpoint", f"ipc://{unix[0]}")
    assert control.returncode == 1
    assert "permission denied opening ipc://" in one_error(control)


BIG_MESSAGE = """
import sys, time, zmq
from workers.client import PoolClient
from workers.wire import owner_keys
from workers.wire.auth import ClientKeys
endpoint = sys.argv[1]
context = zmq.Context.instance()
part = zmq.Frame(b"\\0" * (2 << 20))  # one 2 MiB buffer, sent 1,000 times without a copy
sockets = []
for keys in (None, ClientKeys.load(owner_keys.owner_folder())):  # no keys; this user's own
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    if keys:
        keys.apply(socket)
    socket.connect(endpoint)
    socket.send_multipart([part] * 1000, copy=False)  # 2 GiB in one message
    sockets.append(socket)
end = time.monotonic() + 3
while time.monotonic() < end:  # the flood of a client that never reads
    for socket in sockets:
        try:
            socket.send(b"status", flags=zmq.NOBLOCK)
        except zmq.Again:  # the refused handshake took the pipe away: nothing to queue on
            pass
    time.sleep(0.001)
print("replies:", sum(socket.poll(500) for socket in sockets))
"""


def test_another_users_2_gib_message_and_flood_stop_at_the_handshake(pool, other_user):
    rank0 = psutil.Process(pool["client"].status()["pids"][0])
    before = rank0.memory_info().rss
    run = other_user["run"]("-c", BIG_MESSAGE, pool["endpoint"])
    assert run.returncode == 0 and "replies: 0" in run.stdout, run.stderr[-3000:]
    grown = rank0.memory_info().rss - before
    assert grown < 100 * 2**20, f"rank 0 grew by {grown / 2**20:.0f} MiB"
    assert pool["client"].status()["state"] == "idle"


def test_the_owner_with_no_flags_reaches_the_pool_and_stops_it(pool):
    """Contract P's command lines as they are: serve, then sample, status and stop at the endpoint, no key flags."""
    status = cli("status", "--endpoint", pool["endpoint"], "--json")
    assert status.returncode == 0 and '"state": "idle"' in status.stdout, status.stderr[-2000:]
    output = pool["work"] / "owner.safetensors"
    sample = cli("sample", "--endpoint", pool["endpoint"], "--inputs", str(pool["work"] / "in.safetensors"),
                 "--output", str(output), *SMALL)
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert (load_file(output)["latents"] - pool["expected"]).abs().max().item() <= TOLERANCE
    stop = cli("stop", "--endpoint", pool["endpoint"])
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert pool["process"].wait(30) == 0
