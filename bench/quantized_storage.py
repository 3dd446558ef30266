"""Quantized checkpoints kept quantized: parameter bytes per rank and time per step, bf16 vs fp8 vs GGUF Q8_0,
and on a GPU with fp8 tensor cores the fp8 file multiplying in fp8 (`--fp8-matmul`).

    python -m bench.quantized_storage [--model medium|tiny|large] [--runs 3]

The medium Flux transformer written three ways, as users download it: a bf16 file in BFL's layout, ComfyUI's
scaled fp8 of it (`scaled_fp8` marker, per-tensor `scale_weight`) and city96's GGUF Q8_0 of it. Each loads as
a rank loads it (the default compute dtype, bf16), and the bench reports its transformer's parameter bytes by
storage format (what every rank of a layout without weight sharding holds; PipeFusion stages hold their share)
and the time of one step, the three alternating round by round after a warm-up (one CPU thread; on a GPU when
there is one, `large`: FLUX.1-dev's width with 12 of its blocks). The files are written with the tests'
writers of original layouts (tests/original_layouts.py). Where the card multiplies fp8 (compute capability 8.9+),
a fourth side, `fp8_matmul`, is the fp8 file loaded again with every fp8 layer on `torch._scaled_mm`
(parallel/loading/checkpoints/fp8_matmul.py); every side reports its relative L2 distance from the bf16 file's output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from parallel.cli.launch import ROOT
from parallel.loading.checkpoints.fp8 import storage_of, use_fp8_matmul
from parallel.loading.pipelines import load_pipeline

from .model import MODELS, alternating, with_blocks

OUT = Path(__file__).resolve().parent / "out"
FORMATS = ("bf16", "fp8_scaled", "gguf_q8_0")


def write_files(transformer: torch.nn.Module, root: Path) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from original_layouts import original_layout
    from quantized_files import fp8_scaled, gguf_file

    weights = original_layout("flux", transformer)
    paths = {name: root / f"flux1-dev-{name}.{'gguf' if name.startswith('gguf') else 'safetensors'}" for name in FORMATS}
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, paths["bf16"])
    save_file(fp8_scaled(weights, per_layer=False)[0], paths["fp8_scaled"])
    gguf_file(weights, paths["gguf_q8_0"], "flux")
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized_storage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="medium", help="tiny: checks the machinery only")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=OUT / "quantized_storage.json")
    parser.add_argument("--blocks", type=lambda text: tuple(int(n) for n in text.split(",")), metavar="DOUBLE,SINGLE",
                        help="the model's Flux blocks (default: its own): fewer write and load faster")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    model = with_blocks(MODELS[args.model], args.blocks)
    donor = model.pipeline()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = {k: v.to(device, torch.bfloat16) for k, v in model.inputs(donor).items() if not k.startswith("negative_")}
    call = {**model.call_kwargs(true_cfg=False), "num_inference_steps": 1}
    with tempfile.TemporaryDirectory() as tmp:
        pipelines = {}
        for name, path in write_files(donor.transformer, Path(tmp)).items():
            pipeline = load_pipeline(path)
            pipeline.set_progress_bar_config(disable=True)
            pipelines[name] = pipeline
        fast = load_pipeline(Path(tmp) / "flux1-dev-fp8_scaled.safetensors")
        if use_fp8_matmul(fast, True):  # 0 where the card has no fp8 tensor cores (and on the CPU)
            fast.set_progress_bar_config(disable=True)
            pipelines["fp8_matmul"] = fast
    storage = {name: storage_of(p.transformer) for name, p in pipelines.items()}
    with torch.no_grad():
        times, outputs = alternating({name: (lambda p=p: p(**inputs, **call)[0].float().cpu())  # waits for a GPU
                                      for name, p in pipelines.items()}, args.runs)
    bf16 = outputs["bf16"].float()
    rows = {name: {"storage": storage[name], "parameter_bytes": sum(storage[name].values()),
                   "ratio_to_bf16": sum(storage[name].values()) / sum(storage["bf16"].values()),
                   "step_s": statistics.median(times[name]),
                   "max_abs_diff_to_bf16": (outputs[name].float() - bf16).abs().max().item(),
                   "relative_l2_to_bf16": ((outputs[name].float() - bf16).norm() / bf16.norm()).item()}
            for name in pipelines}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": model.name, "blocks": args.blocks, "runs": args.runs, "rows": rows}, indent=2))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, 1 thread"
    print(f"| file ({model.name}, bf16 compute, {device}, median of {args.runs}) | parameter MiB per rank | by format | "
          "÷ bf16 file | s per step | ÷ bf16 | max abs Δ to bf16 | relative L2 to bf16 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        formats = ", ".join(f"{kind} {size / 2**20:.1f}" for kind, size in r["storage"].items())
        print(f"| {name} | {r['parameter_bytes'] / 2**20:.1f} | {formats} | {r['ratio_to_bf16']:.3f} | "
              f"{r['step_s']:.3f} | {r['step_s'] / rows['bf16']['step_s']:.2f} | {r['max_abs_diff_to_bf16']:.1e} | "
              f"{r['relative_l2_to_bf16']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
