"""`--layout auto`: measure this machine's link and compute, predict every valid layout's step time, take the fastest.

The prediction prices what each method does per denoising step on one rank (as bench/analytic.py counts it):
- compute: the transformer's blocks, each timed here as a synthetic block of the model's width (QKV and output
  projections, a 4× MLP, attention over the heads this rank keeps) on the tokens this rank holds, the queries
  it attends with and the keys it attends to, in as many pieces as Ring attends them (one per ring rank, merged
  by log-sum-exp); times the guidance branches and samples the rank runs;
- Ulysses: two all-to-alls per attention layer (Q/K/V stacked, then the output), plus the gather of the text's
  heads where the text stays replicated; Ring: its ranks − 1 K/V exchanges per layer; both: the output gather;
- CFG parallel: one gather of the noise prediction; data parallel: the batch split;
- PipeFusion: its warm-up steps run the stages one after the other; later steps stream the text patch (where the
  model has a text stream) and M image patches through P stages: a step's longest chain is every patch on one
  stage and the largest patch on each other stage, with a hand-over per patch; the last stage broadcasts the output.
  Where the patches flow across steps, the other stages' share of the chain is paid once per run (fill and drain).
Each message costs the measured latency plus bytes over the measured bandwidth (all-to-all for collectives,
a pairwise exchange for point-to-point). One step of the job itself, run as diffusers runs it on every rank at
once, calibrates the synthetic block against the model's real blocks (their ratio scales every synthetic
time) and gives the time outside the blocks (embedders, norms, the scheduler) per sample, which a rank pays
for its samples on its share of the tokens.

Every rank measures at once (the contention of a real run) and the slowest rank's numbers are shared, so all
ranks choose the same layout. `--link` replaces the measured link with a named or given one (to plan for
another machine, or to see the choice move as the link slows).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .config import LayoutError, Link, ParallelConfig
from ..model_executor.attention.kernels import default_scale, pick_kernel
from ..model_executor.attention.usp import merge_partial

STAND_IN = 1  # a PipeFusion patch's tokens of the stream it does not carry (PipeFusionPlan.stand_in), priced at most

PROBE_BYTES = (1 << 14, 1 << 23)  # a small message (latency) and a large one (bandwidth)


@dataclass(frozen=True)
class Job:
    """What the prediction needs from the model and the request."""

    image_tokens: int
    text_tokens: int
    text_splits: bool  # the plan shards the text with the image where both divide (Split.text, or one stream)
    heads: int
    head_dim: int
    hidden: int
    blocks: int
    out_channels: int
    element_bytes: int
    batch: int
    steps: int
    branches: int  # 2 with classifier-free guidance
    flows: bool = False  # PipeFusion's patches would flow across steps (pipefusion.py): no stage waits at a step's end
    block_scale: float = 1.0  # the model's real block time over the synthetic block's, on one sample
    outside_s: float = 0.0  # time per step and sample outside the blocks (embedders, norms, the scheduler)


@dataclass(frozen=True)
class Prediction:
    config: ParallelConfig
    step_s: float
    compute_s: float
    comm_s: float
    bytes_per_step: float

    def row(self) -> dict:
        return {"layout": self.config.describe(), "step_s": self.step_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "bytes_per_step": self.bytes_per_step}


# (tokens this rank holds, its queries, keys attended to, heads it keeps, pieces the keys come in)
BlockShape = tuple[int, int, int, int, int]


def block_shapes(config: ParallelConfig, job: Job) -> list[BlockShape]:
    """The synthetic block shapes a layout's compute is priced with (PipeFusion: an image patch, the whole, and
    where there is text, the text patch; a patch holds a stand-in token of the stream it does not carry)."""
    r, n = config.ring_degree, config.sp_degree
    i, t, h = job.image_tokens, job.text_tokens, job.heads // config.ulysses_degree
    if config.pipefusion_degree > 1:
        m, other = config.patches, min(t, STAND_IN)
        text_patch = [(t + n * STAND_IN, t + r * STAND_IN, i + t, h, r)] if t else []
        return [(i // (m * n) + other, i // (m * r) + other, i + t, h, r), (i // n + t, i // r + t, i + t, h, r),
                *text_patch]
    if _text_sharded(config, job):
        return [((i + t) // n, (i + t) // r, i + t, h, r)]
    return [(i // n + t, i // r + t, i + t, h, r)]


def _text_sharded(config: ParallelConfig, job: Job) -> bool:
    n = config.sp_degree
    return job.text_splits and config.pipefusion_degree == 1 and job.image_tokens % n == 0 and job.text_tokens % n == 0


def predict(config: ParallelConfig, job: Job, blocks: dict[BlockShape, float], collective: Link, p2p: Link) -> Prediction:
    """Seconds per step on one rank under `config` (see the module docstring)."""
    u, r, n, p = config.ulysses_degree, config.ring_degree, config.sp_degree, config.pipefusion_degree
    e, d, hd = job.element_bytes, job.hidden, job.heads * job.head_dim
    samples = math.ceil(job.batch / config.dp_degree) * (job.branches if config.cfg_degree == 1 else 1)
    i, t = job.image_tokens, job.text_tokens
    sharded = i + t if _text_sharded(config, job) else i

    def layer_traffic(tokens: float) -> tuple[float, float]:
        """Seconds and bytes of one attention layer's sequence-parallel traffic on `tokens` sharded tokens."""
        seconds = nbytes = 0.0
        if u > 1:
            b = 4 * tokens / n * hd * e * (u - 1) / u
            seconds, nbytes = collective.seconds(b, 2), b
            if tokens == i and t and p == 1 and not _text_sharded(config, job):
                b = t * (hd // u) * e * (u - 1)
                seconds, nbytes = seconds + collective.seconds(b), nbytes + b
        if r > 1:
            b = 2 * tokens / r * (hd // u) * e * (r - 1)
            seconds, nbytes = seconds + p2p.seconds(b, r - 1), nbytes + b
        return seconds, nbytes

    gather = i / n * job.out_channels * e * (n - 1) if n > 1 else 0.0
    cfg = i * job.out_channels * e * (config.cfg_degree - 1)
    blocks = {shape: seconds * job.block_scale for shape, seconds in blocks.items()}
    if p == 1:
        compute = samples * job.blocks * blocks[block_shapes(config, job)[0]]
        seconds, nbytes = layer_traffic(sharded)
        comm_s = samples * (job.blocks * seconds + (collective.seconds(gather) if gather else 0.0))
        comm_bytes = samples * (job.blocks * nbytes + gather)
    else:
        patch_shape, whole_shape, *text_shape = block_shapes(config, job)
        m, stage_blocks = config.patches, job.blocks / p
        hand_over = (i / (m * n) + min(t, STAND_IN)) * d * e  # a patch of image tokens (and a stand-in text token)
        patch_seconds, patch_bytes = layer_traffic(i / m)
        # (compute, communication) per patch: the text patch where there is one, and the image patches; the step's
        # longest chain runs every patch through one stage and the largest through the other stages too
        order = [(stage_blocks * blocks[text_shape[0]], p2p.seconds((t + STAND_IN) * d * e))] if t else []
        order += [(stage_blocks * blocks[patch_shape], stage_blocks * patch_seconds + p2p.seconds(hand_over))] * m
        largest = max(order, key=sum)
        warm = min(config.warmup_steps, job.steps)
        # the other stages' share of the chain: every step's, or while the patches flow, the run's fill and drain
        chained = (p - 1) / max(job.steps - warm, 1) if job.flows else p - 1
        async_compute = sum(c for c, _ in order) + chained * largest[0]
        async_comm = sum(x for _, x in order) + chained * largest[1]
        warm_compute = job.blocks * blocks[whole_shape]
        whole_seconds, whole_bytes = layer_traffic(i)
        warm_comm = job.blocks * whole_seconds + (p - 1) * p2p.seconds((i / n + t) * d * e)
        compute = samples * (warm * warm_compute + (job.steps - warm) * async_compute) / job.steps
        broadcast = i / n * job.out_channels * e * (p - 1)
        comm_s = samples * ((warm * warm_comm + (job.steps - warm) * async_comm) / job.steps
                            + collective.seconds(broadcast) + (collective.seconds(gather) if gather else 0.0))
        text_hand_over = (t + STAND_IN) * d * e if t else 0.0
        comm_bytes = samples * (m * stage_blocks * patch_bytes + m * hand_over + text_hand_over + broadcast + gather)
    comm_s += collective.seconds(cfg) if cfg else 0.0
    # outside the blocks: the rank's samples, on its share of the tokens (PipeFusion's stages each embed them all)
    compute += job.outside_s * samples / (n if p == 1 else 1)
    return Prediction(config, compute + comm_s, compute, comm_s, comm_bytes + cfg)


def candidate_layouts(world: int, base: ParallelConfig) -> list[ParallelConfig]:
    """Every dp × cfg × pp × ring × ulysses factorisation of `world` (cfg at most 2), with `base`'s other settings."""
    layouts = []
    for dp, cfg, pp, ring in itertools.product(range(1, world + 1), (1, 2), range(1, world + 1), range(1, world + 1)):
        rest = dp * cfg * pp * ring
        if world % rest == 0:
            layouts.append(replace(base, dp_degree=dp, cfg_degree=cfg, pipefusion_degree=pp, ring_degree=ring,
                                   ulysses_degree=world // rest, num_patches=None))
    return layouts


# -- measuring ------------------------------------------------------------------------------------------
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


def choose(world: int, base: ParallelConfig, job: Job, valid, device, dtype, link: Link | None = None,
           serial_step: tuple[float, float] | None = None, attention_kernel: str | None = None,
           ) -> tuple[ParallelConfig, list[Prediction], tuple[Link, Link]]:
    """The fastest predicted layout among `candidate_layouts` that `valid(config)` accepts, every prediction
    (fastest first) and the links used. `serial_step`: (seconds in the blocks, seconds outside them) of one real
    step on one rank, which calibrates the synthetic blocks. Collective: every rank calls it alike."""
    layouts = [c for c in candidate_layouts(world, base) if valid(c)]
    if not layouts:
        raise LayoutError(f"--layout auto found no layout of {world} ranks that this model and job can run")
    i, t = job.image_tokens, job.text_tokens
    serial = (i + t, i + t, i + t, job.heads, 1)
    shapes = list(dict.fromkeys([serial, *(s for c in layouts for s in block_shapes(c, job))]))
    measured = measure_blocks(shapes, job, device, dtype, attention_kernel)
    seconds, (collective, p2p) = slowest([measured[s] for s in shapes] + list(serial_step or (0.0, 0.0)),
                                         measure_links(device), device)
    blocks = dict(zip(shapes, seconds))
    if serial_step is not None:
        in_blocks, outside = seconds[-2:]
        real = in_blocks / (job.batch * job.branches * job.blocks)  # one block on one sample
        job = replace(job, block_scale=real / blocks[serial], outside_s=outside / (job.batch * job.branches))
    if link is not None:
        collective = p2p = link
    predictions = sorted((predict(c, job, blocks, collective, p2p) for c in layouts),
                         key=lambda p: (p.step_s, p.bytes_per_step))
    return predictions[0].config, predictions, (collective, p2p)


# -- the job, from a pipeline and a call ----------------------------------------------------------------------
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


def attention_module(transformer: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """The transformer's first attention layer (its heads and widths stand for every layer's) and its head count,
    which Krea 2's layers name `num_heads`."""
    return next((m, heads) for m in transformer.modules() if isinstance(getattr(m, "to_q", None), torch.nn.Linear)
                and (heads := getattr(m, "heads", None) or getattr(m, "num_heads", None)))


def auto_layout(pipeline, base: ParallelConfig, call: dict, world: int, link: Link | None = None,
                attention_kernel: str | None = None):
    """(the chosen layout, every prediction fastest first, the links used) for `call` on `pipeline`, the pipeline
    left unwrapped and no mesh built. Collective: every rank calls it alike."""
    from ..model_executor.layout_scope import under_layout
    from ..loading.weight_sharding import transformer_blocks

    provisional = ParallelConfig(dp_degree=world)
    transformer = pipeline.transformer  # diffusers' own, before the provisional wrapping
    with under_layout(pipeline, provisional) as wrapped:
        # the call as the pipeline takes it (Qwen-Image 2.1's takes no guidance_scale), checked for any layout
        kwargs, batch, image_tokens = wrapped.prepare(call, check_layout=False)
        plan = wrapped.module.transformer.plan

        def valid(config: ParallelConfig) -> bool:
            if config.pipefusion_degree > 1 and plan.pipefusion is None:
                return False
            try:
                config.check(world)
                wrapped.parallel_config = config
                wrapped.check_layout(kwargs, batch)
                return True
            except LayoutError:
                return False
            finally:
                wrapped.parallel_config = provisional

        attention, heads = attention_module(transformer)
        text = kwargs.get("prompt_embeds")
        config = transformer.config
        job = Job(
            image_tokens=image_tokens,
            text_tokens=text.shape[1] if isinstance(text, torch.Tensor) else 0,
            text_splits=plan.text_input is None or any(s.text for specs in plan.inputs.values() for s in specs.values()),
            heads=heads, head_dim=attention.to_q.out_features // heads,
            hidden=attention.to_q.in_features, blocks=len(transformer_blocks(transformer)),
            out_channels=config.get("out_channels") or config.get("in_channels") or attention.to_q.in_features,
            element_bytes=transformer.dtype.itemsize, batch=batch, steps=kwargs["num_inference_steps"],
            branches=2 if wrapped.uses_cfg(kwargs) else 1,
            flows=wrapped.patches_flow(kwargs, replace(base, pipefusion_degree=2)),
        )
        serial = measure_serial_step(wrapped, kwargs, transformer_blocks(transformer))
        return choose(world, base, job, valid, transformer.device, transformer.dtype, link, serial, attention_kernel)


def describe(predictions: list[Prediction], links: tuple[Link, Link], measured: bool) -> list[str]:
    """The prediction table, one line per layout, fastest first, after the links it used."""
    collective, p2p = links
    source = "measured" if measured else "given"
    lines = [f"links ({source}): all-to-all {collective.bytes_per_s / 1e9:.3g} GB/s + {collective.latency_s * 1e6:.3g} us, "
             f"exchange {p2p.bytes_per_s / 1e9:.3g} GB/s + {p2p.latency_s * 1e6:.3g} us"]
    for p in predictions:
        lines.append(f"{p.step_s * 1e3:10.2f} ms/step  (compute {p.compute_s * 1e3:.2f}, traffic {p.comm_s * 1e3:.2f}, "
                     f"{p.bytes_per_step / 2**20:.2f} MiB)  {p.config.describe()}")
    return lines
