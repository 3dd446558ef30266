"""Runs xDiT VAE Decode's tiled decode in one torchrun job: `torchrun --nproc-per-node N tests/vae_decode_cases.py OUT`.

For each tiny model's VAE (Wan and LTX-2 video, Flux and SD3 images) rank 0 writes the parallel decode of seeded
latents to OUT/<model>.safetensors; in the "dropped" case rank 1's first tile never reaches rank 0
(the negative control of tests/test_vae_decode.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from parallel.loading import tiny_models
from parallel.model_executor import vae_decode

CASES = {"wan": (1, 16, 5, 32, 32), "flux": (1, 16, 48, 64), "sd3": (2, 16, 32, 32), "ltx2": (1, 128, 2, 16, 16)}


def latents(model: str) -> torch.Tensor:
    return torch.randn(CASES[model.removesuffix("-dropped")], generator=torch.Generator().manual_seed(1))


def main(out: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for model in (*CASES, "flux-dropped"):
        vae = tiny_models.build_tiny_pipeline(model.removesuffix("-dropped"), seed=0).vae
        z = latents(model)
        tiles = vae_decode.fit_tiles(vae, z, world)
        if model.endswith("-dropped"):  # rank 1's first tile never reaches rank 0: zeros stand in
            replay = vae_decode._Replay.__init__

            def dropped(self, outputs, replay=replay):
                outputs = list(outputs)
                outputs[1] = torch.zeros_like(outputs[1])
                replay(self, outputs)

            vae_decode._Replay.__init__ = dropped
        image = vae_decode.tiled_decode(vae, z, rank, world)
        if rank == 0:
            save_file({"image": image.contiguous(), "tiles": torch.tensor(tiles)}, str(Path(out) / f"{model}.safetensors"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
