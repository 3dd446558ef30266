"""What `--layout auto` measures on this machine: the synthetic blocks, the links through the engine's own
collectives, and one real step of the job (which calibrates the blocks against the model's and gives the time
outside them). Every rank measures at once (the contention of a real run); the slowest rank's numbers are shared,
so that every rank predicts alike.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from .config import Link
from .prediction import BlockShape, Job
from ..model_executor.attention.kernels import default_scale, pick_kernel
from ..model_executor.attention.usp import merge_partial

PROBE_BYTES = (1 << 14, 1 << 23)  # a small message (latency) and a large one (bandwidth)


def _median_seconds(run, repeats: int = 3, barrier: bool = False) -> float:
    """The median time of `run` after a warm-up; with `barrier`, every rank starts each try together."""
    run()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_blocks(shapes: list[BlockShape], job: Job, device, dtype,
                   attention_kernel: str | None = None) -> dict[BlockShape, float]:
    """Seconds of one synthetic block (the model's width, QKV + output projections, 4× MLP, attention in pieces
    merged by log-sum-exp as Ring does) per shape."""
    d, hd, head_dim = job.hidden, job.heads * job.head_dim, job.head_dim
    g = torch.Generator(device="cpu").manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / math.sqrt(rows)).to(device, dtype)

    qkv, out, up, down = weight(d, 3 * hd), weight(hd, d), weight(d, 4 * d), weight(4 * d, d)
    probe = torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype)
    kernel, scale = pick_kernel(probe, attention_kernel), default_scale(probe)
    times = {}
    for shape in dict.fromkeys(shapes):
        tokens, queries, keys, heads, pieces = shape
        x = torch.randn(1, tokens, d, generator=g).to(device, dtype)
        q = torch.randn(1, heads, queries, head_dim, generator=g).to(device, dtype)
        kv = torch.randn(2, 1, heads, keys, head_dim, generator=g).to(device, dtype)
        a = torch.randn(1, tokens, hd, generator=g).to(device, dtype)

        def block(x=x, q=q, kv=kv, a=a, pieces=pieces):
            x @ qkv
            out_, lse = None, None
            for k, v in zip(kv[0].chunk(pieces, dim=2), kv[1].chunk(pieces, dim=2)):  # as ring_attention does
                part, part_lse = kernel(q, k, v, scale)
                out_, lse = (part.float(), part_lse) if out_ is None else merge_partial(out_, lse, part, part_lse)
            a @ out
            torch.nn.functional.gelu(x @ up) @ down

        with torch.no_grad():
            times[shape] = _median_seconds(block)
    return times


def measure_links(device) -> tuple[Link, Link]:
    """The world's all-to-all and ring-exchange links as the engine's own collectives run them (their copies and
    allocations included): Q/K/V-shaped tensors scattered over heads and gathered over tokens, and K/V blocks
    passed to the next rank; latency and bandwidth from a small and a large message."""
    from ..distributed import get_world_group

    world = get_world_group()

    def tensor(parts: int, nbytes: int) -> torch.Tensor:  # [parts, 1, heads, tokens, 64] in fp32
        heads = 2 * world.world_size
        return torch.zeros(parts, 1, heads, max(1, nbytes // (parts * heads * 64 * 4)), 64, device=device)

    def all_to_all(nbytes: int):
        x = tensor(3, nbytes)
        return lambda: world.all_to_all(x, scatter_dim=2, gather_dim=3), x.nbytes * (world.world_size - 1) / world.world_size

    def exchange(nbytes: int):
        x = tensor(2, nbytes)

        def run():
            for work in world.ring_exchange(x)[1]:
                work.wait()
        return run, x.nbytes

    links = []
    for make in (all_to_all, exchange):
        (small, small_bytes), (large, large_bytes) = [
            (_median_seconds(run, repeats=5, barrier=True), sent) for run, sent in (make(b) for b in PROBE_BYTES)]
        rate = (large_bytes - small_bytes) / max(large - small, 1e-9)
        links.append(Link(rate, max(small - small_bytes / rate, 0.0)))
    return links[0], links[1]


def slowest(seconds: list[float], links: tuple[Link, Link], device) -> tuple[list[float], tuple[Link, Link]]:
    """The slowest rank's block times and links (the longest times and latencies, the lowest bandwidths), the same
    on every rank so that every rank predicts alike."""
    values = seconds + [v for link in links for v in (-link.bytes_per_s, link.latency_s)]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    values = tensor.tolist()
    tail = values[len(seconds):]
    return values[: len(seconds)], (Link(-tail[0], tail[1]), Link(-tail[2], tail[3]))


def measure_serial_step(wrapped, kwargs: dict, blocks: list[torch.nn.Module]) -> tuple[float, float]:
    """(seconds inside the transformer's blocks, seconds outside them) of one step of this job on this rank, the
    pipeline's own loop without any parallel hook: the second of a two-step run (the first pays the warm-up;
    some pipelines take another path for a single step)."""
    from ..model_executor.pipeline.img2img import SCHEDULE_TAIL_OF
    from ..request import STEP_CACHE

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    inside, started, marks = [0.0], {}, []

    def enter(module, args):
        sync()
        started[id(module)] = time.perf_counter()

    def leave(module, args, output):
        sync()
        inside[0] += time.perf_counter() - started[id(module)]

    def step_done(index, latents):
        sync()
        marks.append((time.perf_counter(), inside[0]))

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    arguments = {k: v for k, v in kwargs.items() if k not in (STEP_CACHE, SCHEDULE_TAIL_OF)}
    callback_arguments, after_step = wrapped.step_callbacks(step_done)
    arguments.update(num_inference_steps=2, output_type="latent", return_dict=False, **callback_arguments)
    try:
        with torch.no_grad(), after_step, wrapped.call_context(arguments):  # a family's may take inputs out or convert them
            wrapped.run_pipeline(arguments)
    finally:
        for handle in handles:
            handle.remove()
    (first, first_inside), (last, last_inside) = marks[-2:]
    return last_inside - first_inside, (last - first) - (last_inside - first_inside)
