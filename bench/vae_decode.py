"""Per-rank peak memory and time of xDiT VAE Decode against one rank's plain decode.

    python -m bench.vae_decode [--frames 17] [--size 256] [--base-dim 96] [--json OUT.json]

A clip of latents is decoded by a Wan 2.1 VAE of the real architecture (diffusers' AutoencoderKLWan with
its default widths, base_dim 96; random weights, so only memory and time mean anything; 16 channels, ×8
spatial, ×4 temporal; default 17 frames of 256×256 → 5 latent frames of 32×32) is decoded (a) by diffusers' plain `decode` on one rank and (b) by
parallel/model_executor/vae_decode.py's tiled decode on 1, 2 and 4 torchrun ranks (one tile per rank). Peak memory is
the peak of the tensors the decode allocates and still holds (bench.wan_memory's storage tracker, which
counts every op's output storage until it is freed; the gathered output on rank 0 included), after one
untimed warm-up decode. Process RSS is no measure here: the allocator keeps freed pages.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel.cli.launch import rank_environment, torchrun_command


def worker(spec_path: str) -> int:
    import torch
    import torch.distributed as dist

    from bench.wan_memory import _tracker
    from parallel.model_executor import vae_decode

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=spec["base_dim"]).eval()
    latents = torch.randn(spec["shape"], generator=torch.Generator().manual_seed(0))
    tiles = vae_decode.fit_tiles(vae, latents, world)

    def decode():
        if spec["plain"]:
            vae.use_tiling = False
            with torch.no_grad():
                return vae.decode(latents, return_dict=False)[0]
        return vae_decode.tiled_decode(vae, latents, rank, world)

    tracker = _tracker()
    dist.barrier()
    started = time.perf_counter()
    with tracker:
        base = tracker.reset()
        decode()
    seconds = time.perf_counter() - started
    every = [None] * world
    dist.all_gather_object(every, {"rank": rank, "peak_bytes": tracker.peak - base, "seconds": seconds})
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"tiles": tiles, "ranks": every}))
    dist.destroy_process_group()
    return 0


def measure(frames: int, size: int, base_dim: int) -> dict[str, dict]:
    shape = [1, 16, (frames - 1) // 4 + 1, size // 8, size // 8]
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name, nproc, plain in (("plain decode, 1 rank", 1, True), ("xDiT tiled, 1 rank", 1, False),
                                   ("xDiT tiled, 2 ranks", 2, False), ("xDiT tiled, 4 ranks", 4, False)):
            spec = Path(work) / "spec.json"
            out = Path(work) / "out.json"
            spec.write_text(json.dumps({"shape": shape, "plain": plain, "out": str(out), "base_dim": base_dim}))
            run = subprocess.run(torchrun_command(nproc, "-m", "bench.vae_decode", "--worker", str(spec)),
                                 env=rank_environment(), capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"error: {name} failed:\n{run.stderr[-2000:]}")
            results[name] = json.loads(out.read_text())
    return results


def report(results: dict[str, dict], frames: int, size: int, base_dim: int) -> str:
    base = results["plain decode, 1 rank"]["ranks"][0]["peak_bytes"]
    lines = [f"Wan 2.1 VAE (base_dim {base_dim}) decode of {frames} frames at {size}×{size}; peak tensor bytes per rank", "",
             "| decode | tiles | max per-rank peak MiB | vs plain 1 rank | slowest rank s |", "|---|---:|---:|---:|---:|"]
    for name, result in results.items():
        peak = max(r["peak_bytes"] for r in result["ranks"])
        slowest = max(r["seconds"] for r in result["ranks"])
        tiles = "–" if name.startswith("plain") else result["tiles"]
        lines.append(f"| {name} | {tiles} | {peak / 2**20:.0f} | {peak / base:.2f} | {slowest:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vae_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--base-dim", type=int, default=96, help="the VAE's widths (96: Wan 2.1's own)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    results = measure(args.frames, args.size, args.base_dim)
    print(report(results, args.frames, args.size, args.base_dim))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
