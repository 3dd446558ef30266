"""`--layout auto`'s cost model: one rank's seconds per denoising step under a layout, from the job's sizes, the
synthetic blocks' measured times and the links (choice.py measures them; bench/link_table.py prices GPUs with it).

What each method does per step on one rank (as bench/analytic.py counts it):
- compute: the transformer's blocks, each timed as a synthetic block of the model's width (QKV and output
  projections, a 4× MLP, attention over the heads this rank keeps) on the tokens this rank holds, the queries
  it attends with and the keys it attends to, in as many pieces as Ring attends them (one per ring rank, merged
  by log-sum-exp); times the guidance branches and samples the rank runs;
- Ulysses: two all-to-alls per attention layer (Q/K/V stacked, then the output), plus the gather of the text's
  heads where the text stays replicated; Ring: its ranks − 1 K/V exchanges per layer; both: the output gather;
  what the overlap hides of them is taken off (overlap.py: the head groups chosen, Ring's prefetch, against the
  attention's share of the block, by multiply-accumulates);
- CFG parallel: one gather of the noise prediction; data parallel: the batch split;
- PipeFusion: its warm-up steps run the stages one after the other; later steps stream the text patch (where the
  model has a text stream) and M image patches through P stages: a step's longest chain is every patch on one
  stage and the largest patch on each other stage, with a hand-over per patch; the last stage broadcasts the output.
  Where the patches flow across steps, the other stages' share of the chain is paid once per run (fill and drain).
Each message costs the link's latency plus bytes over its bandwidth (all-to-all for collectives, a pairwise
exchange for point-to-point).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from .config import Link, ParallelConfig
from .overlap import AttentionLayer, head_groups

STAND_IN = 1  # a PipeFusion patch's tokens of the stream it does not carry (PipeFusionPlan.stand_in), priced at most

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
    config: ParallelConfig  # with the Ulysses head groups it was priced with (None where there are none)
    step_s: float
    compute_s: float
    comm_s: float  # what the compute does not hide
    bytes_per_step: float
    hidden_s: float = 0.0  # the communication hidden behind attention (head groups, Ring's prefetch)

    def row(self) -> dict:
        return {"layout": self.config.describe(), "head_groups": self.config.ulysses_overlap_groups,
                "step_s": self.step_s, "compute_s": self.compute_s, "comm_s": self.comm_s, "hidden_s": self.hidden_s,
                "bytes_per_step": self.bytes_per_step}


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

    def traffic(tokens: float, attention_s: float = 0.0, groups: int | None = 1) -> tuple[float, float, float, int]:
        """(seconds not hidden, seconds hidden, bytes, head groups) of one attention layer's sequence-parallel traffic
        on `tokens` sharded tokens, beside `attention_s` of its attention with the heads in `groups` (None: the
        count that pays, overlap.py)."""
        ulysses = 4 * tokens / n * hd * e * (u - 1) / u if u > 1 else 0.0
        replicated = u > 1 and tokens == i and t and p == 1 and not _text_sharded(config, job)
        text = t * (hd // u) * e * (u - 1) if replicated else 0.0  # the text heads' gather: nothing hides it
        exchange = 2 * tokens / r * (hd // u) * e if r > 1 else 0.0
        layer = AttentionLayer(attention_s, 0.75 * ulysses, 0.25 * ulysses, r, exchange)
        groups = layer.best_groups(job.heads // u, collective, p2p) if groups is None else groups
        serial, overlapped = layer.serial_seconds(collective, p2p), layer.seconds(groups, collective, p2p)
        visible = overlapped - attention_s + (collective.seconds(text) if text else 0.0)
        return visible, serial - overlapped, ulysses + text + exchange * (r - 1), groups

    gather = i / n * job.out_channels * e * (n - 1) if n > 1 else 0.0
    cfg = i * job.out_channels * e * (config.cfg_degree - 1)
    blocks = {shape: seconds * job.block_scale for shape, seconds in blocks.items()}
    hidden = 0.0
    if p == 1:
        shape = block_shapes(config, job)[0]
        compute = samples * job.blocks * blocks[shape]
        setting = config.ulysses_overlap_groups
        groups = 1 if u == 1 else None if setting is None else head_groups(job.heads // u, setting)
        seconds, hidden, nbytes, groups = traffic(sharded, blocks[shape] * attention_share(shape, job), groups)
        config = replace(config, ulysses_overlap_groups=groups) if u > 1 else config
        hidden *= samples * job.blocks
        comm_s = samples * (job.blocks * seconds + (collective.seconds(gather) if gather else 0.0))
        comm_bytes = samples * (job.blocks * nbytes + gather)
    else:
        patch_shape, whole_shape, *text_shape = block_shapes(config, job)
        m, stage_blocks = config.patches, job.blocks / p
        hand_over = (i / (m * n) + min(t, STAND_IN)) * d * e  # a patch of image tokens (and a stand-in text token)
        patch_seconds, _, patch_bytes, _ = traffic(i / m)  # PipeFusion's Ulysses: one head group (usp.py)
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
        whole_seconds, _, _, _ = traffic(i)
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
    return Prediction(config, compute + comm_s, compute, comm_s, comm_bytes + cfg, hidden)


def attention_share(shape: BlockShape, job: Job) -> float:
    """The attention's share of a synthetic block's time, by multiply-accumulates: QKᵀ and PV against the
    projections and the 4× MLP (choice.measure_blocks), the compute Ulysses' head groups and Ring's prefetch
    can hide traffic behind."""
    tokens, queries, keys, heads, _ = shape
    linear = tokens * job.hidden * (4 * job.heads * job.head_dim + 8 * job.hidden)
    attention = 2 * queries * keys * heads * job.head_dim
    return attention / (linear + attention)


def candidate_layouts(world: int, base: ParallelConfig) -> list[ParallelConfig]:
    """Every dp × cfg × pp × ring × ulysses factorisation of `world` (cfg at most 2), with `base`'s other settings."""
    layouts = []
    for dp, cfg, pp, ring in itertools.product(range(1, world + 1), (1, 2), range(1, world + 1), range(1, world + 1)):
        rest = dp * cfg * pp * ring
        if world % rest == 0:
            layouts.append(replace(base, dp_degree=dp, cfg_degree=cfg, pipefusion_degree=pp, ring_degree=ring,
                                   ulysses_degree=world // rest, num_patches=None))
    return layouts
