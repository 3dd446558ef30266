"""How every rank runs a job it was given (work.py): sample, decode or one model call, streaming steps and
obeying cancels.

At every step boundary, and inside a step between transformer blocks (CancelPoints), rank 0 decides whether
the job goes on and broadcasts that decision, so all ranks stop at the same point.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..engine import engine
from ..wire.messages import Step, Submit
from ..wire.protocol import Message
from .conditioning import RankConditioning
from .memory import PeakMemory

log = logging.getLogger("xdit.jobs")
PREVIEW_SIDE = 64  # latent pixels per side in step previews
CHECK_EVERY_S = 0.5  # inside a step, the ranks ask rank 0 about a cancel about this often


class JobCancelled(Exception):
    def __init__(self, step: int):
        super().__init__(f"cancelled at step {step}")
        self.step = step


def preview_of(latents: torch.Tensor) -> torch.Tensor:
    """A small copy of the first sample for live previews (image latents pooled to ≤ PREVIEW_SIDE), pooled
    where the latents are; on a GPU its copy to the host is queued, not waited for (StepMessages)."""
    sample = latents[:1].detach().float()
    if sample.ndim == 4 and max(sample.shape[-2:]) > PREVIEW_SIDE:
        factor = math.ceil(max(sample.shape[-2:]) / PREVIEW_SIDE)
        sample = F.avg_pool2d(sample, factor, ceil_mode=True)
    if sample.device.type != "cuda":
        return sample.cpu()
    host = torch.empty(sample.shape, dtype=sample.dtype, pin_memory=True)
    return host.copy_(sample, non_blocking=True)


class StepMessages:
    """Rank 0's step messages of one job. A message with a preview from a GPU goes out at the next step (or
    at the job's end), once its queued copy is done: waiting for the copy at once would stall the GPU's queue
    at every step (measured on an H100: +13 % step time for previews)."""

    def __init__(self, send):
        self.send, self.pending = send, None

    def step(self, message: Message, latents: torch.Tensor | None) -> None:
        self.flush()
        if latents is not None:
            message.tensors["preview"] = preview_of(latents)
            if latents.device.type == "cuda":
                self.pending = (message, torch.cuda.Event())
                self.pending[1].record()
                return
        self.send(message)

    def flush(self) -> None:
        if self.pending is not None:
            message, copied = self.pending
            self.pending = None
            copied.synchronize()
            self.send(message)


class CancelPoints:
    """Where every rank learns from rank 0 whether the job is cancelled: at each step's end (`step_ended`)
    and, inside a step, before every `every`-th transformer block, so a cancel or a stop takes effect within
    about CHECK_EVERY_S even when one step takes minutes. `every` starts at 1 and is reset at each step's end
    from rank 0's measured time per block, sent with the decision, so every rank checks at the same blocks.
    Only where every rank runs the same blocks in the same order: not under PipeFusion, whose stages run apart,
    their patches flowing across steps. There (`lagged`) a step's decision travels while the next step runs and
    every rank acts on it at the next step's end, so no stage waits for another at a step's end (a cancel lands
    one step later).
    """

    def __init__(self, transformers: list[torch.nn.Module], cancelled, group, rank: int, inside_steps: bool,
                 lagged: bool = False):
        self.cancelled, self.group, self.rank = cancelled, group, rank
        self.every, self.blocks, self.step_started = 1, 0, time.perf_counter()
        self.lagged = lagged
        self._travelling: tuple[dist.Work, torch.Tensor] | None = None  # lagged: the last step's decision
        blocks = engine("loading.weight_sharding").transformer_blocks
        # prepend: before FSDP2's own pre-forward, so a cancel never leaves a block's weights gathered
        self._hooks = [block.register_forward_pre_hook(self._before_block, prepend=True)
                       for transformer in (transformers if inside_steps else []) for block in blocks(transformer)]

    def _decide(self, every: int = 0) -> tuple[bool, int]:
        decision = torch.tensor([int(self.rank == 0 and self.cancelled()), every], dtype=torch.int64)
        if not self.lagged:
            dist.broadcast(decision, src=0, group=self.group)
            return bool(decision[0]), int(decision[1])
        arrived, self._travelling = self._travelling, (dist.broadcast(decision, src=0, group=self.group, async_op=True), decision)
        if arrived is None:
            return False, every
        arrived[0].wait()
        return bool(arrived[1][0]), int(arrived[1][1])

    def _before_block(self, module, args) -> None:
        self.blocks += 1
        if self.blocks % self.every == 0 and self._decide()[0]:
            raise JobCancelled(-1)

    def step_ended(self) -> bool:
        """True when the job is cancelled; else the next step's check interval is agreed on."""
        seconds = time.perf_counter() - self.step_started
        every = max(1, int(self.blocks * CHECK_EVERY_S / seconds)) if self.blocks and seconds > 0 else 1
        cancel, self.every = self._decide(every)
        self.blocks, self.step_started = 0, time.perf_counter()
        return cancel

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._travelling is not None:  # every rank ends the collective it began
            self._travelling[0].wait()
            self._travelling = None


def _outcome(report) -> dict[str, Any] | None:
    """A step cache's report as a Result carries it: its method, full and cached model calls."""
    if report is None:
        return None
    return {"method": report.settings.method, "full": report.full, "cached": report.cached, "text": report.describe()}


class JobRunner:
    """Runs sampling jobs on the wrapped pipeline; rank 0 also talks to clients through `server`."""

    def __init__(self, pipeline, group: dist.ProcessGroup | None, server=None, cancel_inside_steps: bool = True):
        self.pipeline, self.group, self.server = pipeline, group, server
        self.cancel_inside_steps = cancel_inside_steps
        self.rank = dist.get_rank()
        self.step = 0  # the running job's last finished step, for status
        self.call_every = 1  # model calls: blocks between cancel checks, agreed after each call
        self.conditioning = RankConditioning()  # model calls: this rank's copy of their conditioning, by key
        self._placed = None  # (transformer, its device, its dtype)

    def for_family(self, submit: Submit) -> Submit:
        """The job with its call map checked against what this pipeline's family declares."""
        return submit.for_family(self.pipeline.call_parameters, type(self.pipeline.module).__name__)

    def cache_outcome(self) -> dict[str, Any] | None:
        """What the last job reports beside its latents: the step cache's full and cached model calls."""
        return _outcome(self.pipeline.cache_report)

    def prepare(self, submit: Submit, tensors: dict[str, torch.Tensor],
                check_layout: bool = True) -> tuple[dict[str, Any], int, int] | None:
        """Rank 0, at submit: the pipeline's own checks, once; `run` reuses the result. Without `check_layout` (the
        layout is chosen when the job runs): the checks of the inputs alone, and None."""
        kwargs = submit.pipeline_kwargs(tensors)
        kwargs.pop("init_latents", None)
        prepared = self.pipeline.prepare(kwargs, check_layout)
        return prepared if check_layout else None

    def run(self, work: Message, client: bytes | None,
            prepared: tuple[dict[str, Any], int, int] | None = None) -> dict[str, torch.Tensor]:
        """Sample `work` (a Submit); `prepared`: what `prepare` returned for it on this rank, if it ran here. Returns
        the latents and what the pipeline returns beside them under its names (LTX-2: `audio`)."""
        request: Submit = work.body
        device, dtype = self._placement()
        inputs = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in work.tensors.items()}
        started = time.perf_counter()
        total = request.steps
        preview = request.preview
        messages = StepMessages(lambda message: self.server.send(client, message))

        self.step = 0
        points = CancelPoints(self._transformers(), lambda: self.server.is_cancelled(work.job), self.group, self.rank,
                              self.cancel_inside_steps, lagged=not self.cancel_inside_steps)

        def on_step(index: int, latents: torch.Tensor) -> None:
            self.step = index + 1
            cancelled = points.step_ended()
            if self.rank == 0 and not cancelled:
                step = Step(index=index + 1, total=total, elapsed=time.perf_counter() - started)
                messages.step(Message.of(step, work.job), latents if preview else None)
            if cancelled:
                raise JobCancelled(index + 1)

        kwargs = request.pipeline_kwargs(inputs)
        if request.model_latents:
            kwargs = self.pipeline.from_model_latents(kwargs)
        init_latents = kwargs.pop("init_latents", None)
        if init_latents is not None:
            kwargs = self.pipeline.partial_denoise(kwargs, init_latents, request.denoise)
        try:
            output = self.pipeline(**kwargs, output_type="latent", return_dict=False, step_callback=on_step,
                                   prepared=prepared)
            messages.flush()
            outputs = {"latents": output[0], **dict(zip(self.pipeline.extra_outputs, output[1:]))}
            return self.pipeline.model_outputs(outputs) if request.model_latents else outputs
        except JobCancelled as cancelled:
            raise JobCancelled(self.step if cancelled.step < 0 else cancelled.step) from None
        finally:
            points.close()

    def evaluate(self, work: Message) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """One model call (model_call.py): its named predictions, cancellable between transformer blocks like a step,
        and, with a step cache (call_cache.py), its sampling run's full and cached calls so far."""
        tensors = self.conditioning.on_device(work.body.conditioning, work.tensors, *self._placement())
        points = CancelPoints(self._transformers(), lambda: self.server.is_cancelled(work.job), self.group, self.rank,
                              self.cancel_inside_steps)
        points.every = self.call_every
        model_call = engine("model_executor.model_call")
        transformer = model_call.expert_of(self.pipeline, work.body.expert)
        try:
            with engine("model_executor.call_cache").call_cache(transformer, work.body.cache) as report:
                predictions = model_call.evaluate(self.pipeline, tensors, work.body.expert)
            if points.step_ended():
                raise JobCancelled(0)
            self.call_every = points.every
            return predictions, _outcome(report)
        except JobCancelled:
            raise JobCancelled(0) from None
        finally:
            points.close()

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """The transformer's device and compute dtype, looked up once per transformer: diffusers' own
        `device` walks every module, a millisecond per model call."""
        transformer = self.pipeline.module.transformer
        if self._placed is None or self._placed[0] is not transformer:
            self._placed = (transformer, transformer.device, transformer.dtype)
        return self._placed[1], self._placed[2]

    def _transformers(self) -> list[torch.nn.Module]:
        return [wrapped.module for wrapped in self.pipeline.transformers()]

    def decode(self, work: Message, client: bytes | None) -> tuple[dict[str, torch.Tensor], int, tuple[dict, ...]]:
        """Decode the work's latents with the pipeline's VAE, its tiles over every rank (parallel/model_executor/vae_decode.py),
        and its audio latents with the pipeline's audio VAE and vocoder on rank 0, each as the pipeline's own decode takes
        them (the wrapper's to_vae_latents, decode_audio); rank 0 returns the image and the
        waveforms ({"images", "audio"}, as given), and, per rank, the tiles it decoded and its peak memory above its
        resting one."""
        decoded, tensors = {}, dict(work.tensors)
        if work.body.model_latents:  # the loop's space: the pipeline's own conversion to its VAEs' (every rank alike)
            given = self.pipeline.from_model_latents({"latents": tensors.get("latents"), "audio_latents": tensors.get("audio")})
            tensors = {name: given[key] for name, key in (("latents", "latents"), ("audio", "audio_latents"))
                       if name in tensors}
        if "audio" in tensors and dist.get_rank() == 0:
            decoded["audio"] = self.pipeline.decode_audio(tensors["audio"])
        if "latents" not in tensors:
            return decoded, 0, ()
        vae_decode = engine("model_executor.vae_decode")
        vae = self.pipeline.module.vae
        latents = self.pipeline.to_vae_latents(tensors["latents"].to(vae.device, vae.dtype))
        rank, world = dist.get_rank(), dist.get_world_size()
        tiles = vae_decode.fit_tiles(vae, latents, world, work.body.tile)
        started = time.perf_counter()

        def on_tile(tile: int) -> None:  # rank 0's tiles start about when the others' of that round do
            step = Step(index=min(tile + world, tiles), total=tiles, elapsed=time.perf_counter() - started)
            self.server.send(client, Message.of(step, work.job))

        with PeakMemory() as peak:
            image = vae_decode.tiled_decode(vae, latents, rank, world, on_tile=on_tile if rank == 0 else None)
        if image is not None:
            decoded["images"] = self.pipeline.from_vae_sample(image)
        mine = len(range(rank, tiles, world))
        flat = torch.tensor([mine, peak.bytes], dtype=torch.int64)
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat, group=self.group)
        ranks = tuple({"rank": r, "tiles": int(t[0]), "peak_bytes": int(t[1])} for r, t in enumerate(every))
        return decoded, tiles, ranks
