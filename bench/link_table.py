"""Which layout wins where: `--layout auto`'s model, priced for GPUs that are not here.

    python -m bench.link_table [--tflops 400] [--json OUT.json]
    python -m bench.link_table --measure [--blocks BLOCKS.json] [--json OUT.json]    # on one GPU: calibrated
    python -m bench.link_table --blocks BLOCKS.json                                  # from saved measurements

For FLUX.1-dev at 1024² and Wan 2.2 A14B at 720p (81 frames), on 2, 4 and 8 GPUs joined by NVLink, PCIe 4.0 ×16,
25 GbE or 10 GbE (parallel/layout/config.py's published bandwidths and latencies), every valid dp × cfg × pp × ring ×
ulysses layout is predicted with parallel/layout/prediction.py's `predict` — the bytes each method sends per step
(the counts the benchmarks check against the wire to the byte) over the link, and the blocks' compute priced
from their multiply-accumulates at `--tflops` (dense bf16 that a GPU sustains; attention in several pieces 3%
dearer, as measured ones are). Each cell is the fastest layout, its predicted time per step and its speed-up over
one GPU. What overlapping hides is taken off (parallel/layout/overlap.py: Ulysses' head groups where they pay,
Ring's prefetch, behind the attention's share of the blocks). A model, not a measurement: what it leaves out
(kernel efficiency at small shapes, the time outside the blocks) is why `--layout auto` measures its own machine.

`--measure` calibrates the compute on this machine's GPU instead of `--tflops`: every block shape any cell needs
is timed as `--layout auto` times it (parallel/layout/probes.measure_blocks: the model's width, its projections, 4× MLP and
attention in the pieces Ring merges, bf16), on one GPU, and the times are saved (`--blocks`, default
bench/link_table_blocks.json) with the card's name, next to the predictions made from them; `--blocks FILE`
alone predicts again from a saved file. The links stay the published ones (parallel/layout/config.py's LINKS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parallel.layout.config import LINKS, Link, ParallelConfig
from parallel.layout.prediction import BlockShape, Job, block_shapes, candidate_layouts, predict

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


def layouts_of(job: Job, gpus: int) -> list[ParallelConfig]:
    return [c for c in candidate_layouts(gpus, ParallelConfig(warmup_steps=1)) if valid(c, job)]


def shapes_of(job: Job) -> list[BlockShape]:
    """Every block shape a cell of `job` prices (one GPU's included), in a fixed order."""
    configs = [ParallelConfig(), *(c for gpus in GPUS for c in layouts_of(job, gpus))]
    return list(dict.fromkeys(s for c in configs for s in block_shapes(c, job)))


def winners(job: Job, flops: float, gpus: int, link: Link, measured: dict[BlockShape, float] | None = None
            ) -> tuple[ParallelConfig, float, float]:
    """(the fastest layout, its seconds per step, one GPU's seconds per step); the blocks `measured` (seconds per
    shape) or priced at `flops`."""
    layouts = layouts_of(job, gpus)
    single = ParallelConfig()
    shapes = {s for c in [*layouts, single] for s in block_shapes(c, job)}
    blocks = {s: measured[s] if measured is not None else block_seconds(s, job, flops) for s in shapes}
    best = min((predict(c, job, blocks, link, link) for c in layouts), key=lambda p: p.step_s)
    return best.config, best.step_s, predict(single, job, blocks, link, link).step_s


def measure(path: Path) -> dict:
    """Time every block shape of every job on this machine's GPU in bf16 and save them with the card's name."""
    import torch

    from parallel.layout.probes import measure_blocks

    if not torch.cuda.is_available():
        print("error: --measure times the blocks on a CUDA GPU and this machine has none; use --tflops or --blocks "
              "FILE (saved by --measure on a GPU)", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda", 0)
    saved = {"device": torch.cuda.get_device_name(device), "dtype": "bf16", "torch": torch.__version__, "jobs": {}}
    for name, job in JOBS.items():
        shapes = shapes_of(job)
        times = measure_blocks(shapes, job, device, torch.bfloat16)
        saved["jobs"][name] = [[*shape, times[shape]] for shape in shapes]
        torch.cuda.empty_cache()
    path.write_text(json.dumps(saved, indent=1))
    return saved


def load_blocks(saved: dict) -> dict[str, dict[BlockShape, float]]:
    return {name: {tuple(row[:5]): row[5] for row in rows} for name, rows in saved["jobs"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.link_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tflops", type=float, default=400.0, help="dense bf16 TFLOP/s a GPU sustains (H100: ~400)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--measure", action="store_true", help="time the blocks on this machine's GPU instead of --tflops")
    parser.add_argument("--blocks", type=Path, default=None,
                        help="measured block times: where --measure saves them (default bench/link_table_blocks.json), "
                             "or, without --measure, the file to predict from")
    args = parser.parse_args(argv)
    saved = None
    if args.measure:
        saved = measure(args.blocks or Path("bench/link_table_blocks.json"))
    elif args.blocks:
        saved = json.loads(args.blocks.read_text())
    measured = load_blocks(saved) if saved else {}
    links = ("nvlink", "pcie4", "25gbe", "10gbe")
    rows = []
    compute = f"blocks measured on {saved['device']}" if saved else f"{args.tflops:g} TFLOP/s each"
    print(f"| model, GPUs ({compute}) | " + " | ".join(links) + " |")
    print("|---|" + "---|" * len(links))
    for name, job in JOBS.items():
        for gpus in GPUS:
            cells = []
            for link in links:
                config, seconds, single = winners(job, args.tflops * 1e12, gpus, Link(*LINKS[link]), measured.get(name))
                rows.append({"model": name, "gpus": gpus, "link": link, "layout": config.describe(),
                             "step_ms": 1000 * seconds, "speedup": single / seconds})
                cells.append(f"{config.describe()}: {1000 * seconds:.0f} ms, {single / seconds:.1f}×")
            print(f"| {name}, {gpus} | " + " | ".join(cells) + " |")
    if args.json:
        source = {"blocks_measured_on": saved["device"]} if saved else {"tflops": args.tflops}
        args.json.write_text(json.dumps({**source, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
