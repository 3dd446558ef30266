"""The pools this ComfyUI process knows: started here (managed) or reached at an endpoint.

One pool per (model, layout, options): a second xDiT Pool node with the same settings reuses it.
Managed pools are stopped when ComfyUI exits (atexit; and the ranks' parent-death signal covers a
killed ComfyUI). Every node and route gets its own PoolClient per thread (ZMQ sockets are not
thread-safe). A pool reached at an endpoint may need CURVE keys (workers/auth.py): the registry
remembers each endpoint's key folder, so every client of that endpoint uses it.
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..parallel import builtin_models
from ..parallel.config import AutoLayout, ParallelConfig
from ..workers.auth import ENV as CURVE_ENV
from ..workers.client import PoolClient, PoolUnreachable
from ..workers.endpoints import free_endpoint
from ..workers.launcher import Pool, PoolSpec

TINY_PREFIX = builtin_models.PREFIX
TINY_MODELS = [f"{name} (built-in, no download)" for name in builtin_models.NAMES]
tiny_model_dir = builtin_models.builtin_model_dir


@dataclass(frozen=True)
class PoolKey:
    model: str
    nproc: int
    parallel: ParallelConfig
    vae: str | None = None  # the VAE file beside a single-file model
    text_encoders: bool = True
    dtype: str | None = None
    devices: str | None = None
    threads_per_rank: int | None = None
    endpoint: str = ""  # set: a pool started elsewhere (python -m workers serve)
    curve_dir: str = ""  # with endpoint: folder with the pool's server.key and a client.key_secret
    auto: bool = False  # the layout chosen per job size from measurements (degrees in `parallel` all 1)

    @property
    def label(self) -> str:
        where = self.endpoint or f"{self.nproc} rank(s)"
        layout = "layout auto" if self.auto else self.parallel.describe()
        return f"{Path(self.model).name or self.model} · {layout} · {where}"


@dataclass
class PoolHandle:
    """What flows along an XDIT_POOL connection."""

    key: PoolKey
    endpoint: str
    status: dict = field(default_factory=dict)
    loras: tuple[tuple[str, float, str], ...] = ()  # (file, strength, expert), applied on every rank per job
    cache: dict = field(default_factory=dict)  # the step cache each job asks for (CacheSettings.to_params)

    def with_lora(self, path: str, strength: float, expert: str = "") -> "PoolHandle":
        return replace(self, loras=self.loras + ((path, strength, expert),))

    def with_cache(self, cache: dict) -> "PoolHandle":
        return replace(self, cache=cache)

    @property
    def pipeline(self) -> str:
        return self.status.get("pipeline") or "?"

    @property
    def latent_scale(self) -> int:
        return int(self.status.get("latent_scale") or 8)  # 8: a status from before the model loaded


class PoolRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._pools: dict[PoolKey, Pool] = {}
        self._endpoints: dict[PoolKey, str] = {}
        self._curve_dirs: dict[str, str | None] = {}  # endpoint -> key folder of its clients
        self._local = threading.local()

    def acquire(self, key: PoolKey, timeout_s: float = 1800) -> PoolHandle:
        """The running pool for `key`, started (and waited for) if needed."""
        if key.endpoint:
            endpoint = key.endpoint
            self._curve_dirs[endpoint] = key.curve_dir or os.environ.get(CURVE_ENV) or None
        else:
            with self._lock:
                pool = self._pools.get(key)
                if pool is None or not pool.running:
                    endpoint = free_endpoint()
                    spec = PoolSpec(model=key.model, vae=key.vae, nproc=key.nproc, endpoint=endpoint,
                                    parallel=key.parallel, text_encoders=key.text_encoders, dtype=key.dtype,
                                    devices=key.devices, threads_per_rank=key.threads_per_rank,
                                    auto=AutoLayout() if key.auto else None)
                    pool = self._pools[key] = Pool(spec)
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

    def fingerprint(self, key: PoolKey) -> str:
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
                status = self.client(endpoint).status(timeout_s=2.0) if pool is None or pool.running else {"state": "stopped"}
            except PoolUnreachable:
                status = {"state": "unreachable"}
            rows.append({"id": self.pool_id(key), "label": key.label, "endpoint": endpoint, "managed": pool is not None,
                         "key": {**asdict(key), "parallel": asdict(key.parallel)}, "status": status})
        return rows

    def remember(self, key: PoolKey, endpoint: str) -> None:
        """Show a pool reached by endpoint in the panel too."""
        with self._lock:
            self._endpoints.setdefault(key, endpoint)

    @staticmethod
    def pool_id(key: PoolKey) -> str:
        return f"{abs(hash(key)):x}"

    def find(self, pool_id: str) -> PoolKey | None:
        with self._lock:
            return next((k for k in self._endpoints if self.pool_id(k) == pool_id), None)

    def stop(self, key: PoolKey) -> None:
        pool = self._pools.get(key)
        if pool is not None:
            pool.stop()
        else:
            self.client(self._endpoints[key]).stop()

    def restart(self, key: PoolKey) -> PoolHandle:
        self.stop(key)
        return self.acquire(key)

    def stop_all(self) -> None:
        for pool in list(self._pools.values()):
            pool.stop()


POOLS = PoolRegistry()
atexit.register(POOLS.stop_all)
