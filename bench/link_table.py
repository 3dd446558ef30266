"""Which layout wins where: `--layout auto`'s model, priced for GPUs that are not here.

    python -m bench.link_table [--tflops 400] [--json OUT.json]

For FLUX.1-dev at 1024² and Wan 2.2 A14B at 720p (81 frames), on 2, 4 and 8 GPUs joined by NVLink, PCIe 4.0 ×16,
25 GbE or 10 GbE (parallel/layout/config.py's published bandwidths and latencies), every valid dp × cfg × pp × ring ×
ulysses layout is predicted with parallel/layout/choice.py's `predict` — the bytes each method sends per step
(the counts the benchmarks check against the wire to the byte) over the link, and the blocks' compute priced
from their multiply-accumulates at `--tflops` (dense bf16 that a GPU sustains; attention in several pieces 3%
dearer, as measured ones are). Each cell is the fastest layout, its predicted time per step and its speed-up over
one GPU. A model, not a measurement: what it leaves out (kernel efficiency at small shapes, overlap of
communication with compute, the time outside the blocks) is why `--layout auto` measures its own machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parallel.layout.config import LINKS, Link, ParallelConfig
from parallel.layout.choice import BlockShape, Job, block_shapes, candidate_layouts, predict

JOBS = {
    # 1024² → 64 × 64 packed tokens; 512 T5 tokens joined with them; 19 double + 38 single blocks; guidance-distilled
    "FLUX.1-dev 1024²": Job(image_tokens=4096, text_tokens=512, text_splits=True, heads=24, head_dim=128, hidden=3072,
                            blocks=57, out_channels=64, element_bytes=2, batch=1, steps=28, branches=1, flows=True),
    # 81 frames 1280×720 → 21 × 90 × 160 latents → 21 × 45 × 80 tokens (patch 1×2×2); the text stays in the
    # blocks' cross-attention (no joint text); 40 blocks of width 5120; CFG (two branches); 16 channels × 4 per token
    "Wan 2.2 A14B 720p": Job(image_tokens=21 * 45 * 80, text_tokens=0, text_splits=True, heads=40, head_dim=128,
                             hidden=5120, blocks=40, out_channels=64, element_bytes=2, batch=1, steps=40, branches=2),
}
GPUS = (2, 4, 8)


def block_seconds(shape: BlockShape, job: Job, flops: float) -> float:
    """One block on `shape`: its projections and 4× MLP (12·hidden² per token) and its attention, at `flops`."""
    tokens, queries, keys, heads, pieces = shape
    linear = 12 * job.hidden * job.hidden * tokens
    attention = 2 * queries * keys * heads * job.head_dim * (1.03 if pieces > 1 else 1.0)
    return 2 * (linear + attention) / flops


def valid(config: ParallelConfig, job: Job) -> bool:
    """What the engine would accept for this job: heads split over Ulysses, a sample per dp rank, CFG only with
    guidance, at least one block per stage."""
    return (job.heads % config.ulysses_degree == 0 and config.dp_degree <= job.batch
            and config.cfg_degree <= job.branches and config.pipefusion_degree <= job.blocks)


def winners(job: Job, flops: float, gpus: int, link: Link) -> tuple[ParallelConfig, float, float]:
    """(the fastest layout, its seconds per step, one GPU's seconds per step)."""
    layouts = [c for c in candidate_layouts(gpus, ParallelConfig(warmup_steps=1)) if valid(c, job)]
    single = ParallelConfig()
    shapes = {s for c in [*layouts, single] for s in block_shapes(c, job)}
    blocks = {s: block_seconds(s, job, flops) for s in shapes}
    best = min((predict(c, job, blocks, link, link) for c in layouts), key=lambda p: p.step_s)
    return best.config, best.step_s, predict(single, job, blocks, link, link).step_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.link_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tflops", type=float, default=400.0, help="dense bf16 TFLOP/s a GPU sustains (H100: ~400)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    links = ("nvlink", "pcie4", "25gbe", "10gbe")
    rows = []
    print(f"| model, GPUs ({args.tflops:g} TFLOP/s each) | " + " | ".join(links) + " |")
    print("|---|" + "---|" * len(links))
    for name, job in JOBS.items():
        for gpus in GPUS:
            cells = []
            for link in links:
                config, seconds, single = winners(job, args.tflops * 1e12, gpus, Link(*LINKS[link]))
                rows.append({"model": name, "gpus": gpus, "link": link, "layout": config.describe(),
                             "step_ms": 1000 * seconds, "speedup": single / seconds})
                cells.append(f"{config.describe()}: {1000 * seconds:.0f} ms, {single / seconds:.1f}×")
            print(f"| {name}, {gpus} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"tflops": args.tflops, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
