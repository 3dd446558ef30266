"""Model-call cost: one xDiT Model call through a pool (1 rank) next to the same transformer call in-process.

    python -m bench.model_call [--model medium|tiny|large] [--runs 20]

What ComfyUI's samplers pay per model evaluation on a pool: encoding the call, ZMQ to rank 0, the
conditioning looked up by key, the work broadcast, the family's transformer call, the prediction back.
Both sides use one thread, the same weights and inputs, and alternate call by call. Also the bytes each
call sends: the first call of a prompt carries the conditioning, the later ones latents and sigma only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from parallel.families.base import unpack_2x2
from .model import MODELS, alternating, on_gpu, one_rank_pool

OUT = Path(__file__).resolve().parent / "out"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="medium")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", type=Path, default=OUT / "model_call.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = MODELS[args.model]
    pipeline = model.pipeline()
    inputs = model.inputs(pipeline)
    latents = unpack_2x2(inputs["latents"], model.height, model.width)
    batch = latents.shape[0]
    sigma = torch.full((batch,), 0.75)
    conditioning = {"prompt_embeds": inputs["prompt_embeds"], "pooled_prompt_embeds": inputs["pooled_prompt_embeds"],
                    "guidance": torch.full((batch,), 3.5)}
    call = {"latents": latents, "sigma": sigma}

    with one_rank_pool(pipeline) as client:
        local = on_gpu(pipeline, {**call, **conditioning})  # the pool was saved from the fp32 pipeline

        def in_process():  # FluxPipeline's loop body for one step
            x = local["latents"]
            height, width = x.shape[2:]
            with torch.no_grad():
                out = pipeline.transformer(
                    hidden_states=pipeline._pack_latents(x, batch, x.shape[1], height, width),
                    timestep=local["sigma"], guidance=local["guidance"], pooled_projections=local["pooled_prompt_embeds"],
                    encoder_hidden_states=local["prompt_embeds"],
                    txt_ids=x.new_zeros(local["prompt_embeds"].shape[1], 3),
                    img_ids=pipeline._prepare_latent_image_ids(batch, height // 2, width // 2, x.device, x.dtype),
                    return_dict=False)[0]
            return unpack_2x2(out, model.height, model.width).float().cpu()

        first = client.evaluate(call, conditioning)["prediction"]
        first_bytes = client.last_call_bytes
        sides = {"in-process": in_process, "pool": lambda: client.evaluate(call, conditioning)["prediction"]}
        times, results = alternating(sides, args.runs)
        later_bytes = client.last_call_bytes

    base, pooled = statistics.median(times["in-process"]), statistics.median(times["pool"])
    same = max((results["pool"] - results["in-process"]).abs().max().item(), (first - results["in-process"]).abs().max().item())
    report = {"model": model.name, "in_process_ms": base * 1000, "pool_ms": pooled * 1000,
              "added_ms": (pooled - base) * 1000, "first_call_bytes": first_bytes, "later_call_bytes": later_bytes,
              "max_abs_diff": same, "runs": times}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"| {model.name}, one model call | median ms | spread ms |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t) * 1000:.1f} | {(max(t) - min(t)) * 1000:.1f} |")
    print(f"\nadded per call: {(pooled - base) * 1000:.1f} ms; bytes sent: first call {first_bytes:,}, "
          f"later calls {later_bytes:,} (conditioning held by key); pool vs in-process max |diff| = {same:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
