"""A real ComfyUI server with this pack installed, for integration tests.

ComfyUI and its python come from the test bed (tests/testbed.py). The pack is linked into a fresh
custom_nodes folder given to ComfyUI through --extra-model-paths-config, with a fresh models and
output folder, so nothing of the test bed's own state is touched. The custom nodes of tests/comfyui_probe, loaded
just before and just after the pack, let a test see what loading the pack did to ComfyUI's interpreter; its test
nodes (xdit_test_nodes.py), loaded last, stand in for ComfyUI's multi-billion-parameter text encoders.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from workers.wire.endpoints import free_port
from xdit_test_helpers import ROOT

PROBE = Path(__file__).resolve().parent / "comfyui_probe"


class ComfyServer:
    def __init__(self, comfy: Path, python: Path, work: Path, args: tuple[str, ...] = ()):
        self.work, self.comfy, self.python = work, comfy, python
        for name in ("probe_before", "custom_nodes", "probe_after", "test_nodes", "models/diffusers", "models/diffusion_models", "models/loras", "models/vae",
                     "models/checkpoints",
                     "input", "output", "user/default"):
            (work / name).mkdir(parents=True, exist_ok=True)
        if (comfy / "input" / "example.png").is_file():  # what a fresh install's input folder holds
            shutil.copy(comfy / "input" / "example.png", work / "input")
        for when in ("before", "after"):
            (work / f"probe_{when}" / f"xdit_probe_{when}.py").symlink_to(PROBE / f"xdit_probe_{when}.py")
        (work / "test_nodes" / "xdit_test_nodes.py").symlink_to(PROBE / "xdit_test_nodes.py")
        (work / "custom_nodes" / "comfyui-xdit-pool").symlink_to(ROOT)
        (work / "extra.yaml").write_text(  # custom_nodes folders load in this order
            f"xdit:\n  base_path: {work}\n  custom_nodes: \"probe_before\\ncustom_nodes\\nprobe_after\\ntest_nodes\"\n"
            "  diffusers: models/diffusers\n  diffusion_models: models/diffusion_models\n  loras: models/loras\n"
            "  vae: models/vae\n  checkpoints: models/checkpoints\n"
        )
        (work / "user" / "default" / "comfy.settings.json").write_text(json.dumps({"Comfy.TutorialCompleted": True}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "server.log"
        command = [
            str(python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port), "--disable-auto-launch",
            "--extra-model-paths-config", str(work / "extra.yaml"), "--cache-none", "--database-url", "sqlite:///:memory:",
            "--input-directory", str(work / "input"), "--output-directory", str(work / "output"),
            "--user-directory", str(work / "user"), *args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(command, cwd=comfy, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.get("/object_info/SaveLatent")
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ComfyUI did not start:\n{self.log.read_text()[-3000:]}")
                time.sleep(0.3)

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict | None = None):
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
            return json.loads(text) if text else None

    def queue(self, prompt: dict, client_id: str | None = None) -> str:
        return self.post("/prompt", {"prompt": prompt, "client_id": client_id or uuid.uuid4().hex})["prompt_id"]

    def run_watching(self, prompt: dict, timeout_s: float = 300) -> tuple[str, list[int], int, str]:
        """Queue `prompt` while listening on the websocket: (prompt id, progress values, binary
        preview frames, the final event type)."""
        import websocket

        client_id = uuid.uuid4().hex
        ws = websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={client_id}", timeout=timeout_s)
        try:
            prompt_id = self.queue(prompt, client_id)
            progress, previews = [], 0
            while True:
                message = ws.recv()
                if isinstance(message, bytes):
                    previews += 1
                    continue
                event = json.loads(message)
                if event["data"].get("prompt_id") != prompt_id:
                    continue
                if event["type"] == "progress":
                    progress.append(event["data"]["value"])
                if event["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                    return prompt_id, progress, previews, event["type"]
        finally:
            ws.close()

    def wait(self, prompt_id: str, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"].get("status_str") in ("success", "error"):
                    return entry
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout_s} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
