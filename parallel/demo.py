"""The built-in demo: a tiny PixArt-α built in code, sampled on 2 ranks with Ulysses, saved as PNG.

    python -m parallel.demo [--family flux] [--nproc 2] [--ulysses-degree U --ring-degree R] [--out out/demo]

It exercises the real path: built-in model folder → torchrun → contract E → latents → VAE → PNG.
Timing compares like with like: the same pipeline in one process and on the ranks, each timed on its
second (warm) run with one thread per rank. The tiny models have random weights: they make noise,
not pictures, and at this size the times measure overhead, not a speed-up.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .loading import builtin_models, tiny_models
from .cli.arguments import ArgumentParser
from .cli.decode import decode_to_png
from .cli.launch import rank_environment, torchrun_command

THREADS = 1  # per rank, and for the single-process run


def main() -> int:
    parser = ArgumentParser(prog="python -m parallel.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=tiny_models.FAMILIES, default="pixart-alpha")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
    parser.add_argument("--ulysses-degree", type=int, default=None, help="default: --nproc / --ring-degree")
    parser.add_argument("--ring-degree", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    args = parser.parse_args()
    ulysses = args.ulysses_degree or max(1, args.nproc // args.ring_degree)

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = builtin_models.builtin_model_dir(builtin_models.PREFIX + args.family)
    inputs = args.out / "inputs.safetensors"
    save_file(tiny_models.make_inputs(args.family, height=args.size, width=args.size), inputs)
    output = args.out / "latents.safetensors"
    command = torchrun_command(
        args.nproc, "-m", "parallel.run", "--model", str(model_dir), "--inputs", str(inputs), "--output", str(output),
        "--steps", str(args.steps), "--guidance-scale", "4.5", "--height", str(args.size), "--width", str(args.size),
        "--ulysses-degree", str(ulysses), "--ring-degree", str(args.ring_degree), "--repeat", "2",
    )
    print("$", " ".join(command), flush=True)
    run = subprocess.run(command, env=rank_environment(THREADS), stdout=subprocess.PIPE, text=True)
    sys.stdout.write(run.stdout)
    if run.returncode != 0:
        return run.returncode or 1  # rank 0 has printed the error line
    parallel_s = float(re.search(r": ([0-9.]+) s ->", run.stdout).group(1))

    from diffusers import DiffusionPipeline

    torch.set_num_threads(THREADS)
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    call = dict(**load_file(inputs), **tiny_models.PIPELINE_CALL_DEFAULTS[args.family], num_inference_steps=args.steps,
                guidance_scale=4.5, height=args.size, width=args.size, output_type="latent", return_dict=False)
    with torch.no_grad():
        pipeline(**call)  # warm-up: first-call costs are not sampling
        start = time.perf_counter()
        expected = pipeline(**call)[0]
        single_s = time.perf_counter() - start
    print(f"warm sampling, {THREADS} thread per process: diffusers in one process {single_s:.3f} s, "
          f"{args.nproc} ranks {parallel_s:.3f} s")
    print("these tiny models have random weights: they make noise, not pictures, and this size measures "
          "overhead, not speed-up (see bench/RESULTS.md for real measurements)")
    latents = load_file(output)["latents"]
    print(f"max |parallel - diffusers| = {(latents - expected).abs().max().item():.2e}")
    png = args.out / f"{args.family}.png"
    decode_to_png(model_dir, latents, args.size, args.size, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
