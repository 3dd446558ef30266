"""First-block cache on the medium Flux model: wall time with and without it, on 1 rank and on Ulysses-2.

    python -m bench.step_cache [--tiny] [--runs 2] [--steps 28] [--threshold 0.1]

One torchrun job of 2 ranks, one thread each, the four runs interleaved round by round after an untimed
warm-up round. 1 rank is diffusers' own pipeline on rank 0 (the cache through `enable_cache`) while
rank 1 waits in a barrier; Ulysses-2 is the engine with the cache as the job's setting. Quality is the
relative L2 distance ||cached - uncached|| / ||uncached|| of the final latents; the cached runs also
report how many transformer calls ran in full.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from parallel.cli.launch import ROOT, rank_environment, torchrun_command

from .model import model_key, parse_or_drive, side_by_side_arguments

RUNS = ("1 rank", "1 rank + cache", "ulysses2", "ulysses2 + cache")


def _one_rank(pipeline, inputs: dict, kwargs: dict, threshold: float | None):
    """diffusers alone, with its own FirstBlockCacheConfig when `threshold` is given; (latents, full calls)."""
    import torch
    from diffusers.hooks import FirstBlockCacheConfig

    if threshold is None:
        with torch.no_grad():
            return pipeline(**inputs, **kwargs)[0], kwargs["num_inference_steps"]
    pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    hook = next(m._diffusers_hook.get_hook("fbc_leader_block_hook") for m in pipeline.transformer.modules()
                if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("fbc_leader_block_hook"))
    decide, decisions = hook._should_compute_remaining_blocks, []
    hook._should_compute_remaining_blocks = lambda r: decisions.append(decide(r)) or decisions[-1]
    try:
        with torch.no_grad():
            return pipeline(**inputs, **kwargs)[0], sum(decisions)
    finally:
        pipeline.transformer.disable_cache()


def drive(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from parallel.cache_settings import CacheSettings
    from parallel.layout.config import ParallelConfig
    from parallel.model_executor.layout_scope import under_layout
    from parallel.request import STEP_CACHE

    from .model import start_drive, synchronize

    world, model, pipeline, inputs, kwargs = start_drive(spec)
    cache = CacheSettings("first-block", spec["threshold"])
    times = {name: [] for name in RUNS}
    outputs, full = {}, {}
    for round_ in range(spec["runs"] + 1):  # round 0 warms up, untimed
        for name in RUNS:
            cached = name.endswith("+ cache")
            dist.barrier()
            start = time.perf_counter()
            if name.startswith("1 rank"):
                if world.rank == 0:
                    out, calls = _one_rank(pipeline, inputs, kwargs, spec["threshold"] if cached else None)
            else:
                with under_layout(pipeline, ParallelConfig(ulysses_degree=2)) as wrapped:
                    with torch.no_grad():
                        out = wrapped(**inputs, **kwargs, **({STEP_CACHE: cache} if cached else {}))[0]
                    calls = wrapped.cache_report.full if cached else spec["steps"]
            synchronize()  # on a GPU: the queued kernels count
            elapsed = time.perf_counter() - start
            dist.barrier()
            if round_:
                times[name].append(elapsed)
            elif world.rank == 0:
                outputs[name], full[name] = out, calls
    if world.rank == 0:
        def distance(name: str, base: str) -> float:
            return ((outputs[name] - outputs[base]).norm() / outputs[base].norm()).item()

        Path(spec["result"]).write_text(json.dumps({
            "times": times, "full_calls": full,
            "relative_l2": {"1 rank + cache": distance("1 rank + cache", "1 rank"),
                            "ulysses2 + cache": distance("ulysses2 + cache", "ulysses2"),
                            "ulysses2 + cache vs 1 rank + cache": distance("ulysses2 + cache", "1 rank + cache")}}))


def main(argv=None) -> int:
    parser = side_by_side_arguments("bench.step_cache", __doc__, runs=2, steps=28)
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="first-block cache threshold (random weights change ~0.4 per step, more than a trained model)")
    if (args := parse_or_drive(parser, argv, drive)) is None:
        return 0
    spec_file, result = args.json.with_suffix(".spec.json"), args.json.with_suffix(".raw.json")
    spec_file.write_text(json.dumps({"model": model_key(args), "runs": args.runs, "steps": args.steps,
                                     "threshold": args.threshold, "result": str(result)}))
    subprocess.run(torchrun_command(2, "-m", "bench.step_cache", "--drive", str(spec_file)), cwd=ROOT,
                   env=rank_environment(), check=True)
    raw = json.loads(result.read_text())
    rows = {name: {"median_s": statistics.median(t), "spread": (max(t) - min(t)) / statistics.median(t),
                   "full_calls": raw["full_calls"][name]} for name, t in raw["times"].items()}
    args.json.write_text(json.dumps({"steps": args.steps, "runs": args.runs, "threshold": args.threshold,
                                     "rows": rows, "relative_l2": raw["relative_l2"]}, indent=2))
    print(f"| run ({'tiny' if args.tiny else 'medium'} Flux, {args.steps} steps, threshold {args.threshold:g}) "
          "| wall s | spread | full / all calls | speed-up | relative L2 to uncached |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        base = rows[name.removesuffix(" + cache")]["median_s"]
        l2 = raw["relative_l2"].get(name)
        print(f"| {name} | {r['median_s']:.2f} | {r['spread']:.0%} | {r['full_calls']} / {args.steps} | "
              f"{base / r['median_s']:.2f}× | {'–' if l2 is None else f'{l2:.2e}'} |")
    print(f"Ulysses-2 + cache vs 1 rank + cache: relative L2 {raw['relative_l2']['ulysses2 + cache vs 1 rank + cache']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
