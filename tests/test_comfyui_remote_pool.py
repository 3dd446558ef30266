"""The xDiT Pool node reaching a pool served elsewhere with CURVE keys (`endpoint` + `curve_dir`).

A real ComfyUI server runs a workflow whose xDiT Pool node points at a `python -m workers serve`
pool with keys (loopback here; keys make it authenticated whatever the address). With the client
keys the result equals diffusers' single-process pipeline; without them (the node then uses the user's own
keys, which this pool was not served with) the node fails with an error that says what is missing. Skipped without the ComfyUI test bed, like tests/test_comfyui.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from pool_helpers import free_endpoint, start_serve, stop_serve
from test_comfyui import reference, saved_latent, workflow
from workers.wire.auth import create_keys
from workers.client import PoolClient
from xdit_test_helpers import TOLERANCE

FAMILY = "pixart-alpha"


@pytest.fixture(scope="module")
def keyed_pool(comfyui_install, tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("remote_pool")
    create_keys(work / "keys")
    client_keys = work / "client-keys"  # what a client machine holds: the server's public key and its own keypair
    client_keys.mkdir()
    for name in ("server.key", "client.key_secret"):
        shutil.copy(work / "keys" / name, client_keys / name)
    endpoint = free_endpoint()
    process = start_serve(tiny_model_dirs[FAMILY], endpoint, "--nproc", "1", "--text-encoders",
                          "--curve-dir", str(work / "keys"), log=work / "serve.log")
    with PoolClient(endpoint, curve_dir=str(client_keys)) as client:
        client.wait_until_idle(120)
    yield {"endpoint": endpoint, "client_keys": str(client_keys)}
    stop_serve(process)


def remote_workflow(endpoint: str, curve_dir: str) -> dict:
    prompt = workflow(FAMILY, nproc=1, ulysses=1, prefix="remote")
    prompt["1"]["inputs"].update(endpoint=endpoint, curve_dir=curve_dir)
    return prompt


def test_the_pool_node_with_keys_equals_diffusers(comfy, keyed_pool, tiny_model_dirs):
    entry = comfy.wait(comfy.queue(remote_workflow(keyed_pool["endpoint"], keyed_pool["client_keys"])))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    expected = reference(tiny_model_dirs[FAMILY], FAMILY)
    assert (saved_latent(comfy, entry) - expected).abs().max().item() <= TOLERANCE


def test_the_pool_node_without_keys_says_what_is_missing(comfy, keyed_pool):
    entry = comfy.wait(comfy.queue(remote_workflow(keyed_pool["endpoint"], "")), 120)
    assert entry["status"]["status_str"] == "error"
    errors = json.dumps([m for m in entry["status"]["messages"] if m[0] == "execution_error"])
    assert "other keys than your own" in errors and "curve-dir" in errors  # the user's own keys are not the pool's
