"""Data parallel over the batch: each dp rank takes its slice of every per-sample argument (uneven splits
allowed), and the outputs are gathered back in order."""

from __future__ import annotations

from typing import Any

import torch


def batch_size(kwargs: dict[str, Any]) -> int:
    for key in ("latents", "prompt_embeds"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key].shape[0]
    prompt = kwargs.get("prompt")
    return len(prompt) if isinstance(prompt, list) else 1


PER_SAMPLE_LISTS = ("prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3", "generator")


def split_batch(kwargs: dict[str, Any], batch: int, shared: tuple[str, ...], dp,
                counts: list[int] | None) -> tuple[dict[str, Any], list[int] | None]:
    """This dp rank's arguments (`shared`: inputs every sample shares, never split) for its share `counts` of the batch
    (the layout's batch_split; None: this rank runs the whole batch)."""
    if counts is None:
        return dict(kwargs), None
    start = sum(counts[: dp.rank_in_group])
    local = {k: v if k in shared else take(k, v, batch, start, counts[dp.rank_in_group]) for k, v in kwargs.items()}
    return local, counts


def take(name: str, value: Any, batch: int, start: int, count: int) -> Any:
    """This dp rank's slice of a per-sample argument (batched tensors, per-prompt lists)."""
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value[start : start + count]
    if name in PER_SAMPLE_LISTS and isinstance(value, list) and len(value) == batch:
        return value[start : start + count]
    return value


def gather_batch(output: Any, counts: list[int], dp) -> Any:
    """Reassemble the batch from every dp rank (padded to equal size for the collective): the images, and every other
    per-sample tensor the pipeline returns beside them (LTX-2's audio)."""
    images = output[0] if isinstance(output, tuple) else output.images
    if not isinstance(images, torch.Tensor):
        raise ValueError("data parallel returns tensors only: call with output_type='latent' or 'pt'")
    if isinstance(output, tuple):
        mine = counts[dp.rank_in_group]
        return tuple(_gather(item, counts, dp) if isinstance(item, torch.Tensor) and item.ndim and len(item) == mine
                     else item for item in output)
    output.images = _gather(images, counts, dp)
    return output


def _gather(tensor: torch.Tensor, counts: list[int], dp) -> torch.Tensor:
    padded = torch.zeros((max(counts), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    gathered = dp.all_gather(padded.unsqueeze(0), dim=0)
    return torch.cat([gathered[i, :n] for i, n in enumerate(counts)])
