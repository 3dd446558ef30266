"""Latents (what contract E and the pool return) to a PNG, with the pipeline folder's own VAE.

Used by the demo and by `python -m workers sample --output x.png`; only image families (4-D latents,
or Flux's packed tokens) and folders that hold a `vae/` can be decoded here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .families.base import unpack_2x2


def decode_to_png(model_dir: str | Path, latents: torch.Tensor, height: int, width: int, path: str | Path) -> None:
    from diffusers import AutoencoderKL
    from diffusers.image_processor import VaeImageProcessor

    model_dir = Path(model_dir)
    if not (model_dir / "vae").is_dir():
        raise ValueError(f"{model_dir} has no vae/ folder to decode with; write latents instead (--output x.safetensors)")
    if latents.dim() not in (3, 4):
        raise ValueError(f"latents of shape {list(latents.shape)} are video: write them as .safetensors")
    vae = AutoencoderKL.from_pretrained(model_dir / "vae")
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if latents.dim() == 3:  # packed pipelines (Flux): tokens of 2×2 latent pixels back to a latent image
        latents = unpack_2x2(latents, height, width, factor)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    with torch.no_grad():
        image = vae.decode(latents.float() / vae.config.scaling_factor + shift).sample
    VaeImageProcessor(vae_scale_factor=factor).postprocess(image, output_type="pil")[0].save(path)
