"""What a PipeFusion patch sees of the others: the running patch (PatchContext, set while it runs) and the stale
K/V cache its attention reads (the other patches' K/V from their latest computation, pipefusion.py)."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PatchContext:
    index: int  # the image patch (-1: the text patch)
    count: int  # image patches
    asynchronous: bool  # False in warm-up: the whole sequence as one patch, caches refreshed
    branch: str
    text_apart: bool = False  # the text is a patch of its own (image patches hold `stand_in` text tokens)
    stand_in: int = 1  # tokens a patch holds of the stream it does not carry

    @property
    def text_only(self) -> bool:
        return self.index < 0


_PATCH: contextvars.ContextVar[PatchContext | None] = contextvars.ContextVar("xdit_patch", default=None)



@contextlib.contextmanager
def running(context: PatchContext):
    """Mark `context` as the running patch for the length of the block."""
    token = _PATCH.set(context)
    try:
        yield
    finally:
        _PATCH.reset(token)


class StaleKVCache:
    """Per (guidance branch, attention layer): the whole image's K/V, each patch's slice from its latest
    computation, and with the text apart, the text's K/V from this step's text patch.

    K/V arrive in the layout attention uses after the Ulysses all-to-all: [B, H/U, U × tokens, D],
    the U token groups being each Ulysses rank's share. A patch is the same slice of every share. A patch's
    fresh K/V are written into its slice in place, so a patch moves its own K/V, not the whole sequence's
    (joining the patches anew for each one copied all of them: M patches, M whole copies per layer).
    """

    def __init__(self, ulysses_degree: int):
        self.ulysses = ulysses_degree
        self._store: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._text: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}  # this step's, from the text patch

    def _slot(self, whole: torch.Tensor, context: PatchContext) -> torch.Tensor:
        b, h, s, d = whole.shape
        return whole.view(b, h, self.ulysses, context.count, s // (self.ulysses * context.count), d)[:, :, :, context.index]

    def text_tokens(self, whole: int) -> int:
        """The text tokens in the running patch's attention: an image patch with the text apart holds its stand-ins."""
        context = _PATCH.get()
        return context.stand_in if context is not None and context.text_apart and not context.text_only else whole

    def exchange(self, layer: str, kt: torch.Tensor, vt: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor):
        """Record this patch's fresh K/V; return the text and image K/V to attend to: the whole image's (and,
        for an image patch with the text apart, this step's text K/V from the text patch). The stand-ins' K/V
        (the text patch's image token, an image patch's text token) are left out."""
        context = _PATCH.get()
        if context is None:
            return kt, vt, ki, vi
        key = (context.branch, layer)
        if not context.asynchronous:
            self._store[key] = (ki.contiguous(), vi.contiguous())
            return kt, vt, ki, vi
        whole = self._store[key]
        if context.text_only:
            self._text[key] = (kt, vt)
            return (kt, vt, *whole)
        for stored, fresh in zip(whole, (ki, vi)):
            b, h, s, d = fresh.shape
            self._slot(stored, context).copy_(fresh.reshape(b, h, self.ulysses, s // self.ulysses, d))
        return (*(self._text[key] if context.text_apart else (kt, vt)), *whole)
