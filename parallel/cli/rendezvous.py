"""Where ranks meet: torch.distributed's TCPStore, hosted by their launcher (a pool's supervisor, contract E's
`--nproc-per-node` launcher) on one address only.

A TCPStore server listens on every interface (`::`) whatever host it is given, and so do the two stores that
torchrun's agent hosts (its c10d rendezvous, and the one it shares with the ranks); torchrun has no option to bind
them. A store handed a socket already bound (`master_listen_fd`) listens where that socket was bound. So:
- one machine: the supervisor binds 127.0.0.1 and its ranks, which it starts itself (ranks.py), join through it;
- several: node 0's supervisor binds the address of --rdzv-endpoint, where every machine's torchrun agent meets
  (c10d rendezvous, no agent hosting it: `is_host=0`, and no store of their own for the ranks:
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE) and where the ranks then join.
A fresh store per launch, as torchrun's was: nothing of a broken world is left in it.

gloo and NCCL open listeners of their own between ranks; they are told an interface (`network_environment`):
loopback on one machine; on several, the one this machine reaches node 0 through, unless the user named one.
Neither the store nor those listeners are authenticated or encrypted (torch.distributed is not): loopback keeps
other machines out, not other users of this machine.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Store:
    """A TCPStore server on `host`:`port` (0: a free port) and nowhere else."""

    def __init__(self, host: str = LOOPBACK, port: int = 0):
        from torch.distributed import TCPStore

        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # node 0 rebinds its port at each launch
            listener.bind(address)
            listener.listen(socket.SOMAXCONN)
        except OSError as error:
            listener.close()
            raise ValueError(f"cannot host the pool's rendezvous at {host}:{port}: {error.strerror}; on several machines "
                             "--rdzv-endpoint must be an address of node 0 with a free port") from None
        self.host, self.port = host, listener.getsockname()[1]
        self._store = TCPStore(host, self.port, None, True, timedelta(minutes=30), wait_for_workers=False,
                               master_listen_fd=listener.detach())  # the store owns (and closes) the socket now

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop listening; connections its ranks still hold end with them."""
        self._store = None


def one_machine_environments(nproc: int, environment: dict[str, str]) -> list[dict[str, str]]:
    """Each of `nproc` ranks' environment on this machine, as torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE; one OpenMP thread unless chosen), gloo and NCCL told to listen on loopback."""
    base = environment | network_environment() | {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default: ranks would share the cores
    return [{**base, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(nproc)]


def join(address: str, world_size: int):
    """A rank's client of the store its launcher hosts at `address` (HOST:PORT, or [V6]:PORT)."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), world_size, is_master=False, timeout=dist.default_pg_timeout)


def rendezvous_address(endpoint: str) -> tuple[str, int]:
    """--rdzv-endpoint HOST:PORT (or [V6]:PORT) as host and port."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint}: give HOST:PORT, node 0's address and a free port "
                         "(e.g. 192.168.1.10:29400)")
    return host.strip("[]"), int(port)


def interface_towards(host: str) -> str:
    """The name of this machine's interface whose address the kernel would use to reach `host`."""
    import psutil

    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: picks the route and the source address, sends nothing
        local = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    for name, addresses in psutil.net_if_addrs().items():
        if any(_same(a.address, local) for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    raise ValueError(f"no network interface of this machine holds {local}, its address towards {host}; name one with "
                     "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME)")


def _same(text: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        return ipaddress.ip_address(text.split("%")[0]) == address
    except ValueError:
        return False


def network_environment(rendezvous_host: str | None = None) -> dict[str, str]:
    """The interface gloo and NCCL listen on: loopback for a one-machine pool (None), whatever the environment
    says; on several machines the user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else the one towards node 0."""
    if rendezvous_host is None:
        return dict.fromkeys(INTERFACE_VARIABLES, interface_towards(LOOPBACK))
    chosen = {name: os.environ[name] for name in INTERFACE_VARIABLES if os.environ.get(name)}
    if len(chosen) < len(INTERFACE_VARIABLES):
        chosen = dict.fromkeys(INTERFACE_VARIABLES, interface_towards(rendezvous_host)) | chosen
    return chosen
