"""Uneven sequence splits: shards that differ by at most one token, padded to one length.

A video's token count (latent frames × height patches × width patches) often does not divide by the
sequence-parallel degree. Sequence-parallel rank r then holds `tensor_split`'s r-th shard, padded at
its end with copies of its last token to the longest shard's length, so every collective (all-to-all,
ring exchange, all-gather) keeps equal sizes. Attention drops the padded keys (`keep`) and the gather
drops the padded rows, so the result is exactly the unsplit one; padded query rows are computed and
thrown away.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UnevenSplit:
    sizes: tuple[int, ...]  # real tokens per sequence-parallel rank, in sp-group order
    ulysses: int  # Ulysses degree: ring member r gathers the shards r*ulysses ... r*ulysses+ulysses-1

    @classmethod
    def of(cls, tokens: int, degree: int, ulysses: int) -> "UnevenSplit":
        return cls(tuple(len(part) for part in torch.arange(tokens).tensor_split(degree)), ulysses)

    @property
    def length(self) -> int:
        """Every rank's padded shard length."""
        return self.sizes[0]

    def shard(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        part = tensor.tensor_split(len(self.sizes), dim=dim)[rank]
        missing = self.length - part.shape[dim]
        if not missing:
            return part
        # Repeat the last token rather than pad with zeros: a zero key (zero rotary) gets almost no
        # weight, so a missing key drop would hide; a duplicate key doubles a real one's weight.
        last = part.narrow(dim, part.shape[dim] - 1, 1)
        return torch.cat([part, *[last] * missing], dim=dim)

    def unpad(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """The unsplit tensor from the all-gather of every rank's padded shard."""
        parts = gathered.split(self.length, dim=dim)
        return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, self.sizes)], dim=dim)

    @functools.cached_property
    def keep(self) -> list[torch.Tensor]:
        """Per ring member: positions of the real tokens in its K/V after the Ulysses all-to-all."""
        u, length = self.ulysses, self.length
        return [
            torch.cat([j * length + torch.arange(self.sizes[r * u + j]) for j in range(u)])
            for r in range(len(self.sizes) // u)
        ]
