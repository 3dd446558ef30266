"""What a pool is made of on this machine: model, ranks, layout, endpoint and keys, and its place among machines.

`check()` turns every mistake that would only show up later on some rank into one clear error
before anything starts; `rank_arguments()` is the rank command line the supervisor builds from it
(ranks.py starts the ranks with it); `key_folder()` the keys its client endpoint serves with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engine import AutoLayout, LayoutError, ParallelConfig, engine, fields
from ..wire import owner_keys
from ..wire.auth import ServerKeys, check_endpoint
from ..engine import rendezvous


@dataclass(frozen=True)
class PoolSpec:
    model: str
    nproc: int  # ranks on this machine
    endpoint: str | None  # None on a joining node: rank 0, on node 0, serves the clients
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    auto: AutoLayout | None = None  # --layout auto: the degrees (all 1 in `parallel`) are chosen per job size
    vae: str | None = None  # the VAE file beside a single-file model
    text_encoders: bool = False
    dtype: str | None = None
    threads_per_rank: int | None = None
    log_file: str | None = None
    devices: str | None = None  # CUDA_VISIBLE_DEVICES for the ranks, e.g. "0,1,2,3"
    curve_dir: str | None = None  # CURVE keys of the client endpoint (auth.py); None: the owner's own (owner_keys.py)
    insecure_tcp: bool = False  # a plain client endpoint, on loopback only: every local user could use the pool
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0's rendezvous
    rdzv_id: str = "xdit-pool"
    max_megapixels: float = 0.0  # admission limits (admission.py); 0: none
    max_job_seconds: float = 0.0
    hang_timeout_s: float = 30.0  # a rank silent this long (no heartbeat) is hung: the job fails, the pool restarts

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.nproc, (node + 1) * self.nproc))

    def describe_layout(self) -> str:
        if self.auto is None:
            return self.parallel.describe()
        return "layout auto" + (f" for {self.auto.link}" if self.auto.link else "") + " (chosen per job size)"

    def layout_status(self) -> dict:
        """The layout as the pool's status shows it: every field, and its description."""
        return {**fields.to_plain(self.parallel, defaults=True), "description": self.describe_layout()}

    def check(self) -> None:
        try:
            # auto: the settings beside the degrees, as data parallel over the world would run them
            parallel = replace(self.parallel, dp_degree=self.world_size) if self.auto else self.parallel
            parallel.check(self.world_size, ranks_flag="--nproc")
        except LayoutError as error:
            if self.nnodes == 1:
                raise
            raise LayoutError(f"{error} (here {self.nnodes} nodes × --nproc {self.nproc} = {self.world_size} ranks)") from None
        engine("distributed.devices").check_rank_count(self.nproc, self.devices, self.parallel.share_gpus)
        if self.hang_timeout_s < 3:
            raise ValueError(f"--hang-timeout {self.hang_timeout_s:g} is too short: ranks beat every second; give 3 s or more")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, node 0's address (e.g. 192.168.1.10:29400)")
        if self.nnodes > 1:
            rendezvous.rendezvous_address(self.rdzv_endpoint)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0 … {self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.node_rank == 0 and self.endpoint is None:
            raise ValueError("node 0 serves the clients: give it --endpoint (`python -m workers serve`)")
        if self.node_rank > 0 and self.endpoint is not None:
            raise ValueError(f"--node-rank {self.node_rank}: only node 0 serves clients; start node {self.node_rank} "
                             "with `python -m workers join`")
        if self.endpoint is not None:
            check_endpoint(self.endpoint, self.curve_dir, self.insecure_tcp)
            if self.curve_dir:
                ServerKeys.load(self.curve_dir)

    def key_folder(self) -> str | None:
        """The keys the client endpoint serves with: --curve-dir, else the owner's own, created on first use; None
        without an endpoint here or with --insecure-tcp."""
        if self.endpoint is None or self.insecure_tcp:
            return None
        return self.curve_dir or str(owner_keys.owner_folder())

    def rank_arguments(self) -> list[str]:
        """The rank command line (workers/rank/process.py parses it): the layout travels as its own flags."""
        args = ["--model", str(self.model), "--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                *fields.to_flags(self.parallel)]
        if self.auto is not None:
            args += self.auto.rank_arguments()
        if self.endpoint is not None:
            args += ["--endpoint", self.endpoint]
        if self.curve_dir and self.endpoint is not None:
            args += ["--curve-dir", str(self.curve_dir)]
        if self.max_megapixels:
            args += ["--max-megapixels", str(self.max_megapixels)]
        if self.max_job_seconds:
            args += ["--max-job-seconds", str(self.max_job_seconds)]
        if self.text_encoders:
            args.append("--text-encoders")
        if self.vae:
            args += ["--vae", str(self.vae)]
        if self.dtype:
            args += ["--dtype", self.dtype]
        return args
