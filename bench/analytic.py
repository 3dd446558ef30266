"""What a layout must send, and how much work it leaves replicated: the yardsticks for the measurements.

Both models count per rank and per denoising step, for Flux-style joint attention (text in front of
the image, every block attends over text + image). Notation: I image tokens, T text tokens, H heads
of D, L attention layers (double + single blocks), C output channels, N = U·R sequence-parallel ranks.

Bytes (`min_bytes_per_step`), what one rank puts on the wire:
- Text and image sharded alike (S = I + T: diffusers CP always; this engine where T and I both divide
  by N, `Split.text` in the family's plan): Ulysses 4·(S/N)·H·D·(U−1)/U, Ring 2·(S/R)·(H/U)·D·(R−1) per layer.
- Text replicated (this engine where T or I does not divide): Q, K, V of the local image shard go through
  one all-to-all and the output comes back through another, 4·(I/N)·H·D·(U−1)/U per layer; each rank
  computes the text queries of its H/U heads only and all-gathers that output, T·(H/U)·D·(U−1) per
  layer; Ring moves the image K and V blocks only, 2·(I/R)·(H/U)·D·(R−1) (text K/V stay local).
- Both: the final proj_out all-gather of the image tokens, (I/N)·C·(N−1) per transformer call.
- CFG parallel: one all-gather of the noise prediction per step, I·C·(cfg−1).
With true CFG on a layout without CFG parallel, every rank runs both branches: twice the SP traffic.

Work (`work_ceiling`): multiply-accumulates in the blocks, 12·d² per token per block (d = H·D: QKV,
output and a 4× MLP, in both double-block streams and the single blocks) plus 2·Sq·Sk·D per head for
attention. Ranks that replicate the text redo its share, so even with free communication the
sequence-parallel efficiency cannot exceed W(1) / (N·W(N)); sharded text replicates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layouts import Layout


@dataclass(frozen=True)
class ModelDims:
    image_tokens: int
    text_tokens: int
    heads: int
    head_dim: int
    double_blocks: int
    single_blocks: int
    out_channels: int
    element_bytes: int

    @property
    def attention_layers(self) -> int:
        return self.double_blocks + self.single_blocks


def _calls_per_rank_per_step(layout: "Layout") -> int:
    """Transformer calls one rank makes per step: both guidance branches unless CFG parallel splits them."""
    return 2 if layout.true_cfg and layout.cfg == 1 else 1


def text_sharded(layout: "Layout", m: ModelDims) -> bool:
    """Whether the text is sharded with the image tokens under this layout (see module docstring)."""
    n = layout.ulysses * layout.ring
    return layout.engine == "diffusers-cp" or (m.text_tokens % n == 0 and m.image_tokens % n == 0)


def min_bytes_per_step(layout: "Layout", m: ModelDims) -> float:
    """Bytes one rank must send per denoising step under this layout's method (see module docstring)."""
    u, r = layout.ulysses, layout.ring
    n = u * r
    head_block = (m.heads // u) * m.head_dim  # per token, after Ulysses has split the heads
    if text_sharded(layout, m):
        sharded = m.image_tokens + m.text_tokens
        text_gather = 0
    else:
        sharded = m.image_tokens
        text_gather = m.text_tokens * head_block * (u - 1)
    ulysses = 4 * (sharded / n) * m.heads * m.head_dim * (u - 1) / u
    ring = 2 * (sharded / r) * head_block * (r - 1)
    per_call = m.attention_layers * (ulysses + text_gather + ring) + (m.image_tokens / n) * m.out_channels * (n - 1)
    cfg = m.image_tokens * m.out_channels * (layout.cfg - 1)
    return (per_call * _calls_per_rank_per_step(layout) + cfg) * m.element_bytes


def work_per_rank(layout: "Layout", m: ModelDims) -> float:
    """Block multiply-accumulates one rank does per step (communication excluded)."""
    u, r = layout.ulysses, layout.ring
    n = u * r
    d = m.heads * m.head_dim
    total = m.image_tokens + m.text_tokens
    if text_sharded(layout, m):
        tokens, queries = total / n, total / r
    else:  # the text is replicated on every sequence-parallel rank
        tokens, queries = m.image_tokens / n + m.text_tokens, m.image_tokens / r + m.text_tokens
    linear = m.attention_layers * tokens * 12 * d * d
    attention = m.attention_layers * 2 * queries * total * (m.heads // u) * m.head_dim
    return (linear + attention) * _calls_per_rank_per_step(layout)


def work_ceiling(layout: "Layout", baseline: "Layout", m: ModelDims) -> float:
    """Parallel efficiency this layout would reach with free communication: W(1) / (N·W(N)) per job done."""
    return layout.replicas * work_per_rank(baseline, m) / (layout.ranks * work_per_rank(layout, m))
