"""What each torchrun rank runs: `python -m workers.rank --model DIR --endpoint E --control C ...`.

Start-up: join the world, report to the supervisor, load and wrap the pipeline, wait for every rank,
then report ready (rank 0 already taking jobs).
Rank 0 also serves clients (server.ClientServer). Then the job loop: rank 0 takes a job, all ranks
run it, rank 0 answers. A job that fails on every rank alike is answered and the loop goes on; a
rank that fails alone is reported to the supervisor, which restarts the pool.

Between jobs rank 0 probes the world every second (a `probe` work item and an all-reduce with a
short timeout), so a lost peer, on this machine or another one, is noticed while idle too; a rank
whose collectives fail reports `world_lost` and waits for its supervisor to restart it. The probe
also keeps idle ranks from hitting gloo's receive timeout. On several machines the ranks renumber
themselves node by node (node 0 first), because c10d's rendezvous orders machines its own way.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import zmq

from .admission import Admission, megapixels
from .conditioning import ConditioningCache
from .control import Heartbeat, RankChannel
from .engine import add_parallel_arguments, auto_layout_from_args, config_from_args, engine
from .jobs import JobCancelled, JobRunner, Work, broadcast_work
from .memory import PeakMemory, memory_of_this_rank
from .processes import is_alive
from .protocol import Message

log = logging.getLogger("xdit.rank")
VERDICT_TIMEOUT_S = 10.0
PROBE_EVERY_S = 1.0
CENSUS_EVERY_S = 1.0  # between model calls, the ranks gather their memory for the status at most this often
HEALTH_TIMEOUT_S = 10.0  # a peer silent this long inside a probe or a verdict is lost
WORLD_LOST_WAIT_S = 30.0
HOST_BYTES = 64


class StartRefused(RuntimeError):
    """This world cannot work whatever the other nodes do (different layouts or --nproc): do not retry."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.rank")
    parser.add_argument("--model", required=True)
    parser.add_argument("--endpoint", default=None, help="rank 0 serves clients here (node 0 only)")
    parser.add_argument("--curve-dir", default=None)
    parser.add_argument("--control", required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--text-encoders", action="store_true")
    parser.add_argument("--vae", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--jobs-done", type=int, default=0)
    parser.add_argument("--restarts", type=int, default=0)
    parser.add_argument("--max-megapixels", type=float, default=0.0)
    parser.add_argument("--max-job-seconds", type=float, default=0.0)
    add_parallel_arguments(parser)
    return parser.parse_args(argv)


class Rank:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = self._claim_rank()
        self.phase = "world"  # "world": collectives, which fail when a peer is lost; "load": this rank alone
        self.context = zmq.Context()
        self.control = RankChannel(self.context, args.control, self.rank, args.restarts)
        self.control.send("hello", pid=os.getpid())
        self.heartbeat = Heartbeat(self.context, args.control, self.rank, args.restarts, self.progress)
        self.heartbeat.start()
        self.server = None
        self.jobs_done = args.jobs_done
        self.model_calls = 0  # single model calls answered (xDiT Model)
        self.census_at = 0.0  # when the ranks last gathered their memory (_update_memory)
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
        os.environ["RANK"] = str(rank)  # read by init_process_group (env://)
        return rank

    def progress(self) -> dict:
        """What each heartbeat tells the supervisor: this rank's state and step, and whether stop was asked."""
        stopping = self.server is not None and self.server.stop_requested.is_set()
        return {"state": self.state, "step": self.runner.step if self.state == "busy" else 0, "stopping": stopping}

    # -- start-up -----------------------------------------------------------------------------------
    def start(self) -> None:
        distributed = engine("distributed")
        load_pipeline = engine("loading").load_pipeline
        wrap_pipeline = engine("model_executor").wrap_pipeline

        nodes_nproc = self.args.nnodes * int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if self.args.nnodes > 1 and int(os.environ["WORLD_SIZE"]) != nodes_nproc:
            raise StartRefused(f"the world has {os.environ['WORLD_SIZE']} ranks but {self.args.nnodes} nodes × "
                               f"--nproc {os.environ['LOCAL_WORLD_SIZE']} = {nodes_nproc}: give every node the same --nproc")
        world = distributed.init_distributed_environment(share_gpus=self.args.share_gpus)
        self.world_size = world.world_size
        self.config = config_from_args(self.args)
        self.auto = auto_layout_from_args(self.args)  # None: the degrees as given
        self.layouts = None  # with --layout auto: auto_layouts.AutoLayouts
        self.layout = None  # the RankLayout (mesh coordinates), once the layout is known
        # Job metadata, step decisions and probes travel on gloo (CPU) even when the model uses NCCL.
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.health = dist.new_group(backend="gloo", timeout=timedelta(seconds=HEALTH_TIMEOUT_S))
        self.nodes, self.pids = self._census()
        if self.auto is None:
            self.layout = distributed.initialize_model_parallel(self.config)
        model = engine("builtin_models").resolve_model_on_ranks(
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
            self.layouts = engine("auto_layouts").AutoLayouts(pipeline, self.config, self.world_size, self.auto)
            self.pipeline, self.config, self.layout = self.layouts.wrapped, self.layouts.config, self.layouts.rank_layout
        self.default_scheduler = self.pipeline.module.scheduler.module
        self.scheduler_name = "default"
        self.runner = JobRunner(self.pipeline, self.group, self.server,
                                cancel_inside_steps=self.config.pipefusion_degree == 1)
        self.loras = engine("lora").LoraManager(self.pipeline.module)
        self.phase = "world"
        self._update_memory()
        # Ready only once every rank has loaded and rank 0 takes jobs: a pool that says it started
        # must accept the next job.
        distributed.get_world_group().barrier()
        self.state = "idle"
        self.control.send("ready", pid=os.getpid(), memory=self.memory[self.rank] if self.memory else {}, nodes=self.nodes)

    def _census(self) -> tuple[list[dict], list[int]]:
        """Every rank's node, host and pid (for status), and one layout for the whole world."""
        c = self.config
        layout = [c.dp_degree, c.cfg_degree, c.pipefusion_degree, c.ring_degree, c.ulysses_degree, c.num_patches or 0, c.warmup_steps, int(c.shard_weights), int(c.offload), int(c.compile), int(self.auto is not None)]
        width = 2 + len(layout)
        flat = self._gather_ints([self.args.node_rank, os.getpid(), *layout])
        rows = [flat[r * width:(r + 1) * width] for r in range(self.world_size)]
        hosts = self._gather_text(socket.gethostname())
        for r, row in enumerate(rows):
            if row[2:] != layout:
                names = "dp, cfg, pipefusion, ring, ulysses, patches, warmup, shard, offload, compile, auto"
                raise StartRefused(f"node {row[0]} runs the layout ({names}) = {tuple(row[2:])} but node "
                                   f"{self.args.node_rank} runs {tuple(layout)}: start every node with the same layout flags")
        nodes: dict[int, dict] = {}
        for r, row in enumerate(rows):
            node = nodes.setdefault(row[0], {"node": row[0], "host": hosts[r], "ranks": [], "pids": []})
            node["ranks"].append(r)
            node["pids"].append(row[1])
        return [nodes[n] for n in sorted(nodes)], [row[1] for row in rows]

    def _gather_text(self, text: str) -> list[str]:
        local = torch.zeros(HOST_BYTES, dtype=torch.uint8)
        data = text.encode()[:HOST_BYTES]
        local[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return [bytes(part.tolist()).rstrip(b"\0").decode(errors="replace") for part in parts]

    def _serve(self) -> None:
        from .server import ClientServer

        self.control.send("bind_request")
        reply = self.control.receive(timeout_s=30)
        if not reply or reply["type"] != "bind_ok":
            raise RuntimeError(f"the supervisor did not hand over {self.args.endpoint}")
        self.server = ClientServer(self.context, self.args.endpoint, self.status, self.validate, self.args.curve_dir,
                                   on_stop=self.heartbeat.beat_now)
        self.server.start()

    def _gather_ints(self, values: list[int]) -> list[int]:
        local = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return [int(x) for part in parts for x in part]

    def _update_memory(self) -> None:
        self.census_at = time.monotonic()
        transformer = self.pipeline.module.transformer.module
        self.storage = engine("checkpoints.fp8").storage_of(transformer)  # e.g. float8_e4m3fn + bfloat16 bytes
        own = memory_of_this_rank(transformer)
        flat = self._gather_ints([own["rss_bytes"], own["device_bytes"], own["parameter_bytes"]])
        self.memory = [
            {"rank": r, "rss_bytes": flat[3 * r], "device_bytes": flat[3 * r + 1], "parameter_bytes": flat[3 * r + 2]}
            for r in range(self.world_size)
        ]

    # -- what rank 0's server asks ------------------------------------------------------------------
    def status(self) -> dict:
        # Ranks on other machines count as alive while the world holds: the probes notice within a second.
        nodes = [{**row, "alive": row["node"] != self.args.node_rank or all(map(is_alive, row["pids"]))} for row in self.nodes]
        alive = sum(sum(map(is_alive, row["pids"])) if row["node"] == self.args.node_rank else len(row["pids"]) for row in nodes)
        return {
            "state": self.state,
            "world_size": self.world_size,
            "ranks_alive": alive,
            "jobs_done": self.jobs_done,
            "model_calls": self.model_calls,
            "last_cache": self.last_cache,
            "restarts": self.args.restarts,
            "model": self.args.model,
            "vae": self.args.vae,
            "pipeline": type(self.pipeline.module).__name__ if self.state != "starting" else None,
            "inputs": self.pipeline.input_widths() if self.state != "starting" else {},
            "model_class": self.pipeline.comfy_model_class() if self.state != "starting" else "",
            "latent_scale": self.pipeline.latent_scale() if self.state != "starting" else 0,
            "text_encoders": self.args.text_encoders,
            "dtype": self.args.dtype or "as saved",
            "storage": self.storage,
            "fp8_matmul": self.pipeline.fp8_matmul if self.state != "starting" else 0,  # fp8 layers multiplying in fp8
            "loads": {"pipeline": 1, "lora": self.loras.loads if self.state != "starting" else 0},
            "loras": [vars(spec) for spec in self.loras.active] if self.state != "starting" else [],
            "mesh": [self.layout.coordinates(r) for r in range(self.world_size)] if self.layout else [],
            "parallel": {**vars(self.config), "description": self.config.describe()},
            "layout_auto": self.layouts.report() if self.layouts is not None and self.state != "starting" else None,
            "memory": self.memory,
            "queue": self.server.queue_length() if self.server else 0,
            "step": self.runner.step if self.state == "busy" else 0,
            "compile": engine("compile").report() if self.config.compile and self.state != "starting" else None,
            "pids": self.pids,
            "nodes": nodes,
            **engine("devices").status_fields(),  # p2p, cards, mixed_cards: this machine's (parallel/devices.py)
        }

    def validate(self, message: Message):
        """Rank 0, at submit: refuse a job that cannot run; for a sample, what the runner prepared."""
        if self.state == "starting":
            raise ValueError("the pool is still loading its model; retry when status says idle")
        if message.type == "encode":
            if not self.args.text_encoders:
                raise ValueError("this pool was started without text encoders; start it with them "
                                 "(`python -m workers serve --text-encoders`, or the xDiT Pool node's text_encoders on)")
            return None
        if message.type == "decode":
            return self._check_decode(message)
        self._check_loras(message)
        if message.type == "evaluate":
            return self._check_model_call(message)
        if "latents" not in message.tensors:
            raise ValueError("submit needs a 'latents' tensor (the initial noise)")
        request = self.runner.request(message.params)
        self.admission.check(self._size(request, message.tensors["latents"]), request.steps)
        # with --layout auto the layout is chosen when the job runs: here only what every layout checks
        prepared = self.runner.prepare(message.params, message.tensors, check_layout=self.layouts is None)
        init = message.tensors.get("init_latents")
        if init is not None and init.shape != message.tensors["latents"].shape:
            latents = message.tensors["latents"]
            raise ValueError(f"init_latents {list(init.shape)} must have the shape of latents {list(latents.shape)}")
        engine("loading").make_scheduler(self.default_scheduler, message.params.get("scheduler", "default"))
        return prepared

    @staticmethod
    def _check_loras(message: Message) -> None:
        for lora in message.params.get("loras", []):
            if not os.path.isfile(lora["path"]):
                raise ValueError(f"LoRA file {lora['path']} does not exist on the pool's machine")

    def _check_model_call(self, message: Message) -> dict[str, torch.Tensor]:
        """The call's tensors, its conditioning filled in from what earlier calls sent, checked once."""
        tensors = self.conditioning.resolve(message.params.get("conditioning", {}), message.tensors)
        engine("model_executor.model_call").check_model_call(self.pipeline, tensors)
        latents = tensors["latents"]
        scale = self.pipeline.module.vae_scale_factor
        self.admission.check(megapixels(latents.shape[0], latents.shape[2] * scale, latents.shape[3] * scale), 1)
        return tensors

    def _size(self, request, latents: torch.Tensor) -> float:
        """Output megapixels: video latents [B, C, T', H, W] hold (T' - 1) × the pipeline's frames per latent frame + 1."""
        temporal = self.pipeline.comfy.temporal
        frames = (latents.shape[2] - 1) * temporal + 1 if temporal and latents.ndim == 5 else 1
        return megapixels(latents.shape[0], request.height, request.width, frames)

    def _check_decode(self, message: Message) -> None:
        vae = getattr(self.pipeline.module, "vae", None)
        latents = message.tensors.get("latents")
        if vae is None:
            raise ValueError("this pool's pipeline has no VAE to decode with; decode with ComfyUI's VAE Decode")
        if latents is None or not latents.is_floating_point():
            raise ValueError("decode needs a floating-point 'latents' tensor in the VAE's own space (ComfyUI's LATENT)")
        channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
        dims = 5 if self.pipeline.comfy.temporal else 4
        if latents.ndim != dims or latents.shape[1] != channels:
            layout = "[batch, channels, frames, height, width]" if dims == 5 else "[batch, channels, height, width]"
            raise ValueError(f"this pool's {type(vae).__name__} decodes {dims}-D latents {layout} with {channels} channels, "
                             f"got {list(latents.shape)}; decode latents of this pool's model")
        engine("vae_decode").fit_tiles(vae, latents, self.world_size, message.params.get("tile", 0))

    # -- the job loop -------------------------------------------------------------------------------
    def loop(self) -> None:
        while True:
            work, client, prepared = None, None, None
            if self.rank == 0:
                job = self.server.next_job(timeout_s=PROBE_EVERY_S)
                if job is False:
                    work = Work("probe")
                elif job is None:
                    work = Work("stop")
                elif job.message.type == "encode":  # rank 0 alone; the others keep waiting
                    self._encode(job)
                    continue
                elif job.message.type == "evaluate":  # its tensors: the conditioning filled in at submit
                    params = job.message.params
                    # the ranks' memory census (a collective) at most once a second, not after every call
                    census = time.monotonic() - self.census_at >= CENSUS_EVERY_S
                    tensors = self.runner.conditioning.to_send(params.get("conditioning", {}), job.prepared)
                    work, client = Work("evaluate", job.id, {**params, "census": census}, tensors), job.client
                else:
                    kind = "decode" if job.message.type == "decode" else "sample"
                    work = Work(kind, job.id, job.message.params, job.message.tensors)
                    client, prepared = job.client, job.prepared
                    self.control.send("job_started", job=job.id, client=client)
            try:
                work = broadcast_work(work, self.group)
                if work.kind == "probe":
                    dist.all_reduce(torch.ones(1), group=self.health)
                    continue
            except Exception as error:  # noqa: BLE001 - a peer is gone; the supervisors restart the world
                self._lost_world(error)
            if work.kind == "stop":
                return
            self._run(work, client, prepared)

    def _encode(self, job) -> None:
        self.state = "busy"
        try:
            params, image = job.message.params, job.message.tensors.get("image")
            if "seed" in params:  # a whole job's inputs: both prompts and the seed's noise
                tensors = engine("prompt_inputs").prompt_inputs(self.pipeline, params["prompt"], params.get("negative_prompt", ""),
                                                                params["seed"], params["height"], params["width"], image)
            else:
                with torch.no_grad():
                    tensors = (self.pipeline.encode_text(params["prompt"]) if image is None
                               else self.pipeline.encode_text_with_images(params["prompt"], image))
            self.server.send(job.client, Message("result", job.id, {}, tensors))
        except Exception as error:  # noqa: BLE001 - rank 0 alone: answer and go on
            self.server.send(job.client, Message("error", job.id, {"message": f"{type(error).__name__}: {error}", "rank": 0}))
        finally:
            self.state = "idle"
            self.server.job_finished()

    def _run(self, work: Work, client: bytes | None, prepared=None) -> None:
        self.state = "busy"
        reply = None  # sent once the state says idle, so a client that asks right after sees idle
        try:
            if work.kind == "decode":
                images, info = self.runner.decode(work, client)
                reply = Message("result", work.job, info, {"images": images} if images is not None else {})
                self.jobs_done += 1
            elif work.kind == "evaluate":
                self._apply_loras(work)
                reply = Message("result", work.job, {}, {"prediction": self.runner.evaluate(work)})
                self.model_calls += 1
            else:
                if self.layouts is not None:
                    self._choose_layout(work)
                name = work.params.get("scheduler", "default")
                if name != self.scheduler_name:
                    self.pipeline.use_scheduler(engine("loading").make_scheduler(self.default_scheduler, name))
                    self.scheduler_name = name
                self._apply_loras(work)
                started = time.perf_counter()
                with PeakMemory() as peak:
                    latents = self.runner.run(work, client, prepared)
                request = self.runner.request(work.params)
                self.admission.record(self._size(request, work.tensors["latents"]), request.steps,
                                      time.perf_counter() - started, peak.bytes)
                reply = Message("result", work.job, self.runner.outcome(), {"latents": latents})
                self.last_cache = reply.params.get("cache")
                if self.last_cache is not None and self.rank == 0:
                    log.info("job %s: %s", work.job, self.last_cache["text"])
                self.jobs_done += 1
        except JobCancelled as cancelled:
            reply = Message("cancelled", work.job, {"step": cancelled.step})
        except Exception as error:  # noqa: BLE001 - any failure of the job is reported, then judged
            reply = self._job_failed(work, error)
        finally:
            self.state = "idle"
            if self.rank == 0:
                if reply is not None:
                    self.server.send(client, reply)
                self.server.job_finished()
                self.control.send("job_ended", job=work.job, jobs_done=self.jobs_done)
        if work.kind == "evaluate" and not work.params.get("census"):
            return
        try:
            self._update_memory()
        except Exception as error:  # noqa: BLE001 - a peer is gone
            self._lost_world(error)

    def _choose_layout(self, work: Work) -> None:
        """--layout auto: the layout chosen for this job's size (measured now if the size is new), wrapped."""
        call = self.runner.request(work.params).pipeline_kwargs(work.tensors)
        call.pop("init_latents", None)
        pipeline, made = self.layouts.for_call(call)
        if made is not None and self.rank == 0:
            log.info("layout auto for %s chose [%s]; predicted per step:\n  %s", made.job, made.config.describe(),
                     "\n  ".join(made.table))
        if pipeline is not self.pipeline:
            self.pipeline = self.runner.pipeline = pipeline
            self.config, self.layout = self.layouts.config, self.layouts.rank_layout
            self.runner.cancel_inside_steps = self.config.pipefusion_degree == 1
            self.scheduler_name = "default"  # the rewrapped pipeline samples with its own scheduler again

    def _apply_loras(self, work: Work) -> None:
        self.loras.apply([engine("lora").LoraSpec(lora["path"], float(lora["strength"]), lora.get("expert", ""))
                          for lora in work.params.get("loras", [])])

    def _job_failed(self, work: Work, error: Exception) -> Message:
        """Ask the supervisor whether every rank failed alike (answer and go on) or not (restart)."""
        text = f"{type(error).__name__}: {error}"
        log.error("job %s failed on rank %d: %s", work.job, self.rank, traceback.format_exc())
        self.control.send("job_error", job=work.job, error=text)
        verdict = self.control.receive(timeout_s=VERDICT_TIMEOUT_S)
        if not verdict or verdict["type"] != "resume":
            os._exit(3)  # the supervisor restarts the pool and tells the client
        try:  # this machine's ranks all failed alike; so did every other machine's, or this times out
            dist.all_reduce(torch.ones(1), group=self.health)
        except Exception as lost:  # noqa: BLE001
            self._lost_world(lost)
        return Message("error", work.job, {"message": verdict["error"], "rank": verdict["rank"]})

    def _lost_world(self, error: Exception) -> NoReturn:
        """A collective failed: a peer died or its machine is gone. The supervisor restarts this rank."""
        text = f"{type(error).__name__}: {short_error(error)}"
        log.error("rank %d lost its peers: %s", self.rank, text)
        self.control.send("world_lost", error=text)
        self.control.receive(timeout_s=WORLD_LOST_WAIT_S)
        os._exit(4)


def short_error(error: Exception) -> str:
    """gloo's first sentence, without its source location: "Connection closed by peer [10.0.0.2]:4711"."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]


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
    engine("launch").die_with_parent()
    exit_at_sigterm()
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK')}] %(levelname)s %(message)s")
    engine("launch").apply_threads_per_rank()
    rank = Rank(parse_args(argv))
    try:
        rank.start()
    except Exception as error:  # noqa: BLE001 - start-up failures go to the supervisor verbatim
        # On several machines a failed collective means a node was lost: the supervisors try again.
        fatal = rank.args.nnodes == 1 or rank.phase != "world" or isinstance(error, StartRefused)
        rank.control.send("failed", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(), fatal=fatal)
        time.sleep(0.5)
        return 1
    rank.loop()
    rank.heartbeat.stop()
    if rank.server:
        rank.server.close()
    rank.control.send("stopped")
    rank.context.destroy(linger=2000)  # delivers "stopped"
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter teardown (torch, gloo) is slow; a SIGTERM from the supervisor during it would kill the rank
    # with the default action, which torchrun reports as a failure with its traceback.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
