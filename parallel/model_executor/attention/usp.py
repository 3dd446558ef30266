"""Unified sequence parallelism (USP): Ulysses all-to-all inside, Ring attention across.

Every rank holds its shard of the image tokens and, for joint attention (SD3, Flux), the whole text
sequence, replicated. Image Q/K/V go through the Ulysses all-to-all (tokens ↔ heads); the text's
Q/K/V are already everywhere, so each rank just keeps its own heads. Ring attention then passes the
image K/V around the ring group while each rank attends locally, merging partial results with
their log-sum-exp; text K/V join only the local block so every key counts once. Afterwards the
image output goes back through the all-to-all and the text output is all-gathered over heads.

Communication hides behind compute where the data allow: the heads go in groups, the next group's Q/K/V
all-to-all travelling while attention runs on this one and each group's output leaving as soon as it is done;
inside Ring, the next K/V block travels while the current one is attended to. The Q/K/V projections run in
diffusers' processor before this seam, so the first group's all-to-all cannot hide behind them.
"""

from __future__ import annotations

import enum
import functools
import weakref
from typing import Callable

import torch

from ...distributed.group_coordinator import GroupCoordinator
from ...layout.overlap import head_groups as overlap_head_groups
from .kernels import AttentionKernel, biased_attention, default_scale


class TextLayout(enum.Enum):
    """Where a joint-attention layer keeps the (replicated) text tokens in its sequence."""

    NONE = "none"
    PREFIX = "prefix"  # Flux: [text, image]
    SUFFIX = "suffix"  # SD3: [image, text]
    # Qwen-Image 2.1: the image attends to a replicated prefix (text, condition images: K/V only, its queries
    # image tokens alone), whose own block-causal attention runs in calls of its own, whole on every rank (seam.py)
    CAUSAL_PREFIX = "causal_prefix"


def _split_text(x: torch.Tensor, layout: TextLayout, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    if layout in (TextLayout.PREFIX, TextLayout.CAUSAL_PREFIX):
        return x[:, :, :text_tokens], x[:, :, text_tokens:]
    if layout is TextLayout.SUFFIX:
        image_tokens = x.shape[2] - text_tokens
        return x[:, :, image_tokens:], x[:, :, :image_tokens]
    return x[:, :, :0], x


def _join_text(text: torch.Tensor, image: torch.Tensor, layout: TextLayout) -> torch.Tensor:
    if layout is TextLayout.PREFIX:
        return torch.cat([text, image], dim=2)
    if layout is TextLayout.SUFFIX:
        return torch.cat([image, text], dim=2)
    return image


def merge_partial(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two softmax-normalised partial results by their log-sum-exp (fp32 accumulation)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


def key_shard_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sp: GroupCoordinator,
                        kernel: AttentionKernel, scale: float | None = None, real: int | None = None) -> torch.Tensor:
    """Queries every rank holds whole (a replicated stream: LTX-2's audio) against keys and values split over `sp`
    (the video), [B, H, S, D]: each rank attends to its own `real` keys (an uneven split's padding dropped), and the
    partial results merge by their log-sum-exp in rank order, so every rank gets the same, exact output."""
    scale = default_scale(q) if scale is None else scale
    if real is not None:
        k, v = k[:, :, :real], v[:, :, :real]
    out, lse = kernel(q, k, v, scale)
    outs = sp.all_gather(out.float().unsqueeze(0).contiguous(), dim=0)
    lses = sp.all_gather(lse.float().unsqueeze(0).contiguous(), dim=0)
    out, lse = outs[0], lses[0]
    for rank in range(1, sp.world_size):
        out, lse = merge_partial(out, lse, outs[rank], lses[rank])
    return out.to(q.dtype)


def _real_keys(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    index = index.to(k.device)
    return k.index_select(2, index), v.index_select(2, index)


def ring_attention(
    q: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    ring: GroupCoordinator,
    kernel: AttentionKernel,
    scale: float,
    keep: list[torch.Tensor] | None = None,
    biases: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attend `q` to the local K/V plus every other ring member's `k_ring`/`v_ring` block.

    The next block is already in flight while the current one is computed. With an uneven split
    every block travels padded; `keep[r]` selects the real keys of ring member r's block. `biases[r]`, where
    given, is the additive mask's columns of ring member r's real keys.
    """
    kv = torch.stack([k_ring, v_ring]).contiguous()
    pending, works = ring.ring_exchange(kv)
    out, lse = _with_bias(kernel, biases, ring.rank_in_group)(q, k_local, v_local, scale)
    out = out.float()
    for step in range(1, ring.world_size):
        for work in works:
            work.wait()
        kv = pending
        if step + 1 < ring.world_size:
            pending, works = ring.ring_exchange(kv)
        k_block, v_block, member = kv[0], kv[1], (ring.rank_in_group - step) % ring.world_size
        if keep is not None:
            k_block, v_block = _real_keys(k_block, v_block, keep[member])
        block_out, block_lse = _with_bias(kernel, biases, member)(q, k_block, v_block, scale)
        out, lse = merge_partial(out, lse, block_out, block_lse)
    return out.to(q.dtype)


def _with_bias(kernel: AttentionKernel, biases: list[torch.Tensor] | None, member: int) -> AttentionKernel:
    return kernel if biases is None else functools.partial(biased_attention, bias=biases[member])


def _bias_columns(bias: torch.Tensor, ring: GroupCoordinator, keep: list[torch.Tensor] | None,
                  block: int) -> list[torch.Tensor]:
    """The additive mask's columns (every real key, in sequence order) of each ring member's real keys: member r
    holds the shards of Ulysses ranks r*u ... r*u+u-1 after the all-to-all, one contiguous run of the sequence."""
    counts = [len(k) for k in keep] if keep is not None else [block] * ring.world_size
    if bias.shape[-1] != sum(counts):
        raise ValueError(f"the attention mask has {bias.shape[-1]} key columns but the sequence has {sum(counts)} "
                         "tokens: a plan's attention_masks entry needs the mask's keys whole, in sequence order")
    return list(bias.split(counts, dim=-1))


_GATHERED_ROWS: dict[int, torch.Tensor] = {}  # id of a live mask -> its rows of every Ulysses rank


def _rows_of_every_rank(bias: torch.Tensor, ulysses: GroupCoordinator) -> torch.Tensor:
    """The mask's query rows (dim -2) of every Ulysses rank, gathered once per mask: the transformer passes the same
    mask to each layer of a call, so the later layers reuse the first one's gather. The entry goes when the mask does
    (a finalizer), so an id is never reused while its entry is there; the mask is never changed in a call."""
    gathered = _GATHERED_ROWS.get(id(bias))
    if gathered is None:
        gathered = _GATHERED_ROWS[id(bias)] = ulysses.all_gather(bias, dim=-2)
        weakref.finalize(bias, _GATHERED_ROWS.pop, id(bias), None)
    return gathered


def _join_head_groups(parts: list[torch.Tensor], u: int) -> torch.Tensor:
    """The groups' outputs back from the all-to-all, [B, u * heads_j, S, D] each (rank-major), as [B, H, S, D]:
    rank r's heads are its groups' heads in order, so the groups interleave per rank."""
    return torch.cat([part.unflatten(1, (u, -1)) for part in parts], dim=2).flatten(1, 2)


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses: GroupCoordinator,
    ring: GroupCoordinator,
    kernel: AttentionKernel,
    text_layout: TextLayout = TextLayout.NONE,
    text_tokens: int = 0,
    scale: float | None = None,
    stale_kv: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    keep: list[torch.Tensor] | None = None,
    head_groups: int | None = 1,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence from sequence-sharded [B, H, S_local, D] inputs.

    `bias`, an additive mask [B, (1 or H,) S_local, S] (ParallelPlan.attention_masks: its query rows this rank's, its
    key columns every real token's), follows the tokens: its rows gather over Ulysses as the queries do, its heads
    are this rank's and each Ring block attends with its own members' columns.

    `stale_kv`, if given, maps this rank's text and image K/V (the image's after the Ulysses all-to-all)
    to the K/V to attend to; PipeFusion uses it to add the other patches' stale K/V (and the text
    patch's K/V for an image patch that runs without the text).
    `keep`, for an uneven split (token_split.UnevenSplit.keep), drops the padded image keys.
    `head_groups` splits each rank's heads into groups (layout/overlap.head_groups: None is off; `--layout auto`
    prices the link and sets the count that pays): the next group's Q/K/V all-to-all travels while attention runs
    on this one, and each group's output all-to-all leaves as soon as the group is done. Every head's math is
    unchanged. Not with `stale_kv` (PipeFusion stores one K/V per layer call).
    """
    scale = default_scale(q) if scale is None else scale
    u = ulysses.world_size
    heads = q.shape[1]
    if heads % u:
        raise ValueError(f"{heads} attention heads cannot be split over Ulysses degree {u}")
    h = heads // u
    groups = 1 if u == 1 or stale_kv is not None else overlap_head_groups(h, head_groups)
    text_tokens = text_tokens if text_layout is not TextLayout.NONE else 0
    (kt, ki), (vt, vi) = (_split_text(x, text_layout, text_tokens) for x in (k, v))
    if text_layout is TextLayout.CAUSAL_PREFIX:  # the prefix's keys alone: no text queries, no text output
        qt, qi, text_tokens = q[:, :, :0], q, 0
    else:
        qt, qi = _split_text(q, text_layout, text_tokens)

    # Ulysses: image tokens scatter heads / gather tokens in all-to-alls, one per head group; text keeps its own heads.
    image_qkv = torch.stack([qi, ki, vi]).unflatten(2, (u, h))  # [3, B, rank, head, S, D]
    bounds = [(int(g[0]), int(g[-1]) + 1) for g in torch.arange(h).tensor_split(groups)]

    def send(a: int, b: int):
        return ulysses.start_all_to_all(image_qkv[:, :, :, a:b].flatten(2, 3), scatter_dim=2, gather_dim=3)

    h0 = ulysses.rank_in_group * h
    if bias is not None:
        if text_tokens or stale_kv is not None:
            raise NotImplementedError("an attention mask through USP takes one sequence: no replicated text, no "
                                      "PipeFusion; run this model without them")
        bias = _rows_of_every_rank(bias, ulysses) if u > 1 else bias
        if bias.ndim == 3:  # [B, Q, K]: one mask for every head
            bias = bias.unsqueeze(1)
    pending, texts, images = send(*bounds[0]), [], []
    for j, (a, b) in enumerate(bounds):
        qkv = pending.wait()
        if j + 1 < groups:
            pending = send(*bounds[j + 1])
        text = (x[:, h0 + a : h0 + b] for x in (qt, kt, vt))
        heads_bias = None if bias is None else bias[:, h0 + a : h0 + b] if bias.shape[1] > 1 else bias
        out = _attend(*text, *qkv.unbind(0), ring=ring, kernel=kernel, scale=scale, stale_kv=stale_kv, keep=keep,
                      bias=heads_bias)
        texts.append(out[:, :, :text_tokens])
        images.append(ulysses.start_all_to_all(out[:, :, text_tokens:], scatter_dim=2, gather_dim=1))
    out_image = _join_head_groups([image.wait() for image in images], u)
    if not text_tokens:  # no replicated text (none, or sharded with the image: one sequence shard)
        return out_image
    return _join_text(ulysses.all_gather(torch.cat(texts, dim=1), dim=1), out_image, text_layout)


def _attend(qt, kt, vt, qi, ki, vi, *, ring: GroupCoordinator, kernel: AttentionKernel, scale: float,
            stale_kv: Callable[..., tuple[torch.Tensor, ...]] | None, keep: list[torch.Tensor] | None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """One head group's attention on this rank, [text, image] queries after the all-to-all, against the local K/V
    and (Ring) every other ring member's image K/V."""
    if stale_kv is not None:
        kt, vt, ki, vi = stale_kv(kt, vt, ki, vi)
    query = torch.cat([qt, qi], dim=2)
    ki_real, vi_real = (ki, vi) if keep is None else _real_keys(ki, vi, keep[ring.rank_in_group])
    k_local, v_local = torch.cat([kt, ki_real], dim=2), torch.cat([vt, vi_real], dim=2)
    biases = None if bias is None else _bias_columns(bias, ring, keep, ki.shape[2])
    if ring.world_size == 1:
        return _with_bias(kernel, biases, 0)(query, k_local, v_local, scale)[0]
    return ring_attention(query, k_local, v_local, ki, vi, ring, kernel, scale, keep, biases)
