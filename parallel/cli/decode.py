"""Latents (what contract E and the pool return) to a PNG, with the pipeline folder's own VAE.

Used by the demo and by `python -m workers sample --output x.png`; only image families (4-D latents, or
packed tokens) and folders that hold a `vae/` can be decoded here. The latents are what the pipeline returns
with `output_type="latent"`; each VAE kind is undone as its pipelines undo it before `vae.decode`:
AutoencoderKL (PixArt, SD3, Flux, Z-Image) by its scaling and shift factors; the Wan-style VAE (Qwen-Image)
by its per-channel mean and std, one frame; FLUX.2's by its batch norm and the 2×2 patchification ([klein]
returns its latents already so, [dev] as its loop's tokens).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..families.base import unpack_2x2


def decode_to_png(model_dir: str | Path, latents: torch.Tensor, height: int, width: int, path: str | Path) -> None:
    from diffusers import AutoModel
    from diffusers.image_processor import VaeImageProcessor

    model_dir = Path(model_dir)
    if not (model_dir / "vae").is_dir():
        raise ValueError(f"{model_dir} has no vae/ folder to decode with; write latents instead (--output x.safetensors)")
    if latents.dim() not in (3, 4):
        raise ValueError(f"latents of shape {list(latents.shape)} are video: write them as .safetensors")
    vae = AutoModel.from_pretrained(str(model_dir / "vae"))
    with torch.no_grad():
        image = _decode(vae, latents.float(), height, width)
    VaeImageProcessor().postprocess(image, output_type="pil")[0].save(path)


def _decode(vae, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The VAE's sample in [-1, 1] for a pipeline's output latents."""
    config = vae.config
    if hasattr(vae, "bn"):  # FLUX.2: 2×2-patchified, batch-normalised latents
        if latents.dim() == 3:  # [dev]: its loop's tokens [B, h·w, 128], still normalised and patchified
            from diffusers import Flux2Pipeline

            batch, _, channels = latents.shape
            latents = latents.transpose(1, 2).reshape(batch, channels, height // 16, width // 16)
            std = torch.sqrt(vae.bn.running_var + config.batch_norm_eps).view(1, -1, 1, 1)
            latents = Flux2Pipeline._unpatchify_latents(latents * std + vae.bn.running_mean.view(1, -1, 1, 1))
        return vae.decode(latents).sample
    if "latents_mean" in config and config.latents_mean is not None:  # Wan-style (Qwen-Image): 3-D, one frame
        if latents.dim() == 3:
            latents = unpack_2x2(latents, height, width, 2 ** len(config.temperal_downsample))
        mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
        return vae.decode(latents[:, :, None] * std + mean).sample[:, :, 0]
    if latents.dim() == 3:  # packed pipelines (Flux): tokens of 2×2 latent pixels back to a latent image
        latents = unpack_2x2(latents, height, width, 2 ** (len(config.block_out_channels) - 1))
    return vae.decode(latents / config.scaling_factor + (getattr(config, "shift_factor", None) or 0.0)).sample
