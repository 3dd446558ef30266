"""ComfyUI's own view of a diffusion-model file, without loading its weights.

A MODEL of the pool is ComfyUI's own model class for the file (its model sampling, latent format,
conditioning), detected by ComfyUI's own code (`comfy.model_detection`) from the file's tensor names and shapes,
and built on the meta device: so it holds no weights, yet it knows the names ComfyUI gives every weight, which
ComfyUI's LoRA loaders match a LoRA's keys against (comfy.lora.model_lora_keys_unet).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import comfy.utils
from comfy import model_detection

from ..parallel.loading.checkpoints import CheckpointFile

META = torch.device("meta")


@dataclass(frozen=True)
class ComfyFile:
    """What ComfyUI makes of a file: its model config and its diffusion model's weight names and shapes."""

    path: Path
    model_config: object  # a comfy.supported_models class, configured for the file
    weights: dict[str, torch.Size]  # ComfyUI's own names (its diffusion model's state dict), without a prefix


def read(path: str | Path) -> ComfyFile:
    """The file as ComfyUI's UNETLoader would detect it; one error naming the file when ComfyUI cannot."""
    path = Path(path)
    checkpoint = CheckpointFile(path)
    state = {checkpoint.prefix + name: torch.empty(shape, device=META) for name, shape in checkpoint.shapes.items()}
    prefix = model_detection.unet_prefix_from_state_dict(state)
    state = comfy.utils.state_dict_prefix_replace(state, {prefix: ""}, filter_keys=True) or state
    config = model_detection.model_config_from_unet(state, "")
    if config is None:
        converted = model_detection.convert_diffusers_mmdit(state, "")
        config = model_detection.model_config_from_unet(converted, "") if converted is not None else None
        state = converted if config is not None else state
    if config is None:
        raise ValueError(f"ComfyUI does not recognise {path.name} as a diffusion model it can load (UNETLoader would "
                         "not either); choose the transformer file of a supported model")
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model(state, "", device=META)
    weights = {name: tensor.shape for name, tensor in model.diffusion_model.state_dict().items()}
    return ComfyFile(path, config, weights)
