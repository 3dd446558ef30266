"""Shape lookups for the families' checkpoint readers: each failure names the file, the family and the key."""

from __future__ import annotations

import re
from pathlib import Path


def block_indices(shapes: dict, pattern: str) -> list[int]:
    """Sorted indices N of keys matching `pattern` (a regex with one (\\d+) group)."""
    return sorted({int(m.group(1)) for k in shapes if (m := re.match(pattern, k))})


class Shapes:
    """A checkpoint's tensor shapes as one family's reader sees them."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], family: str):
        self.path, self.shapes, self.family = path, shapes, family

    def __contains__(self, key: str) -> bool:
        return key in self.shapes

    def __call__(self, key: str) -> tuple[int, ...]:
        try:
            return self.shapes[key]
        except KeyError:
            raise ValueError(f"{self.path} looks like a {self.family} checkpoint but has no tensor {key!r}: "
                             "the file is incomplete or a variant this pack does not support") from None

    def named(self, word: str) -> bool:
        """Whether the file's name holds `word` whole (between non-letters, any case): for what the weights cannot
        show and the released files' names do (FLUX.1 Kontext, FLUX.2 [klein] base)."""
        return re.search(rf"(?<![A-Za-z]){re.escape(word)}(?![A-Za-z])", self.path.name, re.IGNORECASE) is not None

    def error(self, text: str) -> ValueError:
        return ValueError(f"{self.path}: {text}")

    def blocks(self, pattern: str) -> int:
        indices = block_indices(self.shapes, pattern)
        if indices != list(range(len(indices))):
            raise self.error(f"{self.family} block indices {indices} are not 0..N-1: the file is incomplete")
        return len(indices)

    def heads(self, hidden: int, head_dim: int) -> int:
        if hidden % head_dim:
            raise self.error(f"{self.family} hidden size {hidden} is not a multiple of its head size {head_dim}")
        return hidden // head_dim
