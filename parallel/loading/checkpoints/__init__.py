"""Single-file transformer checkpoints (flux1-dev.safetensors, sd3.5_large.safetensors, PixArt .pth) as
ComfyUI users keep them: detection here (no diffusers import), loading in `load`."""

from .detect import CHECKPOINT_SUFFIXES, CheckpointFile, Detected, checkpoint_variant, detect_checkpoint, supported_list, supported_variants

__all__ = ["CHECKPOINT_SUFFIXES", "CheckpointFile", "Detected", "checkpoint_variant", "detect_checkpoint",
           "supported_list", "supported_variants"]
