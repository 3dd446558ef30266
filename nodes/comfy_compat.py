"""Everything that differs between the ComfyUI versions this pack supports (0.3.64, the oldest, to 0.33), in one place.

The rest of nodes/ speaks the API both versions share (the names in `comfy_api.latest.io.__all__`, inputs by keyword)
and asks here where they part:

- Latent formats. ComfyUI 0.33 has FLUX.2's and HunyuanVideo 1.5's (`comfy.latent_formats.Flux2`, `HunyuanVideo15`);
  0.3.64 has neither, and 0.33 has no Qwen-Image 2.1 one (`QwenImage21`, a per-channel standardisation). ComfyUI's
  own class is used wherever it exists; only where it does not does the family's declaration (parallel/families,
  `DeclaredLatentFormat`) stand in. Which one was taken is logged once per format, so a test (and a user) can tell.
- Previews. 0.33's Latent2RGBPreviewer unfolds patch-channel latents (FLUX.2's `latent_rgb_factors_reshape`) itself;
  0.3.64's takes no such argument. The pack unfolds them once, before either previewer sees them.
- Model calls. ComfyUI 0.31 changed LTXAV's block order (PR 15138: each block's video-to-audio attention reads the
  video after the audio-to-video update); a family declares such changes (ComfyData.model_call_versions) and each
  model call asks the pool for the order of this ComfyUI (`model_call_versions`).
- Interrupts. `comfy.model_management.InterruptProcessingException` derives from Exception in 0.3.64 and from
  BaseException in 0.33, so `except Exception` catches it in one and not the other: it is caught by its own name here.

ComfyUI modules are imported where they are used, so the unit tests can stand in for them (tests/test_families.py).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Callable

_told: set[tuple[str, str]] = set()


def latent_format(name: str, declared, pipeline: str):
    """ComfyUI's latent format object `name` (process_in/out, preview factors): this ComfyUI's own class, or where
    it has none, one made from the family's declaration (`declared`, a DeclaredLatentFormat, or None)."""
    import comfy.latent_formats

    native = getattr(comfy.latent_formats, name, None)
    if native is not None:
        _tell(pipeline, name, f"ComfyUI's own comfy.latent_formats.{name}")
        return native()
    if declared is None:
        return None
    _tell(pipeline, name, f"the pack's declared {name} format (this ComfyUI has no comfy.latent_formats.{name})")
    made = comfy.latent_formats.LatentFormat()  # process_in/out: × / ÷ scale_factor
    made.latent_channels, made.spacial_downscale_ratio = declared.channels, declared.spatial
    made.latent_dimensions, made.scale_factor = declared.dimensions, declared.scale_factor
    made.latent_rgb_factors = [list(row) for row in declared.rgb_factors] if declared.rgb_factors else None
    made.latent_rgb_factors_bias = list(declared.rgb_bias) if declared.rgb_bias else None
    if declared.preview_unfold > 1:
        made.latent_rgb_factors_reshape = functools.partial(unfold_patches, patch=declared.preview_unfold)
    if declared.latents_mean is not None:
        _standardise(made, declared)
    return made


def _standardise(made, declared) -> None:
    """process_in/out as ComfyUI's standardising formats write them (Wan21, QwenImage21): per-channel mean and std."""
    import torch

    shape = (1, declared.channels) + (1,) * declared.dimensions
    mean, std = (torch.tensor(values).view(shape) for values in (declared.latents_mean, declared.latents_std))
    made.latents_mean, made.latents_std = mean, std

    def process_in(latent):
        return (latent - mean.to(latent)) * made.scale_factor / std.to(latent)

    def process_out(latent):
        return latent * std.to(latent) / made.scale_factor + mean.to(latent)

    made.process_in, made.process_out = process_in, process_out


def model_call_versions(versions: dict[str, str], batch: int) -> dict:
    """Each model-call input of ComfyData.model_call_versions (input → the first ComfyUI version computing so), [batch]:
    1 where this ComfyUI has reached that version, 0 where not."""
    if not versions:
        return {}
    import torch
    from comfyui_version import __version__

    here = _release(__version__)
    return {name: torch.full((batch,), float(here >= _release(since))) for name, since in versions.items()}


def _release(version: str) -> tuple[int, ...]:
    """"0.31.0" (or "0.31.0rc1") as (0, 31, 0), to compare."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _tell(pipeline: str, name: str, what: str) -> None:
    if (pipeline, name) not in _told:
        _told.add((pipeline, name))
        logging.info("xDiT: %s latents in %s", pipeline, what)


def unfold_patches(latents, patch: int):
    """[B, C·p·p, h, w] with (c, p, p) patches in channels → [B, C, h·p, w·p] (FLUX.2's preview)."""
    b, channels, h, w = latents.shape
    c = channels // (patch * patch)
    return latents.view(b, c, patch, patch, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c, h * patch, w * patch)


def previewer(latent_format) -> tuple[object | None, Callable | None]:
    """ComfyUI's previewer for the latent format, and what its latents go through first. Latent-to-RGB previews of
    patch-channel latents (FLUX.2) are unfolded here, once: 0.33's previewer would unfold them itself, 0.3.64's
    cannot, so the previewer is told not to."""
    import latent_preview

    chosen = latent_preview.get_previewer("cpu", latent_format)
    if chosen is None and latent_format.latent_rgb_factors is None:
        return None, None  # a format without preview factors (HunyuanVideo 1.5's, as declared for ComfyUI 0.3.64)
    if chosen is None:  # --preview-method none still gets the cheap latent-to-RGB preview
        chosen = latent_preview.Latent2RGBPreviewer(latent_format.latent_rgb_factors, latent_format.latent_rgb_factors_bias)
    unfold = getattr(latent_format, "latent_rgb_factors_reshape", None)
    if unfold is None or not isinstance(chosen, latent_preview.Latent2RGBPreviewer):
        return chosen, lambda x: x
    chosen.latent_rgb_factors_reshape = None
    return chosen, unfold


def progress_interrupted(progress, value: int, total: int, preview=None) -> bool:
    """Report progress; True when ComfyUI's interrupt came with it (its progress hook raises the interrupt)."""
    import comfy.model_management

    try:
        progress.update_absolute(value, total, preview)
    except comfy.model_management.InterruptProcessingException:  # BaseException in 0.33: by name, never `Exception`
        return True
    return False


def interrupt_requested() -> bool:
    import comfy.model_management

    return comfy.model_management.processing_interrupted()


def raise_interrupted():
    """End the node as ComfyUI ends an interrupted one (its own exception, whatever it derives from)."""
    import comfy.model_management

    comfy.model_management.throw_exception_if_processing_interrupted()
    raise comfy.model_management.InterruptProcessingException()


def latent_streams(samples) -> tuple:
    """A LATENT's samples as their streams: an AV latent's (a NestedTensor: video, audio), or the one tensor."""
    if getattr(samples, "is_nested", False) and hasattr(samples, "tensors"):
        return tuple(samples.unbind())
    return (samples,)


def nested_latent(*tensors):
    """ComfyUI's NestedTensor of streams (0.33's AV latents; 0.3.64 has none and makes no AV latent to sample)."""
    import comfy.nested_tensor

    return comfy.nested_tensor.NestedTensor(tensors)
