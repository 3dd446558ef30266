"""Pool overhead: a job through the pool (1 rank) next to the same pipeline called in-process.

    python -m bench.pool_overhead [--model medium|tiny] [--runs 5] [--steps 4]

Both sides use one thread and the same model, weights and inputs; runs alternate A B A B so slow
drifts of this shared machine hit both alike. A third column streams step previews, to price them.
The pool side includes everything a ComfyUI job pays after the model is loaded: encoding the
request, ZMQ to rank 0, the job broadcast, per-step messages, and the result coming back.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from .model import MODELS, alternating, on_gpu, one_rank_pool

OUT = Path(__file__).resolve().parent / "out"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="medium")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=OUT / "pool_overhead.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = MODELS[args.model]
    pipeline = model.pipeline()
    tensors = {k: v for k, v in model.inputs(pipeline).items() if not k.startswith("negative")}
    kwargs = {**model.call_kwargs(true_cfg=False), "num_inference_steps": args.steps}

    with one_rank_pool(pipeline) as client:
        local = on_gpu(pipeline, tensors)  # the pool was saved from the fp32 pipeline and computes as this one
        params = {"steps": args.steps, "guidance_scale": model.guidance_scale, "height": model.height, "width": model.width}

        def in_process():
            with torch.no_grad():
                return pipeline(**local, **kwargs)[0].float().cpu()

        sides = {
            "in-process": in_process,
            "pool": lambda: client.sample(tensors, {**params, "preview": False}),
            "pool + previews": lambda: client.sample(tensors, {**params, "preview": True}),
        }
        times, results = alternating(sides, args.runs)

    base = statistics.median(times["in-process"])
    rows = {
        name: {"median_s": statistics.median(t), "spread_s": max(t) - min(t), "runs": t,
               "overhead": statistics.median(t) / base - 1.0}
        for name, t in times.items()
    }
    same = (results["pool"] - results["in-process"]).abs().max().item()
    report = {"model": model.name, "steps": args.steps, "step_s": base / args.steps, "max_abs_diff": same, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"| {model.name}, {args.steps} steps, {base / args.steps * 1000:.0f} ms/step | median s | spread s | overhead |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_s']:.3f} | {row['spread_s']:.3f} | {row['overhead'] * 100:+.1f}% |")
    print(f"\npool result vs in-process: max |diff| = {same:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
