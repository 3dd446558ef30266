"""A headless Chromium page on a real ComfyUI's own frontend, for every test (and script) that drives one: the
browser tests on ComfyUI 0.33 (tests/test_comfyui_browser.py), the compatibility leg on 0.3.64
(tests/test_comfyui_oldest.py) and tests/browser/build_example_workflows.py.

The page is tests/browser/driver.js (playwright-core on the test bed's Chromium), answering JSON lines; what a test
does in the page stays in Python, as the JavaScript snippets below. Saved (UI-format) workflows reach the server only
through the frontend (`app.graphToPrompt()`), so running one here is running it as a user does.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import testbed
from xdit_test_helpers import ROOT


class Browser:
    """tests/browser/driver.js: one headless page on the ComfyUI frontend, answering JSON-line requests."""

    def __init__(self, url: str, log: Path, node: str, node_modules: Path, chromium: Path):
        self.stderr = log.open("wb")
        self.process = subprocess.Popen(
            [node, str(ROOT / "tests" / "browser" / "driver.js"), url, str(chromium)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, env={**os.environ, "NODE_PATH": str(node_modules)}, text=True, bufsize=1,
        )
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.process.stdout, selectors.EVENT_READ)
        ready = self._read(120)
        if not ready.get("ready"):
            raise RuntimeError(f"the browser did not open ComfyUI: {ready.get('error')}")

    def _read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.selector.select(timeout=deadline - time.monotonic()):
                line = self.process.stdout.readline()
                if not line:
                    raise RuntimeError(f"the browser driver exited (rc {self.process.poll()})")
                if line.startswith("{"):
                    return json.loads(line)
        raise TimeoutError(f"the browser driver did not answer in {timeout_s} s")

    def call(self, cmd: str, timeout_s: float = 120, **request):
        self.process.stdin.write(json.dumps({"cmd": cmd, **request}) + "\n")
        reply = self._read(timeout_s)
        if not reply["ok"]:
            raise AssertionError(f"browser {cmd} failed: {reply['error']}")
        return reply["value"]

    def eval(self, js: str, arg=None, timeout_s: float = 120):
        return self.call("eval", timeout_s, js=js, arg=arg)

    def wait(self, js: str, arg=None, timeout_s: float = 60):
        return self.call("wait", timeout_s + 10, js=js, arg=arg, timeout=int(timeout_s * 1000))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.stderr.close()


def open_page(server, log_name: str = "browser.log") -> "Browser | str":
    """A page on `server`'s frontend with `window.api` set, or the reason there is none (no Node.js, playwright-core
    or Chromium: tests/testbed.py installs them)."""
    found = testbed.browser()
    if isinstance(found, str):
        return found
    browser = Browser(server.url, server.work / log_name, *found)
    browser.eval("async () => { window.api = (await import('/scripts/api.js')).api; return true; }")
    return browser


@contextlib.contextmanager
def scratch_page():
    """(server, page): a fresh ComfyUI test-bed server in a temporary folder and a page on it, for the scripts that
    rebuild the example workflows (tests/browser/); one `error:` line where the test bed lacks a part."""
    from comfyui_server import ComfyServer

    comfyui, parts = testbed.comfyui(), testbed.browser()
    for found in (comfyui, parts):
        if isinstance(found, str):
            sys.exit(f"error: {found}")
    with tempfile.TemporaryDirectory() as work:
        server = ComfyServer(*comfyui, Path(work))
        try:
            browser = Browser(server.url, Path(work) / "browser.log", *parts)
            try:
                yield server, browser
            finally:
                browser.close()
        finally:
            server.stop()


# The frontend's Run button: the button itself in ComfyUI 0.33's frontend (1.49), the first button of a group before.
RUN_BUTTON = 'button[data-testid="queue-button"], [data-testid="queue-button"] > button:first-child'

# The layout error the extension shows on the graph's xDiT Pool node ("" when valid).
POOL_ERROR = "() => app.graph.nodes.find((n) => n.comfyClass === 'XDiTPool').xditCheck"  # the server's answer

# Load a saved workflow, convert it, and queue it the way the Run button does (app.queuePrompt, through the
# xDiT validation hook); a spy on api.queuePrompt catches the server's answer for the prompt id.
LOAD_CONVERT_QUEUE = """async (workflow) => {
    await app.loadGraphData(workflow);
    const converted = await app.graphToPrompt();
    const prompt = converted.output;
    const classes = Object.values(prompt).map((node) => node.class_type).sort();
    const original = api.queuePrompt;
    let response = null;
    api.queuePrompt = async (...args) => (response = await original.apply(api, args));
    try {
        await app.queuePrompt(0, 1);
        return { classes, prompt, response };
    } finally {
        api.queuePrompt = original;
    }
}"""

HISTORY = """async (id) => {
    const response = await api.fetchApi(`/history/${id}`);
    const entry = (await response.json())[id];
    const done = entry?.status?.completed !== undefined && ['success', 'error'].includes(entry.status.status_str);
    return done ? entry.status : null;
}"""


def run_workflow(page, workflow: dict, timeout_s: float = 120) -> tuple[dict, dict]:
    """Load a saved workflow in the page, convert it and queue it as the Run button does, and wait for its end:
    (what LOAD_CONVERT_QUEUE answered: the converted node classes and the server's response, the history status)."""
    result = page.eval(LOAD_CONVERT_QUEUE, workflow)
    assert result["response"] and not result["response"].get("node_errors"), json.dumps(result)[-2000:]
    status = page.wait(HISTORY, result["response"]["prompt_id"], timeout_s=timeout_s)
    return result, status
