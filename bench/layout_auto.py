"""`--layout auto` against the clock: every valid layout's predicted step time next to its measured one.

    python -m bench.layout_auto [--runs 3] [--steps 4] [--nproc 2] [--tiny] [--json OUT.json]
                                [--link pcie4 [--gpu-tflops 20]]

One torchrun job: the medium model (bench/model.py) with a batch of 2 and true CFG, so that every 2-rank layout
(Ulysses, Ring, PipeFusion, CFG and data parallel) can run the same job. Each rank first measures the link and
the synthetic blocks exactly as `--layout auto` does at start (parallel/layout/choice.py) and predicts every
layout; then each layout is timed (one warm-up, then `--runs` rounds, interleaved, median), from a world barrier
to the slowest rank's return, divided by the steps. The table says how far each prediction is from the clock and
whether the layout auto chose is the one that measured fastest. With `--link`, the layouts are timed under that
link emulated (bench/emulated_link.py) and predicted for it, stretched alike, as the link table predicts for a
named link: its published bandwidth and latency, not a probe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel.cli.launch import ROOT, rank_environment, torchrun_command
from parallel.layout.config import LINKS


def drive(spec_path: str, result_path: str) -> int:
    import torch
    import torch.distributed as dist

    from parallel.layout.config import ParallelConfig
    from parallel.distributed import destroy_distributed_environment, init_distributed_environment
    from parallel.layout.choice import auto_layout, describe
    from parallel.model_executor.layout_scope import under_layout

    from .emulated_link import emulating, from_spec, stretched
    from .model import MODELS

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    world = init_distributed_environment()
    link, own_tflops = from_spec(spec, world.rank)
    model = MODELS[spec["model"]]
    pipeline = model.pipeline()
    inputs = {k: torch.cat([v, v.roll(1, dims=-1)]) for k, v in model.inputs(pipeline).items()}  # two samples
    call = {**model.call_kwargs(true_cfg=True), "num_inference_steps": spec["steps"]}
    del call["output_type"], call["return_dict"]
    start = time.perf_counter()
    chosen, predictions, links = auto_layout(pipeline, ParallelConfig(warmup_steps=1), {**inputs, **call}, world.world_size,
                                             stretched(link) if link else None)
    probe_s = time.perf_counter() - start
    times: dict[str, list[float]] = {p.config.describe(): [] for p in predictions}
    configs = [p.config for p in predictions]
    for round_index in range(spec["runs"] + 1):  # the first round is the warm-up
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            # PipeFusion frees the other stages' blocks: it gets a fresh copy of the same weights
            with under_layout(model.pipeline() if config.pipefusion_degree > 1 else pipeline, config) as parallel:
                dist.barrier()
                begin = time.perf_counter()
                with emulating(link):
                    parallel(**inputs, **call, output_type="latent", return_dict=False)
                elapsed = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_index:
                times[config.describe()].append(elapsed.item() / spec["steps"])
    if world.rank == 0:
        rows = [{**p.row(), "measured_s": statistics.median(times[p.config.describe()]), "runs": spec["runs"]}
                for p in predictions]
        Path(result_path).write_text(json.dumps({
            "model": model.name, "ranks": world.world_size, "steps": spec["steps"], "probe_s": probe_s,
            "chosen": chosen.describe(), "links": describe(predictions, links, measured=link is None)[0], "layouts": rows,
            "emulated_link": link.describe() if link else None, "cpu_tflops": own_tflops,
        }, indent=1))
    destroy_distributed_environment()
    return 0


def table(result: dict) -> str:
    fastest = min(result["layouts"], key=lambda row: row["measured_s"])["layout"]
    emulated = result.get("emulated_link")
    under = (f"; timed under {emulated['name']} emulated, stretched {emulated['scale']:.0f}× (this CPU against a "
             f"{emulated['scale'] * result['cpu_tflops']:.0f} TFLOP/s GPU)" if emulated else "")
    lines = [f"{result['model']}, batch 2 with true CFG, {result['steps']} steps, {result['ranks']} ranks; "
             f"probing took {result['probe_s']:.2f} s; {result['links']}{under}",
             "", "| layout | predicted ms/step | hidden ms/step (taken off) | measured ms/step | predicted / measured "
                 "| MiB/step/rank |", "|---|---:|---:|---:|---:|---:|"]
    for row in result["layouts"]:
        marks = " (auto's choice)" if row["layout"] == result["chosen"] else ""
        marks += " (fastest measured)" if row["layout"] == fastest else ""
        marks += f", {row['head_groups']} head groups" if (row["head_groups"] or 1) > 1 else ""
        lines.append(f"| {row['layout']}{marks} | {row['step_s'] * 1e3:.1f} | {row['hidden_s'] * 1e3:.1f} | "
                     f"{row['measured_s'] * 1e3:.1f} | "
                     f"{row['step_s'] / row['measured_s']:.2f} | {row['bytes_per_step'] / 2**20:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layout_auto", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the tiny test model: checks the machinery only")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--link", choices=list(LINKS), default=None,
                        help="time every layout under this link emulated and predict for it (bench/emulated_link.py)")
    parser.add_argument("--gpu-tflops", type=float, default=20.0,
                        help="with --link: the GPU's dense TFLOP/s the link is stretched against (default 20: a link "
                             "that matters next to compute, without hour-long runs)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as work:
        spec, result = Path(work) / "spec.json", Path(work) / "result.json"
        link = {"name": args.link, "gpu_tflops": args.gpu_tflops} if args.link else None
        spec.write_text(json.dumps({"model": "tiny" if args.tiny else "medium", "runs": args.runs, "steps": args.steps,
                                    "link": link}))
        command = torchrun_command(args.nproc, "-m", "bench.layout_auto", "--drive", str(spec), str(result))
        done = subprocess.run(command, cwd=ROOT, env=rank_environment(), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench job failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        data = json.loads(result.read_text())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    print(table(data))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drive"]:
        sys.exit(drive(*sys.argv[2:4]))
    sys.exit(main())
