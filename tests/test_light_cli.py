"""`python -m workers status` and `stop` import neither torch nor diffusers: asking a pool how it is must not cost
a model library's import (seconds on a loaded box). The commands run for real against a real pool elsewhere
(tests/test_pool.py); here, in a fresh interpreter, what they import while a socket answers them as rank 0 does
(the real codec both ways: the request encoded and sent, the typed reply decoded and printed), over CURVE with the
owner's own keys as every pool speaks it."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import zmq

from workers.wire import owner_keys, protocol
from workers.wire.auth import ServerGuard, ServerKeys, release
from workers.wire.endpoints import free_endpoint
from workers.wire.messages import PoolStatus, StatusQuery, Stopping
from xdit_test_helpers import ROOT

HEAVY = ("torch", "diffusers", "transformers")


def modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}}))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return set(eval(run.stdout.strip().splitlines()[-1]))


def _answer_one(router) -> None:
    """One request answered as rank 0's server answers it."""
    client, *frames = router.recv_multipart(copy=False)
    request = protocol.decode(frames)
    reply = PoolStatus(state="idle", world_size=2) if isinstance(request.body, StatusQuery) else Stopping()
    router.send_multipart([client.bytes, *protocol.encode(protocol.Message.of(reply, request.job))])


@pytest.mark.parametrize("command", ["status", "stop"])
def test_status_and_stop_import_no_model_library(command):
    endpoint = free_endpoint()
    with zmq.Context() as context:
        router = context.socket(zmq.ROUTER)
        guard = ServerGuard(context, ServerKeys.load(owner_keys.owner_folder()))
        monitor = guard.secure(router)
        try:
            router.bind(endpoint)
            answering = threading.Thread(target=_answer_one, args=(router,), daemon=True)
            answering.start()
            code = f"from workers.cli import main\nassert main([{command!r}, '--endpoint', {endpoint!r}]) == 0"
            assert not modules_after(code) & set(HEAVY)
            answering.join(timeout=5)
            assert not answering.is_alive()
        finally:
            release(router, monitor)
            guard.stop()


def test_the_negative_control_sample_does_import_them():
    """What the test above would catch: the commands that run jobs read the engine, torch included."""
    assert "torch" in modules_after("from workers.cli import build_parser\nbuild_parser()")
