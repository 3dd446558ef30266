"""Live pool events for the web panel (PromptServer.send_sync → `xdit.pool` in JS)."""

from __future__ import annotations

import time

_last_sent: dict[str, float] = {}


def publish(event: str, data: dict) -> None:
    try:
        from server import PromptServer
    except ImportError:  # outside ComfyUI (unit tests)
        return
    if PromptServer.instance is not None:
        PromptServer.instance.send_sync(event, data)


def publish_step(pool, step: int, total: int) -> None:
    """The pool's current step, at most ~10 times a second (and always the last step)."""
    now = time.monotonic()
    if step < total and now - _last_sent.get(pool.endpoint, 0.0) < 0.1:
        return
    _last_sent[pool.endpoint] = now
    publish("xdit.pool.step", {"endpoint": pool.endpoint, "step": step, "total": total})
