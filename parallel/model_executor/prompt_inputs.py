"""A prompt as contract E's inputs (IN): the pipeline's own text encoders and its own initial noise.

Rank 0 of a pool computes them for `python -m workers sample --prompt`, and `python -m parallel.make_inputs`
writes them to a file; both equal what the diffusers pipeline computes inside
`__call__(prompt=…, negative_prompt=…, generator=torch.Generator().manual_seed(seed))`.
"""

from __future__ import annotations

import torch

NEGATIVE = {
    "prompt_embeds": "negative_prompt_embeds",
    "pooled_prompt_embeds": "negative_pooled_prompt_embeds",
    "prompt_attention_mask": "negative_prompt_attention_mask",
    "prompt_embeds_mask": "negative_prompt_embeds_mask",
    "image_pad_mask": "negative_image_pad_mask",
}


def initial_latents(wrapper, seed: int, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The noise the pipeline draws for one image from a CPU generator seeded with `seed`."""
    return wrapper.initial_noise(torch.Generator("cpu").manual_seed(seed), height, width, dtype)


def prompt_inputs(wrapper, prompt: str, negative_prompt: str, seed: int, height: int, width: int,
                  image: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`wrapper`: the engine's pipeline wrapper, whose `encode_text` is the pipeline's own `encode_prompt`; with
    `image` (reference pictures [N, 3, H, W] in [0, 1]) both prompts are encoded with them, as an edit pipeline
    whose text encoder sees its references does (Qwen-Image-Edit: `image` then holds their latents; Qwen-Image 2.1:
    the pictures, and each prompt's `image_pad_mask`, where its pictures sit)."""
    def encode(text: str) -> dict[str, torch.Tensor]:
        return dict(wrapper.encode_text(text) if image is None else wrapper.encode_text_with_images(text, image))

    with torch.no_grad():
        tensors = encode(prompt)
        if "negative_prompt_embeds" in wrapper.call_parameter_names():  # FLUX.2 [dev]: none
            negative = encode(negative_prompt)
            negative.pop("image", None)  # the same references' latents (or pictures)
            tensors.update({NEGATIVE[name]: value for name, value in negative.items()})
    tensors["latents"] = initial_latents(wrapper, seed, height, width, tensors["prompt_embeds"].dtype)
    return {name: value.cpu().contiguous() for name, value in tensors.items()}


def reference_pictures(paths: list[str]) -> torch.Tensor:
    """Picture files (PNG, JPEG, WebP, …) as reference images [N, 3, H, W] in [0, 1]: 8-bit RGB, as ComfyUI's
    LoadImage reads them. One size for all (they travel as one tensor)."""
    import numpy as np
    import PIL.Image

    pictures = []
    for path in paths:
        try:
            with PIL.Image.open(path) as picture:
                pictures.append(np.asarray(picture.convert("RGB")))
        except FileNotFoundError:
            raise ValueError(f"--image {path}: no such file") from None
        except PIL.UnidentifiedImageError:
            raise ValueError(f"--image {path}: not a picture (PNG, JPEG, WebP, …)") from None
    if len({picture.shape for picture in pictures}) > 1:
        sizes = ", ".join(f"{p.shape[1]}x{p.shape[0]}" for p in pictures)
        raise ValueError(f"--image: the reference pictures must share one size (these are {sizes}); resize them alike")
    return torch.from_numpy(np.stack(pictures)).permute(0, 3, 1, 2).float() / 255
