"""Declarative parallel plans: what a transformer splits, where it gathers, which attention is joint.

A family's transformer wrapper is mostly one `ParallelPlan`, in the spirit of diffusers' `_cp_plan`.
Hooks apply it to the untouched diffusers module (see hooks.py); the capability table is derived
from the plans, so there is exactly one place that declares what a family supports.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..layout.config import LayoutError
from .attention import TextLayout


@dataclass(frozen=True)
class Split:
    """Shard this tensor along `dim` (the token axis) over the sequence-parallel group.

    items: for a module whose output is a tuple, the positions to shard (Wan's rotary embedding
    returns (cos, sin), both per token); None shards the main output only.
    ndim:  shard only tensors with this many dimensions (Wan 2.2 TI2V's per-token timesteps are
    [B, S]; other Wan models pass one timestep per sample, [B]).
    expected_dims: the number of dimensions this tensor must have; any other is a LayoutError, so a
    diffusers upgrade that reshapes it fails loudly instead of splitting the wrong axis.
    text: a text input of joint attention (its tokens, their rotary ids). Sharded with the image tokens
          when its length divides by the degree and the image tokens split evenly (as diffusers' context
          parallelism does: every rank then projects and runs 1/N of the text, and attention gathers the
          whole sequence for its heads); otherwise left whole on every rank (replicated text). Never
          under PipeFusion, whose text patch carries the whole text.
    after_text: the call's replicated text rows lead this tensor (ParallelPlan.text_rows): they stay whole, the
          rows after them split.
    """

    dim: int
    items: tuple[int, ...] | None = None
    ndim: int | None = None
    expected_dims: int | None = None
    text: bool = False
    after_text: bool = False


@dataclass(frozen=True)
class Gather:
    """All-gather this tensor along `dim` over the sequence-parallel group, undoing a Split.

    expected_dims: as for Split. after_text: as for Split (the whole text rows kept ahead of the gathered ones).
    """

    dim: int
    expected_dims: int | None = None
    after_text: bool = False


@dataclass(frozen=True)
class TextRows:
    """Where a transformer keeps its replicated text inside one joined stream its blocks take (Qwen-Image 2.1: the
    text and condition-image tokens ahead of the target image's, [prefix; image]): the block argument `mask` at
    `path` marks the image's rows (true) after the text's (false); their count is the call's text length (runtime
    text_tokens) for Split/Gather(after_text) and the attention. A later family with a joined stream whose text
    stays whole names its mask here."""

    path: str
    mask: str


def check_dims(tensor: torch.Tensor, op: Split | Gather, module: str, what: str) -> None:
    """One LayoutError line when `tensor` has not the number of dimensions the plan was written for."""
    if op.expected_dims is not None and tensor.ndim != op.expected_dims:
        raise LayoutError(
            f"the parallel plan expects {what} of {module} with {op.expected_dims} dimensions, got {tensor.ndim} "
            f"(shape {list(tensor.shape)}): this diffusers version changed its layout; update the plan's "
            f"{type(op).__name__}(dim={op.dim}, expected_dims={op.expected_dims}) or install the tested diffusers version."
        )


class CfgMode(enum.Enum):
    """How the pipeline presents the two guidance branches to the transformer."""

    BATCHED = "batched"  # one call on cat([uncond, cond]) (PixArt, SD3): split the batch
    SEQUENTIAL = "sequential"  # two calls per step in cache_context("cond"/"uncond") (Flux true CFG)


@dataclass(frozen=True)
class TokenRows:
    """A block argument with one entry per token along `dim`, which PipeFusion slices to each patch.

    text: where the text tokens' rows sit (whole with the text patch, a stand-in row with an image patch);
          NONE: image rows only.
    ndim: slice only tensors with this many dimensions; others pass whole (Wan 2.2 TI2V's per-token
          modulation is [B, S, 6, D]; the other Wan models pass one per sample, [B, 6, D]).
    items: for a tuple, the positions that hold image rows (Qwen-Image's (image, text) rotary tables);
           None: every one. The other positions hold text rows only (whole with the text, none without).
    """

    dim: int = 0
    text: TextLayout = TextLayout.NONE
    ndim: int | None = None
    items: tuple[int, ...] | None = None


@dataclass(frozen=True)
class JoinedStream:
    """Blocks that take the text and image streams as one sequence, [text; image] on dim 1, in the first carried
    argument and return it so (FLUX.2's single blocks, after the transformer concatenates the two streams):
    the stage joins the text and each patch before them and splits them after, so patches still flow between
    stages as (image patch, text).

    text:   the carried argument of the other blocks that holds the text stream (None for these blocks).
    inputs: arguments of these blocks that the transformer computes once per call from a submodule (FLUX.2:
            `temb_mod` is the output of `single_stream_modulation`), captured when that submodule runs, since a
            stage may run them from the call of an earlier block.
    """

    text: str = "encoder_hidden_states"
    inputs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TextPadding:
    """Text padding a transformer keeps (HunyuanVideo 1.5 orders each sample's text valid tokens first and masks
    the rest): before the blocks at the plan path, the text tokens past every sample's last valid one are dropped
    with their mask columns. Exact: masked keys take no weight and the dropped tokens' own outputs are never
    read. Sequence-parallel attention takes no mask, so there a batch whose samples still differ in valid length
    is refused; with none left masked, the call is marked so (runtime state) and the attention drops the mask
    without looking at it.

    text: the block argument holding the text stream; mask: its [B, tokens] mask (true or 1: valid).
    order_free: the text tokens carry no position (Krea 2: its text rows sit at the rotary origin and its text
          fusion has none), so masked tokens anywhere (Krea 2 pads between the prompt and the chat suffix) are
          dropped: each sample's valid tokens move to the front, in order, before the trim. Exact for the same
          reasons; any later family whose text is position-free takes padding anywhere with this flag.
    rows: arguments with one row per token on dim 0, the text's (alike: Krea 2's rotary positions, all at the
          origin) ahead of the image's, whose text rows are cut to the trimmed text's length.
    """

    text: str = "encoder_hidden_states"
    mask: str = "attention_mask"
    order_free: bool = False
    rows: tuple[str, ...] = ()


@dataclass(frozen=True)
class PatchFlow:
    """What lets PipeFusion's patches flow across steps (pipefusion.py): the modules that take a patch's latents to
    the blocks' image stream and the last block's image stream to the model's prediction, each token on its own, so
    the last stage can finish a patch's step and the first stage start its next step without the whole image.
    The latents' tokens are on dim 1, as the image stream's.

    embedder: module path from the latents (the transformer's image input) to the first block's image stream.
    output:   (module path, block arguments it takes after the image stream), in order, from the last block's image
              stream to the prediction; run without the plan's hooks (the sequence-parallel Gather of the whole output).
    """

    embedder: str
    output: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class PipeFusionPlan:
    """How the repeated blocks run as a patch pipeline (PipeFusion).

    blocks:       ModuleLists of repeated blocks, in execution order (partitioned into stages).
    carried:      block arguments that flow from block to block; the first is the image tokens
                  (split into patches on dim 1), the others (the text stream) form the text patch
                  (pipefusion.py: once per step, ahead of the image patches).
    returns:      the block's outputs in order, named like `carried` (a single name: a bare tensor).
    token_inputs: other block arguments holding one entry per token (tuples of such tensors too),
                  sliced to each patch (rotary tables, per-token modulation); see TokenRows.
    joined:       block lists (of `blocks`) that take the two streams joined; see JoinedStream.
    stand_in:     tokens a patch holds of the stream it does not carry (pipefusion.py): 1 where the blocks cannot
                  take a stream of no tokens (Qwen-Image's rotary `reshape(..., -1, 2)`, HunyuanVideo 1.5's
                  `[:, :-0]`), 0 where they can (Flux), which spares each patch the other stream's weights.
    flow:         how patches flow across steps after warm-up; None: every step ends on every stage (PatchFlow).
    """

    blocks: tuple[str, ...]
    carried: tuple[str, ...] = ("hidden_states",)
    returns: tuple[str, ...] = ("hidden_states",)
    token_inputs: dict[str, TokenRows] = field(default_factory=dict)
    joined: dict[str, JoinedStream] = field(default_factory=dict)
    stand_in: int = 1
    flow: PatchFlow | None = None


@dataclass(frozen=True)
class Replicated:
    """A token stream every sequence-parallel rank holds whole, and why that costs less than splitting it (LTX-2's
    audio: its attention and feed-forward run on every rank, in exchange for no collective of its own; its tokens
    are a hundredth of the video's). Attention among its own tokens, and from the split tokens to it, then runs
    locally; attention from it to the split tokens is declared in `ParallelPlan.replicated_queries`."""

    stream: str  # what users call it ("audio", "text")
    why: str


@dataclass(frozen=True)
class ParallelPlan:
    """How a transformer class is parallelised.

    inputs:    module path ("" = the transformer) → {forward argument: Split}, applied before it runs. A path
               part "*" names every child at that level, "-1" the last one (Z-Image's per-block rotary tables:
               "layers.*"; the tokens entering the first block: "layers.0").
    outputs:   module path → Split or Gather, applied to the module's output (first element of a tuple).
    attention: glob over module paths → where that attention keeps replicated text tokens; every
               matching attention runs USP. Attention not listed (e.g. cross-attention) stays local.
    text_input: the forward argument whose token count is the text length for joint attention; None: the
               attention sees one sequence, split alike (Z-Image's unified image + text sequence).
    image_input: the forward argument holding the latents (a tensor, or one tensor per sample in a list, as
               Z-Image takes them: CFG parallel splits either along the batch).
    cfg:       how guidance branches arrive (see CfgMode).
    text_padding: module path (each block) → TextPadding, for transformers that carry masked text padding.
    pipefusion: how the blocks form a patch pipeline, if the family supports PipeFusion.
    output_channels: the config entry giving the output's channels (dim 1) when they differ from the
               input's (Wan image-to-video takes 36, returns 16); None: the output is shaped like the input.
    text_rows: where the blocks' joined stream keeps the replicated text (TextRows); None: nowhere.
    output_tail: the output holds other tokens ahead of the image's (Qwen-Image 2.1: its prefix, of each prompt's
               length), of which the pipeline keeps the last image tokens: CFG parallel exchanges those alone.
    predictions: how many leading items of the transformer's output are per-sample predictions, which CFG parallel
               gathers over its ranks (LTX-2 returns video and audio: 2).
    replicated: forward argument → Replicated: the token streams left whole on every rank, and why (the plan
               states it; the capability table shows it).
    replicated_queries: globs over attention module paths whose queries come from a replicated stream and whose
               keys and values come from the split tokens (LTX-2's video-to-audio attention): each rank attends to its
               own key shard and the partial results merge by their log-sum-exp over the sequence-parallel group.
    attention_masks: globs over `attention` module paths → the forward argument holding that layer's additive mask
               [B, (H,) queries, keys] (LTX-2's IC-LoRA reference strengths in the video's self-attention). Its query
               rows are per token: split them with the tokens in `inputs`, as any per-token input. Its key columns
               stay whole (every real token, in sequence order): the layer takes the mask out of the processor's call
               and USP applies it where the keys are, the rows gathered over Ulysses as the queries are, each Ring
               block with its own members' columns.
    no_pipefusion: why the blocks cannot run as a patch pipeline, where they cannot (said by --list-supported and
               when a PipeFusion degree is asked for).
    """

    inputs: dict[str, dict[str, Split]] = field(default_factory=dict)
    outputs: dict[str, Split | Gather] = field(default_factory=dict)
    attention: dict[str, TextLayout] = field(default_factory=dict)
    text_input: str | None = "encoder_hidden_states"
    image_input: str = "hidden_states"
    cfg: CfgMode = CfgMode.BATCHED
    cfg_branches: tuple[str, str] = ("uncond", "cond")
    uneven_tokens: bool = False
    text_padding: dict[str, TextPadding] = field(default_factory=dict)
    pipefusion: PipeFusionPlan | None = None
    output_channels: str | None = None
    predictions: int = 1
    replicated: dict[str, Replicated] = field(default_factory=dict)
    replicated_queries: tuple[str, ...] = ()
    attention_masks: dict[str, str] = field(default_factory=dict)
    text_rows: TextRows | None = None
    output_tail: bool = False
    no_pipefusion: str = ""

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.attention)
