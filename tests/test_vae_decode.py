"""xDiT VAE Decode's engine: diffusers' tiled decode with its tiles decoded over real torchrun ranks.

On 2 and 4 ranks, the Wan and LTX-2 video VAEs (5 and 2 latent frames) and the Flux and SD3 image VAEs (a batch of two)
decode seeded latents; rank 0's image must equal diffusers' own `tiled_decode` in one process with the
same tiles within 1e-4, and a plain (untiled) decode within the bound these tiny random VAEs allow
(their tiles are a few latent pixels wide, so seams weigh more than on a real VAE). Negative control:
a decode where one rank's tile never reaches rank 0 must miss.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from parallel.loading import tiny_models
from parallel.model_executor import vae_decode

from vae_decode_cases import CASES, latents
from xdit_test_helpers import TOLERANCE, torchrun

PLAIN_BOUND = 0.4  # relative L2 to an untiled decode; measured 0.18-0.37 here (random tiny VAEs, 2 px overlaps)
PLAIN_BOUNDS = {"ltx2": 0.7}  # LTX-2's decoder sees further than its 8-pixel tiles (×32 per pixel): measured 0.59


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def decoded(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"vae{request.param}")
    run = torchrun(request.param, "tests/vae_decode_cases.py", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return request.param, out


def single_process(model: str, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    vae = tiny_models.build_tiny_pipeline(model, seed=0).vae
    z = latents(model)
    vae_decode.fit_tiles(vae, z, world)
    with torch.no_grad():
        tiled = vae_decode._tiled_decode(vae, z)
        vae.use_tiling = False
        plain = vae.decode(z, return_dict=False)[0]
    return tiled, plain


@pytest.mark.parametrize("model", CASES)
def test_parallel_tiled_decode_equals_diffusers_tiled_decode(decoded, model):
    world, out = decoded
    result = load_file(out / f"{model}.safetensors")
    assert int(result["tiles"]) >= world  # every rank decoded a tile
    tiled, plain = single_process(model, world)
    assert result["image"].shape == tiled.shape
    assert (result["image"] - tiled).abs().max().item() <= TOLERANCE
    assert ((result["image"] - plain).norm() / plain.norm()).item() < PLAIN_BOUNDS.get(model, PLAIN_BOUND)


def test_a_tile_that_never_arrives_misses(decoded):
    world, out = decoded
    tiled, _ = single_process("flux", world)
    assert (load_file(out / "flux-dropped.safetensors")["image"] - tiled).abs().max().item() > 100 * TOLERANCE
