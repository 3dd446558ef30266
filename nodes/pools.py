"""The pools this ComfyUI process knows: started here (managed) or reached at an endpoint.

One pool per PoolSpec (model, layout, options; the same structure the pool CLI builds): a second xDiT Pool
node with the same settings reuses it. A managed pool's spec is its key without an endpoint (one is chosen
when it starts); a pool reached at an endpoint is keyed by a spec naming that endpoint.
Managed pools are stopped when ComfyUI exits (atexit; and the ranks' parent-death signal covers a
killed ComfyUI). Every node and route gets its own PoolClient per thread (ZMQ sockets are not
thread-safe). Every pool speaks CURVE (workers/wire/auth.py): managed pools and their clients use this user's
own keys (workers/wire/owner_keys.py) with nothing to set; a pool reached at an endpoint uses the node's key
folder when it names one, and the registry remembers each endpoint's folder, so every client of it uses it.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..parallel.fields import to_plain
from ..parallel.loading import builtin_models
from ..parallel.request import LoraSpec
from ..workers.client import PoolClient, PoolUnreachable
from ..workers.supervisor import Pool, PoolSpec
from ..workers.wire.endpoints import free_endpoint
from ..workers.wire.messages import PoolStatus

TINY_PREFIX = builtin_models.PREFIX
TINY_MODELS = [f"{name} (built-in, no download)" for name in builtin_models.NAMES]
tiny_model_dir = builtin_models.builtin_model_dir


def label(key: PoolSpec) -> str:
    where = key.endpoint or f"{key.nproc} rank(s)"
    return f"{Path(key.model).name or key.model} · {key.describe_layout()} · {where}"


@dataclass
class PoolHandle:
    """What flows along an XDIT_POOL connection."""

    key: PoolSpec
    endpoint: str
    status: PoolStatus
    loras: tuple[LoraSpec, ...] = ()  # applied on every rank per job
    cache: dict = field(default_factory=dict)  # the step cache each job asks for (CacheSettings.to_params)

    def with_lora(self, path: str, strength: float, expert: str = "") -> "PoolHandle":
        return replace(self, loras=self.loras + (LoraSpec(path, strength, expert),))

    def lora_params(self) -> list[dict]:
        """The LoRAs as a job's `loras` carry them."""
        return to_plain(self.loras)

    def with_cache(self, cache: dict) -> "PoolHandle":
        return replace(self, cache=cache)

    @property
    def pipeline(self) -> str:
        return self.status.pipeline or "?"

    @property
    def latent_scale(self) -> int:
        return self.status.latent_scale or 8  # 8: a status from before the model loaded


class PoolRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._pools: dict[PoolSpec, Pool] = {}
        self._endpoints: dict[PoolSpec, str] = {}
        self._curve_dirs: dict[str, str | None] = {}  # endpoint -> key folder of its clients
        self._local = threading.local()

    def acquire(self, key: PoolSpec, timeout_s: float = 1800) -> PoolHandle:
        """The running pool for `key`, started (and waited for) if needed."""
        if key.endpoint:
            endpoint = key.endpoint
            self._curve_dirs[endpoint] = key.curve_dir  # None: this user's own keys
        else:
            with self._lock:
                pool = self._pools.get(key)
                if pool is None or not pool.running:
                    endpoint = free_endpoint()
                    pool = self._pools[key] = Pool(replace(key, endpoint=endpoint))
                    self._endpoints[key] = endpoint
                    pool.start(timeout_s)
                endpoint = self._endpoints[key]
        status = self.client(endpoint).wait_until_idle(timeout_s)
        return PoolHandle(key, endpoint, status)

    def client(self, endpoint: str) -> PoolClient:
        clients = self._local.__dict__.setdefault("clients", {})
        curve_dir = self._curve_dirs.get(endpoint)
        if (endpoint, curve_dir) not in clients:
            clients[endpoint, curve_dir] = PoolClient(endpoint, curve_dir=curve_dir)
        return clients[endpoint, curve_dir]

    def fingerprint(self, key: PoolSpec) -> str:
        """Changes when the pool for `key` is gone, so ComfyUI re-runs the xDiT Pool node."""
        pool = self._pools.get(key)
        return f"{id(pool)}-{pool.running}" if pool is not None else "none"

    def describe(self) -> list[dict]:
        """Every known pool with its live status, for the web panel."""
        rows = []
        with self._lock:
            items = list(self._endpoints.items())
        for key, endpoint in items:
            pool = self._pools.get(key)
            try:
                status = (self.client(endpoint).status(timeout_s=2.0).params() if pool is None or pool.running
                          else {"state": "stopped"})
            except PoolUnreachable:
                status = {"state": "unreachable"}
            rows.append({"id": self.pool_id(key), "label": label(key), "endpoint": endpoint, "managed": pool is not None,
                         "key": asdict(key), "status": status})
        return rows

    def remember(self, key: PoolSpec, endpoint: str) -> None:
        """Show a pool reached by endpoint in the panel too."""
        with self._lock:
            self._endpoints.setdefault(key, endpoint)

    @staticmethod
    def pool_id(key: PoolSpec) -> str:
        return f"{abs(hash(key)):x}"

    def find(self, pool_id: str) -> PoolSpec | None:
        with self._lock:
            return next((k for k in self._endpoints if self.pool_id(k) == pool_id), None)

    def stop(self, key: PoolSpec) -> None:
        pool = self._pools.get(key)
        if pool is not None:
            pool.stop()
        else:
            self.client(self._endpoints[key]).stop()

    def restart(self, key: PoolSpec) -> PoolHandle:
        self.stop(key)
        return self.acquire(key)

    def stop_all(self) -> None:
        for pool in list(self._pools.values()):
            pool.stop()


POOLS = PoolRegistry()
atexit.register(POOLS.stop_all)
