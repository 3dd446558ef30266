"""PipeFusion-2 next to one rank and Ulysses-2 on the same model: time and bytes per step.

    python -m bench.pipefusion [--tiny] [--runs 5] [--steps 4] [--patches 2 4 8]

One torchrun job of 2 ranks, one thread each, layouts interleaved round by round. The 1-rank time is
the plain diffusers pipeline on rank 0 while rank 1 waits in a barrier. PipeFusion runs with one
synchronous warm-up step and 2 image patches (or each count --patches names) after the text patch, so the
other steps use the stale-K/V patch pipeline with the patches flowing across steps; a "step by step" row runs
the first count with every step ending on both stages (the stage-1 output broadcast, no flow). PipeFusion gets
a fresh copy of the pipeline each run, since a stage frees the blocks it does not hold.
Bytes are what each rank's group coordinators counted, per step, next to what the method must move.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import subprocess
import time
from pathlib import Path

from parallel.cli.launch import ROOT, rank_environment, torchrun_command

from .model import model_key, parse_or_drive, side_by_side_arguments

def layouts(patches: list[int]) -> dict[str, dict | None]:
    """The patches flowing across steps for each count, and the first count with every step ending on both stages."""
    pipefusion = {("pipefusion2" if m == 2 else f"pipefusion2, {m} patches"):
                  {"pipefusion_degree": 2, "warmup_steps": 1, "num_patches": m} for m in patches}
    first = patches[0]
    pipefusion["pipefusion2" + ("" if first == 2 else f", {first} patches") + ", step by step"] = {
        "pipefusion_degree": 2, "warmup_steps": 1, "num_patches": first, "patch_flow": False}
    return {"1 rank (diffusers)": None, "ulysses2": {"ulysses_degree": 2}, **pipefusion}


def analytic_bytes(name: str, dims, steps: int, patches: int = 2) -> float:
    """Mean bytes per rank per step that the method must send."""
    i, t, c = dims.image_tokens, dims.text_tokens, dims.out_channels
    d = dims.heads * dims.head_dim
    if name == "ulysses2":  # as bench/analytic.py counts Ulysses (text sharded with the image where both divide)
        from .analytic import min_bytes_per_step
        from .layouts import LAYOUTS as BENCH_LAYOUTS

        return min_bytes_per_step(BENCH_LAYOUTS["xdit-ulysses2"], dims)
    if name.startswith("pipefusion2"):  # stage 0 sends the text patch and the image patches (each with the plan's
        # stand-in tokens of the other stream: none for Flux); stage 1 broadcasts the output, or while the patches flow,
        # sends each patch's next latents back (as many values: Flux's latents and output have the same channels)
        from parallel.families.flux import FLUX

        warm, patched = (i + t) * d, (i + t + (patches + 1) * FLUX.plan.pipefusion.stand_in) * d
        activations = (warm + (steps - 1) * patched) / steps
        return (activations + i * c) / 2 * dims.element_bytes
    return 0.0


def drive(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from parallel.layout.config import ParallelConfig
    from parallel.distributed.parallel_state import all_coordinators
    from parallel.model_executor.layout_scope import under_layout

    from .model import start_drive, synchronize

    world, model, pipeline, inputs, kwargs = start_drive(spec)
    chosen = layouts(spec["patches"])
    times = {name: [] for name in chosen}
    sent = {name: 0 for name in chosen}
    outputs = {}
    for round_ in range(spec["runs"] + 1):  # round 0 warms up, untimed
        for name, degrees in chosen.items():
            # PipeFusion keeps only its stage's blocks: it runs on a copy.
            scope = contextlib.nullcontext() if degrees is None else under_layout(
                copy.deepcopy(pipeline) if "pipefusion_degree" in degrees else pipeline, ParallelConfig(**degrees))
            with scope as wrapped:
                dist.barrier()
                start = time.perf_counter()
                with torch.no_grad():
                    out = (wrapped or pipeline)(**inputs, **kwargs)[0] if wrapped or world.rank == 0 else None
                synchronize()  # on a GPU: the queued kernels count
                elapsed = time.perf_counter() - start
                dist.barrier()
                if wrapped is not None:
                    sent[name] = sum(c.bytes_sent for c in all_coordinators().values())
            if round_:
                times[name].append(elapsed)
            elif out is not None:
                outputs[name] = out
    every = [None] * world.world_size
    dist.all_gather_object(every, sent)
    if world.rank == 0:
        base = outputs["1 rank (diffusers)"]
        diffs = {name: (out - base).abs().max().item() for name, out in outputs.items()}
        Path(spec["result"]).write_text(json.dumps({"times": times, "sent": every, "diffs": diffs,
                                                     "dims": vars(model.dims(pipeline))}))


def main(argv=None) -> int:
    parser = side_by_side_arguments("bench.pipefusion", __doc__, runs=5, steps=4)
    parser.add_argument("--patches", type=int, nargs="+", default=[2], help="PipeFusion patch counts to time")
    if (args := parse_or_drive(parser, argv, drive)) is None:
        return 0
    spec_file = args.json.with_suffix(".spec.json")
    result = args.json.with_suffix(".raw.json")
    spec_file.write_text(json.dumps({"model": model_key(args), "runs": args.runs, "steps": args.steps,
                                     "patches": args.patches, "result": str(result)}))
    subprocess.run(torchrun_command(2, "-m", "bench.pipefusion", "--drive", str(spec_file)), cwd=ROOT,
                   env=rank_environment(), check=True)
    raw = json.loads(result.read_text())
    from .analytic import ModelDims

    dims = ModelDims(**raw["dims"])
    base = statistics.median(raw["times"]["1 rank (diffusers)"])
    chosen = layouts(args.patches)
    rows = {}
    for name, times in raw["times"].items():
        median = statistics.median(times)
        mean_sent = statistics.mean(rank[name] for rank in raw["sent"]) / args.steps
        rows[name] = {"median_s": median, "spread": (max(times) - min(times)) / median, "step_ms": 1000 * median / args.steps,
                      "efficiency": base / (2 * median) if name != "1 rank (diffusers)" else 1.0,
                      "bytes_per_step_per_rank": mean_sent, "bytes_analytic": analytic_bytes(name, dims, args.steps, (chosen[name] or {}).get("num_patches", 2)),
                      "max_abs_diff_vs_1_rank": raw["diffs"].get(name)}
    args.json.write_text(json.dumps({"steps": args.steps, "runs": args.runs, "rows": rows}, indent=2))
    print(f"| layout ({model_key(args)} Flux, {args.steps} steps) | ms/step | spread | efficiency "
          f"| KiB/step/rank (method) | max abs Δ vs 1 rank |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        diff = "–" if r["max_abs_diff_vs_1_rank"] is None else f"{r['max_abs_diff_vs_1_rank']:.1e}"
        print(f"| {name} | {r['step_ms']:.0f} | {r['spread']:.0%} | {r['efficiency']:.2f} | "
              f"{r['bytes_per_step_per_rank'] / 1024:.0f} ({r['bytes_analytic'] / 1024:.0f}) | {diff} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
