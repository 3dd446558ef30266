"""The wall-time cost of `--shard-weights` on the medium Flux model: sharded vs unsharded, 1 and 2 ranks.

    python -m bench.shard_weights [--tiny] [--runs 3] [--steps 2]

One torchrun job per rank count (1 rank; Ulysses-2 on 2 ranks), one thread per rank. Each job loads the
model twice, once plain and once with its blocks sharded over the world (FSDP2), under the same layout, and
times the two interleaved round by round after an untimed warm-up round, so the ratio sharded / unsharded
comes from one run. On 1 rank the ratio is FSDP's own bookkeeping (a gather over one rank); on 2 ranks it
adds the all-gather of every block's weights before the block runs (gloo over loopback here; NCCL overlaps
it with compute on GPUs). Also reported: each rank's parameter bytes, and the largest difference between the
two outputs (the sharded run must be the unsharded one).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .model import launch_per_rank_count, model_key, parse_or_drive, side_by_side_arguments

RUNS = ("unsharded", "sharded")


def drive(spec: dict) -> None:
    from parallel.layout.config import ParallelConfig
    from parallel.distributed import initialize_model_parallel
    from parallel.model_executor import wrap_pipeline
    from parallel.loading.weight_sharding import shard_weights
    from workers.rank.memory import memory_of_this_rank

    from .model import start_drive, timed_rounds

    world, model, plain, inputs, kwargs = start_drive(spec)
    initialize_model_parallel(ParallelConfig(ulysses_degree=world.world_size))
    sharded = model.pipeline()
    shard_weights(sharded)
    pipelines = {"unsharded": wrap_pipeline(plain), "sharded": wrap_pipeline(sharded)}
    times, outputs, _ = timed_rounds(pipelines, inputs, kwargs, spec["runs"])
    parameter_bytes = {name: memory_of_this_rank(p.module.transformer.module)["parameter_bytes"] for name, p in pipelines.items()}
    if world.rank == 0:
        Path(spec["result"]).write_text(json.dumps({
            "times": times, "parameter_bytes": parameter_bytes,
            "max_abs_diff": (outputs["sharded"] - outputs["unsharded"]).abs().max().item()}))


def main(argv=None) -> int:
    parser = side_by_side_arguments("bench.shard_weights", __doc__, runs=3, steps=2)
    if (args := parse_or_drive(parser, argv, drive)) is None:
        return 0
    model = model_key(args)
    rows = {}
    raws = launch_per_rank_count("bench.shard_weights", {"model": model, "runs": args.runs, "steps": args.steps}, args.json)
    for nproc, raw in raws.items():
        median = {name: statistics.median(t) for name, t in raw["times"].items()}
        rows[nproc] = {"median_s": median, "ratio": median["sharded"] / median["unsharded"],
                       "parameter_bytes": raw["parameter_bytes"], "max_abs_diff": raw["max_abs_diff"]}
    args.json.write_text(json.dumps({"model": model, "steps": args.steps, "runs": args.runs, "rows": rows}, indent=2))
    print(f"| ranks ({model} Flux, {args.steps} steps, median of {args.runs}) | unsharded s | sharded s | "
          "sharded / unsharded | parameter MiB per rank (unsharded → sharded) | max abs Δ |")
    print("|---|---:|---:|---:|---:|---:|")
    for nproc, r in rows.items():
        mib = {k: v / 2**20 for k, v in r["parameter_bytes"].items()}
        print(f"| {nproc}{' (Ulysses-2)' if nproc > 1 else ''} | {r['median_s']['unsharded']:.2f} | "
              f"{r['median_s']['sharded']:.2f} | {r['ratio']:.3f} | {mib['unsharded']:.1f} → {mib['sharded']:.1f} | "
              f"{r['max_abs_diff']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
