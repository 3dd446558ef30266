"""The built-in demo: a tiny PixArt-α built in code, sampled on 2 ranks with Ulysses, saved as PNG.

    python -m parallel.demo [--family flux] [--nproc 2] [--out out/demo]

It exercises the real path: save_pretrained folder → torchrun → contract E → latents → VAE → PNG,
and prints the sampling time next to the same pipeline run in one process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import tiny_models
from .families import FAMILIES
from .families.base import unpack_2x2
from .launch import rank_environment, torchrun_command


def decode_to_png(pipeline, latents: torch.Tensor, size: int, path: Path) -> None:
    from diffusers.image_processor import VaeImageProcessor

    vae = pipeline.vae
    if FAMILIES.pipeline_wrapper(pipeline).comfy.packed:  # tokens of 2×2 latent pixels back to a latent image
        latents = unpack_2x2(latents, size, size)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    with torch.no_grad():
        image = vae.decode(latents / vae.config.scaling_factor + shift).sample
    VaeImageProcessor().postprocess(image, output_type="pil")[0].save(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=tiny_models.FAMILIES, default="pixart-alpha")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_models.save_tiny_pipeline(args.family, args.out / f"tiny-{args.family}")
    inputs = args.out / "inputs.safetensors"
    save_file(tiny_models.make_inputs(args.family, height=args.size, width=args.size), inputs)
    output = args.out / "latents.safetensors"
    command = torchrun_command(
        args.nproc, "-m", "parallel.run", "--model", str(model_dir), "--inputs", str(inputs), "--output", str(output),
        "--steps", str(args.steps), "--guidance-scale", "4.5", "--height", str(args.size), "--width", str(args.size),
        "--ulysses-degree", str(args.nproc),
    )
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, env=rank_environment())
    print(f"torchrun wall time (start-up included): {time.perf_counter() - start:.1f} s")

    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    start = time.perf_counter()
    with torch.no_grad():
        expected = pipeline(
            **load_file(inputs), **tiny_models.PIPELINE_CALL_DEFAULTS[args.family], num_inference_steps=args.steps,
            guidance_scale=4.5, height=args.size, width=args.size, output_type="latent", return_dict=False,
        )[0]
    print(f"single-process diffusers sampling: {time.perf_counter() - start:.3f} s")
    latents = load_file(output)["latents"]
    print(f"max |parallel - diffusers| = {(latents - expected).abs().max().item():.2e}")
    png = args.out / f"{args.family}.png"
    decode_to_png(pipeline, latents, args.size, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
