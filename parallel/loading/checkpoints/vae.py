"""A VAE file beside a single-file transformer (`--vae`, ComfyUI's models/vae): for pipelines that encode a
start image (image-to-video) or denormalise its latents (FLUX.2 [klein]), and for decoding on the pool
(xDiT VAE Decode).

The family declares the VAE's layout (`SingleFile.vae`: a marker tensor and a reader for the config values
the shapes pin down, and a converter where diffusers has none); the detected variant ships the rest of its
config (parallel/loading/checkpoints/configs/<variant>/vae), and diffusers' single-file loader (or the family's converter)
converts the original layout, from this config only: nothing from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import torch
from accelerate import init_empty_weights

from .detect import CheckpointFile, Detected
from .shapes import Shapes


def vae_config_dir(detected: Detected) -> Path | None:
    """The shipped config folder whose `vae/` describes this variant's VAE, or None where no VAE file loads."""
    return detected.config_dir if (detected.config_dir / "vae" / "config.json").is_file() else None


def load_vae(path: str | Path, detected: Detected, dtype: torch.dtype | None):
    """The VAE in the file at `path`, for the model `detected`; one error naming the file and what fits."""
    layout = detected.single_file.vae
    title = detected.single_file.variants[detected.variant].title
    if layout is None or vae_config_dir(detected) is None:
        raise ValueError(f"{Path(path).name}: no VAE file loads beside {title} yet; decode with ComfyUI's VAE Decode "
                         "(or use the model's diffusers folder, which has its VAE)")
    checkpoint = CheckpointFile(path)
    if layout.marker not in checkpoint.shapes:
        sample = sorted(checkpoint.shapes)[:3]
        raise ValueError(f"{checkpoint.path} is not a {layout.title} file (first tensors: {sample}); {title} takes "
                         f"the {layout.title} from ComfyUI's models/vae")
    overrides = layout.read(Shapes(checkpoint.path, checkpoint.shapes, layout.title))
    config = json.loads((detected.config_dir / "vae" / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    state_dict = checkpoint.state_dict()
    dtype = dtype or next(iter(state_dict.values())).dtype
    try:
        if layout.convert is None:
            vae = cls.from_single_file(state_dict, config=str(detected.config_dir), subfolder="vae",
                                       local_files_only=True, torch_dtype=dtype, **overrides)
        else:
            with init_empty_weights():
                vae = cls.from_config({**config, **overrides})
            converted = layout.convert(state_dict, vae.config)
            vae.load_state_dict({k: v.to(dtype) for k, v in converted.items()}, strict=True, assign=True)
    except (ValueError, RuntimeError, KeyError) as error:  # tensors that do not fit the layout's config
        raise ValueError(f"{checkpoint.path} does not load as the {layout.title}: {str(error)[:300]}. The file is "
                         "damaged or another VAE") from None
    return vae.eval()
