"""Free loopback ports and endpoints for pools started on this machine (the CLI, ComfyUI, benches, tests)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_endpoint() -> str:
    """A ZeroMQ endpoint on a free loopback port."""
    return f"tcp://127.0.0.1:{free_port()}"
