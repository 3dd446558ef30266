"""CURVE authentication for every pool endpoint, loopback included (loopback is every local user's too).

A pool's keys are a server keypair and the public keys of the clients it accepts. Without `--curve-dir` a pool
and its clients use the owner's own folder (owner_keys.py), so the owner sets nothing up; beyond loopback the
folder must be named (its keys are then copied to other machines). `python -m workers keys --out DIR` writes
them (0600):

    DIR/server.key          server public key   (clients need it)
    DIR/server.key_secret   server keypair      (only the pool)
    DIR/client.key          client public key
    DIR/client.key_secret   client keypair      (clients need it)
    DIR/clients/*.key       public keys the pool accepts (client.key; add more by dropping files here)

The pool's client-facing sockets (rank 0's ROUTER, the supervisor's stand-in) run in CURVE server
mode behind a ZAP handler that accepts only the keys in DIR/clients (read on every handshake, so a
key added there works without a restart). A refused client gets no reply at all; the pool logs it.
Only `--insecure-tcp` serves a plain endpoint, and only on loopback.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("xdit.auth")
ENV = "XDIT_CURVE_DIR"
SERVER, CLIENT, CLIENTS = "server", "client", "clients"
HOW_TO_CREATE = "create keys with `python -m workers keys --out DIR`, then pass `--curve-dir DIR`"
REFUSAL_LOG_EVERY_S = 5.0  # a refused client reconnects every 100 ms; one line per reason is enough
HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def create_keys(out: str | os.PathLike) -> list[Path]:
    """Write a server keypair, a client keypair and the accepted-clients folder, all private (0600)."""
    out = Path(out)
    if (out / f"{SERVER}.key_secret").exists():
        raise ValueError(f"{out} already holds keys; pick another --out or delete {out / (SERVER + '.key_secret')}")
    (out / CLIENTS).mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        written = [Path(p) for p in zmq.auth.create_certificates(out, SERVER)]
        client_public, client_secret = (Path(p) for p in zmq.auth.create_certificates(out, CLIENT))
        accepted = out / CLIENTS / client_public.name
        accepted.write_bytes(client_public.read_bytes())
        written += [client_public, client_secret, accepted]
    finally:
        os.umask(old)
    for path in written:
        path.chmod(0o600)
    for folder in (out, out / CLIENTS):
        folder.chmod(0o700)
    return written


def is_loopback(endpoint: str) -> bool:
    """True for tcp://127.x / localhost / [::1] and for ipc:// and inproc://; anything else reaches a network."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]").split(";")[-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: not provably loopback
        return False


def check_endpoint(endpoint: str, curve_dir: str | None, insecure: bool = False) -> None:
    """Refuse (before any bind) to serve a non-loopback endpoint without named keys, or any plainly but on loopback."""
    if insecure and curve_dir is not None:
        raise ValueError("--insecure-tcp serves without keys, --curve-dir with them: drop one of the two")
    if insecure and not is_loopback(endpoint):
        raise ValueError(f"refusing to serve {endpoint} with --insecure-tcp: anyone on the network could use the pool. "
                         f"To serve beyond this machine, {HOW_TO_CREATE}; or bind tcp://127.0.0.1:PORT.")
    if curve_dir is None and not is_loopback(endpoint):
        raise ValueError(
            f"refusing to serve {endpoint} without authentication: anyone on the network could use the pool. "
            f"To serve beyond this machine, {HOW_TO_CREATE} to serve (clients need DIR/server.key and "
            "DIR/client.key_secret); or bind tcp://127.0.0.1:PORT."
        )


def _read(directory: Path, name: str) -> tuple[bytes, bytes | None]:
    if not zmq.has("curve"):
        raise ValueError(f"this pyzmq (libzmq {zmq.zmq_version()}) was built without CURVE; install the pyzmq wheel from PyPI")
    path = directory / name
    try:
        if not path.is_file():
            raise ValueError(f"no {path}: {HOW_TO_CREATE}")
        return zmq.auth.load_certificate(path)
    except PermissionError:
        raise ValueError(f"cannot read {path}: permission denied (the keys of another user?); use keys of your own "
                         "(give no --curve-dir for yours)") from None


def _read_pair(directory: Path, name: str) -> tuple[bytes, bytes]:
    """A keypair file (`<name>.key_secret`): its public and its secret key."""
    public, secret = _read(directory, f"{name}.key_secret")
    if not secret:
        raise ValueError(f"{directory / (name + '.key_secret')} holds no secret key: {HOW_TO_CREATE}")
    return public, secret


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    clients: Path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ServerKeys":
        directory = Path(directory).expanduser()
        public, secret = _read_pair(directory, SERVER)
        if not (directory / CLIENTS).is_dir():
            raise ValueError(f"no {directory / CLIENTS} folder of accepted client keys: {HOW_TO_CREATE}")
        return cls(public, secret, directory / CLIENTS)


@dataclass(frozen=True)
class ClientKeys:
    server: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ClientKeys":
        directory = Path(directory).expanduser()
        server, _ = _read(directory, f"{SERVER}.key")
        public, secret = _read_pair(directory, CLIENT)
        return cls(server, public, secret)

    def apply(self, socket: zmq.Socket) -> None:
        """Before connect: this socket speaks CURVE with the client keypair and trusts only the server key."""
        socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = self.secret, self.public, self.server


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, remembering each request's peer address so a refusal can name it."""

    address = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)


class ServerGuard:
    """CURVE server mode for one context's client-facing sockets, plus the ZAP handler and refusal logs.

    One per ZMQ context (the ZAP handler is per context); `secure()` each socket before it binds, and
    poll the monitor socket it returns from the thread that owns the socket, passing events to
    `on_monitor()`: clients that fail before ZAP (no keys, wrong server key) only show up there, some of
    them only as a connection closed inside the handshake (a keyless client that sees the server's CURVE
    greeting first hangs up before the server reads its own).
    """

    def __init__(self, context: zmq.Context, keys: ServerKeys):
        self.keys = keys
        self._last_logged: dict[str, float] = {}
        self._auth = _Authenticator(context, log=logging.getLogger("xdit.auth.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        try:
            allowed = client_key in zmq.auth.load_certificates(self.keys.clients)
        except (OSError, ValueError) as error:  # the folder went away: refuse, and say why
            log.error("cannot read the accepted client keys in %s: %s", self.keys.clients, error)
            allowed = False
        if not allowed:
            self._refused(f"from {self._auth.address}: its key is not in {self.keys.clients}")
        return allowed

    def secure(self, socket: zmq.Socket) -> zmq.Socket:
        socket.curve_secretkey, socket.curve_publickey = self.keys.secret, self.keys.public
        socket.curve_server = True
        return socket.get_monitor_socket(HANDSHAKE_FAILURES & ~zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # ZAP's: callback()

    def on_monitor(self, monitor: zmq.Socket) -> None:
        event = recv_monitor_message(monitor)
        endpoint = event["endpoint"].decode(errors="replace")
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            why = ("it offered nothing within the handshake's time limit" if event["value"] == errno.EAGAIN else
                   "it hung up inside the handshake (no CURVE keys, or another server key)")
        else:
            why = {zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "it offered no CURVE keys",
                   zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "it used another server key"}.get(
                       event["value"], f"its handshake broke the protocol (ZMTP error {event['value']:#x})")
        self._refused(f"on {endpoint}: {why} (ZMQ does not report its address before authentication)")

    def _refused(self, detail: str) -> None:
        now = time.monotonic()
        if now - self._last_logged.get(detail, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
            self._last_logged[detail] = now
            log.warning("refused a client without an allowed key %s", detail)

    def stop(self) -> None:
        self._auth.stop()


def release(socket: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Close a socket and the monitor socket that secure() gave it."""
    if monitor is not None:
        socket.disable_monitor()
        monitor.close(linger=0)
    socket.close(linger=0)
