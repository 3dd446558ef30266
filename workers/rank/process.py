"""What each rank runs: `python -m workers.rank --model DIR --endpoint E --control C --store HOST:PORT ...`.

Start-up: join the world through the store its supervisor (node 0's) hosts, report to the supervisor, take a census of the world (every rank's node and pid,
and one layout for all), load and wrap the pipeline, wait for every rank, then report ready (rank 0 already
taking jobs). Rank 0 also serves clients (server.ClientServer), checking each job (validation.py); then every
rank runs the job loop (loop.py). A `Rank` holds what this rank knows; those units read and update it.
On several machines the ranks renumber themselves node by node (node 0 first), because c10d's rendezvous
orders machines its own way.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from ..engine import config, engine, fields, rendezvous
from ..wire import control
from ..wire.control import Heartbeat, RankChannel
from ..wire.framing import pack_header, unpack_header
from .admission import Admission, megapixels
from .conditioning import ConditioningCache
from .loop import JobLoop
from .runner import JobRunner
from .status import status_of, take_census
from .validation import Validator

HEALTH_TIMEOUT_S = 10.0  # a peer silent this long inside a probe or a verdict is lost
CENSUS_BYTES = 4096  # a rank's node, pid, host name and layout, as msgpack


class StartRefused(RuntimeError):
    """This world cannot work whatever the other nodes do (different layouts or --nproc): do not retry."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.rank")
    parser.add_argument("--model", required=True)
    parser.add_argument("--endpoint", default=None, help="rank 0 serves clients here (node 0 only)")
    parser.add_argument("--curve-dir", default=None)
    parser.add_argument("--control", required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the world's store (parallel/cli/rendezvous.py)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--text-encoders", action="store_true")
    parser.add_argument("--vae", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--jobs-done", type=int, default=0)
    parser.add_argument("--restarts", type=int, default=0)
    parser.add_argument("--max-megapixels", type=float, default=0.0)
    parser.add_argument("--max-job-seconds", type=float, default=0.0)
    config.add_parallel_arguments(parser)
    return parser.parse_args(argv)


class Rank:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = self._claim_rank()
        self.phase = "world"  # "world": collectives, which fail when a peer is lost; "load": this rank alone
        self.context = zmq.Context()
        self.control = RankChannel(self.context, args.control, self.rank, args.restarts)
        self.control.send(control.Hello(pid=os.getpid()))
        self.heartbeat = Heartbeat(self.context, args.control, self.rank, args.restarts, self.progress)
        self.heartbeat.start()
        self.server = None
        self.jobs_done = args.jobs_done
        self.model_calls = 0  # single model calls answered (xDiT Model)
        self.census_at = 0.0  # when the ranks last gathered their memory (status.take_census)
        self.conditioning = ConditioningCache()  # rank 0: what model calls sent, by key
        self.last_cache: dict | None = None  # the last job's step cache: method, full and cached model calls
        self.memory: list[dict] = []
        self.storage: dict[str, int] = {}  # rank 0's transformer parameter bytes per storage format
        self.pids: list[int] = []
        self.nodes: list[dict] = []
        self.state = "starting"
        self.admission = Admission(args.max_megapixels, args.max_job_seconds)

    def _claim_rank(self) -> int:
        """Node 0's ranks come first, whatever order the c10d rendezvous gave the machines."""
        if self.args.nnodes == 1:
            return int(os.environ["RANK"])
        rank = self.args.node_rank * int(os.environ["LOCAL_WORLD_SIZE"]) + int(os.environ["LOCAL_RANK"])
        os.environ["RANK"] = str(rank)  # read by init_distributed_environment
        return rank

    def progress(self) -> control.Beat:
        """What each heartbeat tells the supervisor: this rank's state and step, and whether stop was asked."""
        stopping = self.server is not None and self.server.stop_requested.is_set()
        return control.Beat(state=self.state, step=self.runner.step if self.state == "busy" else 0, stopping=stopping)

    def job_megapixels(self, height: int, width: int, latents: torch.Tensor) -> float:
        """Output megapixels: video latents [B, C, T', H, W] hold (T' - 1) × the pipeline's frames per latent frame + 1."""
        temporal = self.pipeline.comfy.temporal
        frames = (latents.shape[2] - 1) * temporal + 1 if temporal and latents.ndim == 5 else 1
        return megapixels(latents.shape[0], height, width, frames)

    # -- start-up -----------------------------------------------------------------------------------
    def start(self) -> None:
        distributed = engine("distributed")
        load_pipeline = engine("loading.pipelines").load_pipeline
        wrap_pipeline = engine("model_executor").wrap_pipeline

        nodes_nproc = self.args.nnodes * int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if self.args.nnodes > 1 and int(os.environ["WORLD_SIZE"]) != nodes_nproc:
            raise StartRefused(f"the world has {os.environ['WORLD_SIZE']} ranks but {self.args.nnodes} nodes × "
                               f"--nproc {os.environ['LOCAL_WORLD_SIZE']} = {nodes_nproc}: give every node the same --nproc")
        store = rendezvous.join(self.args.store, int(os.environ["WORLD_SIZE"]))
        world = distributed.init_distributed_environment(share_gpus=self.args.share_gpus, store=store)
        self.world_size = world.world_size
        self.config = config.config_from_args(self.args)
        self.auto = config.auto_layout_from_args(self.args)  # None: the degrees as given
        self.layouts = None  # with --layout auto: auto_layouts.AutoLayouts
        self.layout = None  # the RankLayout (mesh coordinates), once the layout is known
        # Job metadata, step decisions and probes travel on gloo (CPU) even when the model uses NCCL.
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.health = dist.new_group(backend="gloo", timeout=timedelta(seconds=HEALTH_TIMEOUT_S))
        self.nodes, self.pids = self._census()
        if self.auto is None:
            self.layout = distributed.initialize_model_parallel(self.config)
        model = engine("loading.builtin_models").resolve_model_on_ranks(
            self.args.model, int(os.environ.get("LOCAL_RANK", 0)), distributed.get_world_group().barrier)
        self.phase = "load"
        if self.rank == 0:
            self._serve()
        # Only rank 0 encodes text, so only rank 0 loads the text encoders.
        text_encoders = self.args.text_encoders and self.rank == 0
        pipeline = load_pipeline(model, text_encoders=text_encoders, dtype=self.args.dtype,
                                 shard_weights=self.config.shard_weights, offload=self.config.offload, vae=self.args.vae)
        if self.auto is None:
            self.pipeline = wrap_pipeline(pipeline)
        else:  # the start layout now (collective: the world phase); a layout per job size from the first job on
            self.phase = "world"
            self.layouts = engine("layout.auto").AutoLayouts(pipeline, self.config, self.world_size, self.auto)
            self.pipeline, self.config, self.layout = self.layouts.wrapped, self.layouts.config, self.layouts.rank_layout
        self.default_scheduler = self.pipeline.module.scheduler.module
        self.scheduler_name = "default"
        self.runner = JobRunner(self.pipeline, self.group, self.server,
                                cancel_inside_steps=self.config.pipefusion_degree == 1)
        self.loras = engine("loading.lora").LoraManager(self.pipeline.module)
        self.phase = "world"
        take_census(self)
        # Ready only once every rank has loaded and rank 0 takes jobs: a pool that says it started
        # must accept the next job.
        distributed.get_world_group().barrier()
        self.state = "idle"
        self.control.send(control.Ready(pid=os.getpid(), memory=self.memory[self.rank] if self.memory else {},
                                        nodes=tuple(self.nodes)))

    def _census(self) -> tuple[list[dict], list[int]]:
        """Every rank's node, host and pid (for status), and one layout for the whole world: each rank's layout
        (every field of its ParallelConfig, and --layout auto) travels as its plain map."""
        layout = fields.to_plain({"parallel": self.config, "auto": self.auto is not None}, defaults=True)
        mine = {"node": self.args.node_rank, "pid": os.getpid(), "host": socket.gethostname(), "layout": layout}
        rows = [tuple(unpack_header(raw, CENSUS_BYTES).values()) for raw in self._gather_bytes(pack_header(mine))]
        for node, _, _, theirs in rows:
            if theirs != layout:
                differ = {key: value for key, value in theirs["parallel"].items() if layout["parallel"][key] != value}
                differ |= {"layout auto": theirs["auto"]} if theirs["auto"] != layout["auto"] else {}
                raise StartRefused(f"node {node} runs the layout with {differ} but node {self.args.node_rank} does not: "
                                   "start every node with the same layout flags")
        nodes: dict[int, dict] = {}
        for r, (node_rank, pid, host, _) in enumerate(rows):
            node = nodes.setdefault(node_rank, {"node": node_rank, "host": host, "ranks": [], "pids": []})
            node["ranks"].append(r)
            node["pids"].append(pid)
        return [nodes[n] for n in sorted(nodes)], [row[1] for row in rows]

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes (at most CENSUS_BYTES each), in rank order."""
        if len(data) > CENSUS_BYTES:
            raise StartRefused(f"this rank's census is {len(data)} bytes; the limit is {CENSUS_BYTES}")
        local = torch.zeros(CENSUS_BYTES + 8, dtype=torch.uint8)
        local[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        local[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return [bytes(part[8:8 + int.from_bytes(bytes(part[:8].tolist()), "little")].tolist()) for part in parts]

    def _serve(self) -> None:
        from .server import ClientServer

        self.control.send(control.BindRequest())
        if not isinstance(self.control.receive(timeout_s=30), control.BindOk):
            raise RuntimeError(f"the supervisor did not hand over {self.args.endpoint}")
        self.server = ClientServer(self.context, self.args.endpoint, lambda: status_of(self), Validator(self),
                                   self.args.curve_dir, on_stop=self.heartbeat.beat_now)
        self.server.start()

    def gather_ints(self, values: list[int]) -> list[int]:
        local = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return [int(x) for part in parts for x in part]


def exit_at_sigterm() -> None:
    """SIGTERM ends this rank at once, even inside a long tensor op, where a Python handler would wait for the op.

    Python's C-level handler writes the signal's number to the wake-up pipe as it arrives (whatever the main
    thread is doing); a thread reading it exits. Nothing is blocked, so processes this rank starts get the
    default signal mask.
    """
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def wait() -> None:
        while os.read(read, 1)[0] != signal.SIGTERM:  # other signals keep their own handlers
            pass
        os._exit(0)

    threading.Thread(target=wait, name="xdit-sigterm", daemon=True).start()


def main(argv=None) -> int:
    engine("cli.launch").die_with_parent()
    exit_at_sigterm()
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK')}] %(levelname)s %(message)s")
    engine("cli.launch").apply_threads_per_rank()
    rank = Rank(parse_args(argv))
    try:
        rank.start()
    except Exception as error:  # noqa: BLE001 - start-up failures go to the supervisor verbatim
        # On several machines a failed collective means a node was lost: the supervisors try again.
        fatal = rank.args.nnodes == 1 or rank.phase != "world" or isinstance(error, StartRefused)
        mistake = isinstance(error, (StartRefused, ValueError, FileNotFoundError))  # as contract E tells them apart
        rank.control.send(control.Failed(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(),
                                         fatal=fatal, mistake=mistake))
        time.sleep(0.5)
        return 1
    JobLoop(rank).run()
    rank.heartbeat.stop()
    if rank.server:
        rank.server.close()
    rank.control.send(control.Stopped())
    rank.context.destroy(linger=2000)  # delivers "stopped"
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter teardown (torch, gloo) is slow; a SIGTERM from the supervisor during it would kill the rank
    # with the default action, which torchrun reports as a failure with its traceback.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
