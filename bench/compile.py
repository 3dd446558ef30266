"""The speed of `--compile` on the medium Flux model: compiled vs eager, 1 and 2 ranks (inductor on CPU).

    python -m bench.compile [--tiny | --large] [--runs 3] [--steps 2] [--ranks 1 2]

On a GPU each rank runs on its own device in bf16 (`--large --ranks 1` where there is one GPU).

One torchrun job per rank count (1 rank; Ulysses-2 on 2 ranks), one thread per rank. Each job loads the
model twice under the same layout, once eager and once with every transformer block compiled
(parallel/model_executor/compile.py), runs both once untimed (the compiled one pays its compilation there: reported), then
times them interleaved round by round, so the ratio compiled / eager comes from one run. Also reported: the
compiled graphs and graph breaks, and the largest difference between the two outputs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .model import launch_per_rank_count, model_key, parse_or_drive, side_by_side_arguments


def drive(spec: dict) -> None:
    from parallel.model_executor.compile import compile_blocks, report
    from parallel.layout.config import ParallelConfig
    from parallel.distributed import initialize_model_parallel
    from parallel.model_executor import wrap_pipeline

    from .model import start_drive, timed_rounds

    world, model, eager, inputs, kwargs = start_drive(spec)
    initialize_model_parallel(ParallelConfig(ulysses_degree=world.world_size))
    compiled = model.pipeline().to(eager.transformer.device, eager.transformer.dtype)
    pipelines = {"eager": wrap_pipeline(eager), "compiled": wrap_pipeline(compiled)}
    compile_blocks(pipelines["compiled"].module)
    times, outputs, warmup = timed_rounds(pipelines, inputs, kwargs, spec["runs"])
    if world.rank == 0:
        Path(spec["result"]).write_text(json.dumps({
            "times": times, "warmup": warmup, "compile": report(),
            "max_abs_diff": (outputs["compiled"] - outputs["eager"]).abs().max().item()}))


def main(argv=None) -> int:
    parser = side_by_side_arguments("bench.compile", __doc__, runs=3, steps=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts to run (one GPU: 1)")
    if (args := parse_or_drive(parser, argv, drive)) is None:
        return 0
    model = model_key(args)
    raws = launch_per_rank_count("bench.compile", {"model": model, "runs": args.runs, "steps": args.steps}, args.json,
                                 nprocs=args.ranks)
    rows = {}
    for nproc, raw in raws.items():
        median = {name: statistics.median(t) for name, t in raw["times"].items()}
        rows[nproc] = {"median_s": median, "speedup": median["eager"] / median["compiled"],
                       "first_run_s": raw["warmup"], "compile": raw["compile"], "max_abs_diff": raw["max_abs_diff"]}
    args.json.write_text(json.dumps({"model": model, "steps": args.steps, "runs": args.runs, "rows": rows}, indent=2))
    print(f"| ranks ({model} Flux, {args.steps} steps, median of {args.runs}) | eager s | compiled s | eager / compiled | "
          "first compiled run s | graphs / breaks | max abs Δ |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for nproc, r in rows.items():
        print(f"| {nproc}{' (Ulysses-2)' if nproc > 1 else ''} | {r['median_s']['eager']:.2f} | {r['median_s']['compiled']:.2f} | "
              f"{r['speedup']:.2f} | {r['first_run_s']['compiled']:.1f} | {r['compile']['graphs']} / {r['compile']['breaks']} | "
              f"{r['max_abs_diff']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
