"""The job loop every rank runs after start-up: rank 0 takes the next job from its server, every rank runs it
(work.py), rank 0 answers the client.

A job that fails on every rank alike is answered and the loop goes on; a rank that fails alone is reported to
the supervisor, which restarts the pool. Between jobs rank 0 sends a probe every second (an all-reduce with a
short timeout), so a lost peer, on this machine or another, is noticed while idle too; a rank whose
collectives fail reports `world_lost` and waits for its supervisor to restart it.
"""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from ..engine import engine
from ..wire import control
from ..wire.messages import Cancelled, Error, Result
from ..wire.protocol import Message
from .memory import PeakMemory
from .runner import JobCancelled
from .status import take_census
from .work import ModelCall, Probe, Shutdown, broadcast_work

if TYPE_CHECKING:
    from .process import Rank

log = logging.getLogger("xdit.rank")
VERDICT_TIMEOUT_S = 10.0
PROBE_EVERY_S = 1.0
CENSUS_EVERY_S = 1.0  # between model calls, the ranks gather their memory for the status at most this often
WORLD_LOST_WAIT_S = 30.0


class JobLoop:
    def __init__(self, rank: "Rank"):
        self.rank = rank

    def run(self) -> None:
        rank = self.rank
        while True:
            work, client, prepared = None, None, None
            if rank.rank == 0:
                job = rank.server.next_job(timeout_s=PROBE_EVERY_S)
                if job is False:
                    work = Message.of(Probe())
                elif job is None:
                    work = Message.of(Shutdown())
                elif job.message.type == "encode":  # rank 0 alone; the others keep waiting
                    self._encode(job)
                    continue
                elif job.message.type == "evaluate":  # its tensors: the conditioning filled in at submit
                    call = job.message.body
                    # the ranks' memory census (a collective) at most once a second, not after every call
                    census = time.monotonic() - rank.census_at >= CENSUS_EVERY_S
                    tensors = rank.runner.conditioning.to_send(call.conditioning, job.prepared)
                    work = Message.of(ModelCall(conditioning=call.conditioning, loras=call.loras, expert=call.expert,
                                                cache=call.cache, census=census), job.id, tensors)
                    client = job.client
                else:  # submit or decode: the message as the server read and checked it
                    work, client, prepared = job.message, job.client, job.prepared
                    rank.control.send(control.JobStarted(job=job.id, client=client))
            try:
                work = broadcast_work(work, rank.group)
                if work.type == Probe.TYPE:
                    dist.all_reduce(torch.ones(1), group=rank.health)
                    continue
            except Exception as error:  # noqa: BLE001 - a peer is gone; the supervisors restart the world
                self._lost_world(error)
            if work.type == Shutdown.TYPE:
                return
            self._run(work, client, prepared)

    def _encode(self, job) -> None:
        rank = self.rank
        rank.state = "busy"
        try:
            request, image = job.message.body, job.message.tensors.get("image")
            if request.seed is not None:  # a whole job's inputs: both prompts and the seed's noise
                tensors = engine("model_executor.prompt_inputs").prompt_inputs(rank.pipeline, request.prompt, request.negative_prompt,
                                                                request.seed, request.height, request.width, image)
            else:
                with torch.no_grad():
                    tensors = (rank.pipeline.encode_text(request.prompt) if image is None
                               else rank.pipeline.encode_text_with_images(request.prompt, image))
            rank.server.send(job.client, Message.of(Result(), job.id, tensors))
        except Exception as error:  # noqa: BLE001 - rank 0 alone: answer and go on
            rank.server.send(job.client, Message.of(Error(message=f"{type(error).__name__}: {error}", rank=0), job.id))
        finally:
            rank.state = "idle"
            rank.server.job_finished()

    def _run(self, work: Message, client: bytes | None, prepared=None) -> None:
        rank = self.rank
        rank.state = "busy"
        reply = None  # sent once the state says idle, so a client that asks right after sees idle
        try:
            if work.type == "decode":
                decoded, tiles, ranks = rank.runner.decode(work, client)
                rate = rank.runner.pipeline.audio_sample_rate() if "audio" in decoded else 0
                reply = Message.of(Result(tiles=tiles, ranks=ranks, sample_rate=rate), work.job, decoded)
                rank.jobs_done += 1
            elif work.type == ModelCall.TYPE:
                rank.loras.apply(work.body.loras)
                predictions, report = rank.runner.evaluate(work)
                rank.last_cache = report or rank.last_cache
                reply = Message.of(Result(cache=report), work.job, predictions)
                rank.model_calls += 1
            else:
                reply = self._sample(work, client, prepared)
        except JobCancelled as cancelled:
            reply = Message.of(Cancelled(step=cancelled.step), work.job)
        except Exception as error:  # noqa: BLE001 - any failure of the job is reported, then judged
            reply = self._job_failed(work, error)
        finally:
            rank.state = "idle"
            if rank.rank == 0:
                if reply is not None:
                    rank.server.send(client, reply)
                rank.server.job_finished()
                rank.control.send(control.JobEnded(job=work.job, jobs_done=rank.jobs_done))
        if work.type == ModelCall.TYPE and not work.body.census:
            return
        try:
            take_census(rank)
        except Exception as error:  # noqa: BLE001 - a peer is gone
            self._lost_world(error)

    def _sample(self, work: Message, client: bytes | None, prepared) -> Message:
        rank, submit = self.rank, work.body
        if rank.layouts is not None:
            self._choose_layout(work)
        if submit.scheduler != rank.scheduler_name:
            rank.pipeline.use_scheduler(engine("loading.pipelines").make_scheduler(rank.default_scheduler, submit.scheduler))
            rank.scheduler_name = submit.scheduler
        rank.loras.apply(submit.loras)
        started = time.perf_counter()
        with PeakMemory() as peak:
            outputs = rank.runner.run(work, client, prepared)
        rank.admission.record(rank.job_megapixels(submit.height, submit.width, work.tensors["latents"]), submit.steps,
                              time.perf_counter() - started, peak.bytes)
        rank.last_cache = rank.runner.cache_outcome()
        if rank.last_cache is not None and rank.rank == 0:
            log.info("job %s: %s", work.job, rank.last_cache["text"])
        rank.jobs_done += 1
        return Message.of(Result(cache=rank.last_cache), work.job, outputs)

    def _choose_layout(self, work: Message) -> None:
        """--layout auto: the layout chosen for this job's size (measured now if the size is new), wrapped."""
        rank = self.rank
        call = work.body.pipeline_kwargs(work.tensors)
        call.pop("init_latents", None)
        pipeline, made = rank.layouts.for_call(call)
        if made is not None and rank.rank == 0:
            log.info("layout auto for %s chose [%s]; predicted per step:\n  %s", made.job, made.config.describe(),
                     "\n  ".join(made.table))
        if pipeline is not rank.pipeline:
            rank.pipeline = rank.runner.pipeline = pipeline
            rank.config, rank.layout = rank.layouts.config, rank.layouts.rank_layout
            rank.runner.cancel_inside_steps = rank.config.pipefusion_degree == 1
            rank.scheduler_name = "default"  # the rewrapped pipeline samples with its own scheduler again

    def _job_failed(self, work: Message, error: Exception) -> Message:
        """Ask the supervisor whether every rank failed alike (answer and go on) or not (restart)."""
        rank = self.rank
        text = f"{type(error).__name__}: {error}"
        log.error("job %s failed on rank %d: %s", work.job, rank.rank, traceback.format_exc())
        rank.control.send(control.JobError(job=work.job, error=text))
        verdict = rank.control.receive(timeout_s=VERDICT_TIMEOUT_S)
        if not isinstance(verdict, control.Resume):
            os._exit(3)  # the supervisor restarts the pool and tells the client
        try:  # this machine's ranks all failed alike; so did every other machine's, or this times out
            dist.all_reduce(torch.ones(1), group=rank.health)
        except Exception as lost:  # noqa: BLE001
            self._lost_world(lost)
        return Message.of(Error(message=verdict.error, rank=verdict.rank), work.job)

    def _lost_world(self, error: Exception) -> NoReturn:
        """A collective failed: a peer died or its machine is gone. The supervisor restarts this rank."""
        rank = self.rank
        text = f"{type(error).__name__}: {short_error(error)}"
        log.error("rank %d lost its peers: %s", rank.rank, text)
        rank.control.send(control.WorldLost(error=text))
        rank.control.receive(timeout_s=WORLD_LOST_WAIT_S)
        os._exit(4)


def short_error(error: Exception) -> str:
    """gloo's first sentence, without its source location: "Connection closed by peer [10.0.0.2]:4711"."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
