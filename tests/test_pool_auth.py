"""CURVE keys on the client endpoint: only clients with an allowed key get anything back.

A real pool (one rank, loopback, with keys: keys make it authenticated whatever the address) is
served to clients with the right keys, with no keys, and with a key it does not know; binding
beyond loopback without keys is refused before anything binds. Nothing here listens beyond 127.0.0.1.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
import time
import uuid

import pytest
import zmq

from parallel.loading import tiny_models
from parallel.layout.config import ParallelConfig
from parallel.cli.launch import rank_environment
from workers.wire import protocol
from workers.wire.auth import ClientKeys, create_keys, is_loopback
from workers.client import PoolClient, PoolRefused, PoolUnreachable
from workers.supervisor.pool import PoolSpec
from workers.wire.protocol import Message

from xdit_test_helpers import TOLERANCE, import_node_module
from pool_helpers import PARAMS, ROOT, free_endpoint, reference, start_serve, stop_serve

FAMILY = "sd3"
REFUSAL = "refused a client without an allowed key"


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**rank_environment(), **(env or {})}
    return subprocess.run([sys.executable, "-m", "workers", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    made = cli("keys", "--out", str(root / "pool"))
    assert made.returncode == 0, made.stderr
    create_keys(root / "stranger")
    # a client that knows the pool's server key but holds a keypair the pool never accepted
    (root / "unknown").mkdir()
    shutil.copy(root / "pool" / "server.key", root / "unknown" / "server.key")
    shutil.copy(root / "stranger" / "client.key_secret", root / "unknown" / "client.key_secret")
    return root


@pytest.fixture(scope="module")
def pool(tiny_model_dirs, keys, tmp_path_factory):
    work = tmp_path_factory.mktemp("auth_pool")
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs[FAMILY], endpoint, "--nproc", "1", "--curve-dir", str(keys / "pool"),
                          log=work / "serve.log")
    client = PoolClient(endpoint, curve_dir=str(keys / "pool"))
    client.wait_until_idle(120)
    inputs = tiny_models.make_inputs(FAMILY)
    yield {"endpoint": endpoint, "client": client, "inputs": inputs, "log": work / "serve.log",
           "expected": reference(tiny_model_dirs[FAMILY], FAMILY, inputs)}
    client.close()
    stop_serve(process)
    assert process.returncode == 0, (work / "serve.log").read_text()[-3000:]


def test_keys_are_written_private(keys):
    files = sorted(p.relative_to(keys / "pool").as_posix() for p in (keys / "pool").rglob("*") if p.is_file())
    assert files == ["client.key", "client.key_secret", "clients/client.key", "server.key", "server.key_secret"]
    for path in (keys / "pool").rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    with pytest.raises(ValueError, match="already holds keys"):
        create_keys(keys / "pool")


def test_a_client_with_the_keys_gets_diffusers_results(pool):
    latents = pool["client"].sample(pool["inputs"], PARAMS)
    assert (latents - pool["expected"]).abs().max().item() <= TOLERANCE


def _silence(socket: zmq.Socket, endpoint: str, wait_s: float = 2.0) -> bool:
    """Send a valid status request; True when nothing at all comes back."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send_multipart(protocol.encode(Message("status", f"probe-{uuid.uuid4().hex[:8]}")))
        return not socket.poll(int(wait_s * 1000))
    finally:
        socket.close()


def test_clients_without_an_allowed_key_get_nothing_and_the_pool_logs_them(pool, keys):
    jobs_done = pool["client"].status()["jobs_done"]
    context = zmq.Context.instance()
    assert _silence(context.socket(zmq.DEALER), pool["endpoint"])  # no keys at all
    unknown = context.socket(zmq.DEALER)
    ClientKeys.load(keys / "unknown").apply(unknown)  # right server key, client key not accepted
    assert _silence(unknown, pool["endpoint"])

    with PoolClient(pool["endpoint"], insecure=True) as bare, \
            pytest.raises(PoolRefused, match="requires CURVE keys.*--curve-dir"):
        bare.status(timeout_s=5)
    with PoolClient(pool["endpoint"]) as own, pytest.raises(PoolRefused, match="other keys than your own.*--curve-dir"):
        own.status(timeout_s=5)  # this user's own keys: not the ones this pool was served with
    with PoolClient(pool["endpoint"], curve_dir=str(keys / "unknown")) as stranger, \
            pytest.raises(PoolRefused, match="refused this client's key"):
        stranger.sample(pool["inputs"], PARAMS)

    deadline = time.monotonic() + 10
    while (log := pool["log"].read_text()).count(REFUSAL) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"{REFUSAL} from 127.0.0.1" in log  # the ZAP handler saw the unknown key and its address
    assert f"{REFUSAL} on {pool['endpoint']}: " in log  # the keyless client failed before ZAP
    assert pool["client"].status()["jobs_done"] == jobs_done  # nothing of theirs ran


def test_a_client_that_never_hears_back_times_out_with_a_clear_error():
    import socket

    # Something accepts connections but never answers: the same silence a refused client meets.
    # (Where nothing listens at all, the client says so instead: tests/test_first_hour.py.)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        with PoolClient(endpoint) as client, pytest.raises(PoolUnreachable, match="no reply .* CURVE keys .*--curve-dir"):
            client.status(timeout_s=1)


def test_cli_clients_take_keys_by_flag_or_environment(pool, keys):
    with_flag = cli("status", "--endpoint", pool["endpoint"], "--json", "--curve-dir", str(keys / "pool"))
    assert with_flag.returncode == 0 and '"state": "idle"' in with_flag.stdout, with_flag.stderr
    with_env = cli("status", "--endpoint", pool["endpoint"], env={"XDIT_CURVE_DIR": str(keys / "pool")})
    assert with_env.returncode == 0 and "state: idle" in with_env.stdout


def test_serving_beyond_loopback_without_keys_is_refused_before_binding(tiny_model_dirs):
    port = free_endpoint().rsplit(":", 1)[1]
    run = cli("serve", "--model", str(tiny_model_dirs[FAMILY]), "--endpoint", f"tcp://0.0.0.0:{port}")
    assert run.returncode == 2, run.stderr
    assert "python -m workers keys --out DIR" in run.stderr and "--curve-dir DIR" in run.stderr
    assert "serving" not in run.stdout and "torch.distributed.run" not in run.stderr


@pytest.mark.parametrize("endpoint", ["tcp://*:5599", "tcp://192.168.1.10:5599", "tcp://eth0:5599"])
def test_every_network_endpoint_needs_keys(tiny_model_dirs, endpoint):
    with pytest.raises(ValueError, match=r"python -m workers keys --out DIR.*--curve-dir DIR"):
        PoolSpec(model=str(tiny_model_dirs[FAMILY]), nproc=1, endpoint=endpoint).check()


def test_loopback_is_told_apart_from_the_network():
    local = ["tcp://127.0.0.1:5599", "tcp://127.1.2.3:1", "tcp://localhost:5599", "tcp://[::1]:5599", "ipc:///tmp/x"]
    network = ["tcp://0.0.0.0:5599", "tcp://*:5599", "tcp://10.0.0.2:5599", "tcp://[::]:5599", "tcp://eth0:5599",
               "tcp://myhost:5599"]
    assert all(map(is_loopback, local)) and not any(map(is_loopback, network))


def test_the_node_registry_reaches_a_keyed_pool(pool, keys, monkeypatch):
    """nodes/pools.py (the xDiT Pool node's endpoint mode): every client of the endpoint gets its keys."""
    pools = import_node_module(monkeypatch, "pools")
    registry = pools.PoolRegistry()
    key = PoolSpec(model="remote", nproc=1, parallel=ParallelConfig(), endpoint=pool["endpoint"],
                   curve_dir=str(keys / "pool"))
    handle = registry.acquire(key, timeout_s=30)
    assert handle.status["state"] == "idle"
    latents = registry.client(handle.endpoint).sample(pool["inputs"], PARAMS)
    assert (latents - pool["expected"]).abs().max().item() <= TOLERANCE
    registry.remember(key, handle.endpoint)  # as the node does, for the web panel
    assert registry.describe()[0]["status"]["state"] == "idle"


# -- the owner's own keys (workers/wire/owner_keys.py) and plain TCP behind --insecure-tcp ------------------------
@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh user cache: the owner's key folder is made in it on first use."""
    monkeypatch.delenv("XDIT_CURVE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "xdit-pool" / "keys"


def test_the_owners_keys_are_made_on_first_use_private_and_kept(own_cache):
    from workers.wire import owner_keys

    assert owner_keys.owner_folder() == own_cache
    assert stat.S_IMODE(own_cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(own_cache.parent.stat().st_mode) == 0o700
    server = (own_cache / "server.key_secret").read_bytes()
    ClientKeys.load(own_cache)  # a client finds what the pool serves with
    assert owner_keys.owner_folder() == own_cache and (own_cache / "server.key_secret").read_bytes() == server


def test_two_first_uses_at_once_make_one_set_of_keys(own_cache):
    import threading

    from workers.wire import owner_keys

    barrier, found = threading.Barrier(4), []

    def first_use():
        barrier.wait()
        found.append((owner_keys.owner_folder() / "server.key_secret").read_bytes())

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 4 and len(set(found)) == 1
    assert sorted(p.name for p in own_cache.parent.iterdir()) == ["keys"]  # no staging folder left


def test_a_key_folder_others_can_open_is_refused_in_one_line(own_cache):
    from workers.wire import owner_keys

    owner_keys.owner_folder()
    own_cache.chmod(0o750)
    with pytest.raises(ValueError, match=r"open to group or others \(mode 750\).*chmod 700"):
        owner_keys.owner_folder()
    run = cli("status", "--endpoint", free_endpoint(), env={"XDG_CACHE_HOME": str(own_cache.parent.parent)})
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1 and "chmod 700" in errors[0], run.stderr


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
                    reason="giving the folder to another user needs root")
def test_a_key_folder_of_another_user_is_refused(own_cache):
    import os

    from workers.wire import owner_keys

    owner_keys.owner_folder()
    os.chown(own_cache, 65534, 65534)
    with pytest.raises(ValueError, match=r"belongs to uid 65534, not to you"):
        owner_keys.owner_folder()


def test_plain_tcp_only_behind_its_flag_and_only_on_loopback(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs[FAMILY])
    with pytest.raises(ValueError, match="--insecure-tcp: anyone on the network"):
        PoolSpec(model=model, nproc=1, endpoint="tcp://0.0.0.0:5599", insecure_tcp=True).check()
    with pytest.raises(ValueError, match="drop one of the two"):
        PoolSpec(model=model, nproc=1, endpoint="tcp://127.0.0.1:5599", insecure_tcp=True, curve_dir="k").check()
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs[FAMILY], endpoint, "--nproc", "1", "--insecure-tcp", log=tmp_path / "serve.log")
    try:
        with PoolClient(endpoint, insecure=True) as plain:
            assert plain.wait_until_idle(120)["state"] == "idle"
        assert not _silence(zmq.Context.instance().socket(zmq.DEALER), endpoint)  # anyone is answered
        with PoolClient(endpoint) as own, pytest.raises(PoolRefused, match="--insecure-tcp"):
            own.status(timeout_s=5)
    finally:
        stop_serve(process)
