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

        on_ranks = {"pool": [], "pool + previews": []}  # rank 0's time from its inputs to the last step's end

        def through_pool(side: str, preview: bool):
            last = []
            result = client.sample(tensors, {**params, "preview": preview}, on_step=lambda step: last.append(step))
            on_ranks[side].append(last[-1].params["elapsed"])
            return result

        sides = {
            "in-process": in_process,
            "pool": lambda: through_pool("pool", False),
            "pool + previews": lambda: through_pool("pool + previews", True),
        }
        times, results = alternating(sides, args.runs)

    base = statistics.median(times["in-process"])
    rows = {
        name: {"median_s": statistics.median(t), "spread_s": max(t) - min(t), "runs": t,
               "overhead": statistics.median(t) / base - 1.0,
               # where a pool's overhead goes: inside rank 0's steps, or outside them (the request, the wire, the result)
               **({"steps_on_rank_s": statistics.median(on_ranks[name][1:] or on_ranks[name]),
                   "outside_steps_s": statistics.median(t) - statistics.median(on_ranks[name][1:] or on_ranks[name])}
                  if name in on_ranks else {})}
        for name, t in times.items()
    }
    same = (results["pool"] - results["in-process"]).abs().max().item()
    report = {"model": model.name, "steps": args.steps, "step_s": base / args.steps, "max_abs_diff": same, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"| {model.name}, {args.steps} steps, {base / args.steps * 1000:.0f} ms/step | median s | spread s | overhead | "
          "rank 0's steps s | outside them s |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        split = f"{row['steps_on_rank_s']:.3f} | {row['outside_steps_s']:.3f}" if "steps_on_rank_s" in row else "– | –"
        print(f"| {name} | {row['median_s']:.3f} | {row['spread_s']:.3f} | {row['overhead'] * 100:+.1f}% | {split} |")
    print(f"\npool result vs in-process: max |diff| = {same:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
