"""Per-rank activation memory of one transformer call of the video-with-sound families, LTX-2.3 and MiniMax-H3:
analytic models at a rank's share of the tokens, and the mini models bench/memory_table.py measures them on.

Both count, step by step, the tensors alive at once, following diffusers' blocks and this engine's plans
(parallel/families/ltx2, minimax_h3) and its sequence-parallel attention (the USP buffers are those Wan's model
counts, bench/wan_memory.py). What each plan splits decides what shrinks with the ranks: LTX-2 splits the video
tokens and keeps the audio and both text streams whole on every rank; MiniMax-H3 splits its one packed sequence
of text, audio and video rows, but its forward embeds and packs every row before the split, so those stay whole.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from parallel.families.ltx2 import tiny as ltx2_tiny
from parallel.families.minimax_h3 import tiny as h3_tiny
from parallel.loading import tiny_models

ACT = 2  # bf16


@dataclass(frozen=True)
class LTX2Dims:
    """One LTX-2 call: video and audio streams of their own widths, each with its text stream."""

    dim: int  # video width (heads × head dim)
    audio_dim: int  # audio width
    video_tokens: int
    audio_tokens: int
    text_tokens: int  # each text stream (the connectors' output, padded to the pipeline's max_sequence_length)
    ffn_mult: int = 4


@dataclass(frozen=True)
class H3Dims:
    """One MiniMax-H3 call: one packed sequence of text, audio and video rows."""

    dim: int  # hidden size
    inner: int  # attention width (heads × head dim; wider than the hidden size)
    ffn: int
    rope_freq_dim: int
    video_tokens: int
    audio_tokens: int  # rows: latents × 2 stereo channels
    text_tokens: int

    @property
    def rows(self) -> int:
        return self.video_tokens + self.audio_tokens + self.text_tokens


def ltx2_peak(m: LTX2Dims, ulysses: int, ring: int, batch: int, audio_split: bool = False) -> dict[str, float]:
    """Bytes one rank holds at the steps of an LTX-2 call that can be its peak; `batch` 2 where the call carries
    CFG's two branches (the pipeline batches them; CFG parallel leaves each rank one).

    With s = ⌈V / (ulysses·ring)⌉ local video tokens (v = B·s·D·act) and the audio whole as the plan keeps it
    (w = B·A·Da·act; `audio_split`: what splitting it would give instead), following LTX2VideoTransformerBlock:
    - video FFN, at its GELU: seven tensors of the stream alive in the block (its input, the stream, the outputs
      of its text and audio-to-video attentions, the modulated norms the cross-modal attentions read, the FFN
      input: 7v), the up-projection and its GELU (2 × 4v); the audio stream's seven of the same kinds (7w);
      both modulated text streams (B·T·(D + Da)·act).
    - Ulysses, at the attention kernel: block input and its modulated norm (2v); q/k/v, their stack, the
      all-to-all's send and receive buffers, and the output all-to-all's two (14v); q/k/v over the ring shard's
      video tokens at 1/ulysses of the heads and the kernel's output (4 × B·⌈V / ring⌉·D·act / ulysses); the audio
      stream (w).
    - Ring: block input (v), Wan's ring buffers (7v + 3v + 4v + v, and the fp32 merge, 8v); the audio (w).
    Every step holds the rotary tables, fp32 cos and sin of each rank's tokens: video self (D) and cross (Da)
    wide, audio self and cross (Da each): B·s·(D + Da)·4 + B·A·2·Da·4.
    """
    s = math.ceil(m.video_tokens / (ulysses * ring))
    audio = math.ceil(m.audio_tokens / (ulysses * ring)) if audio_split else m.audio_tokens
    v, w = batch * s * m.dim * ACT, batch * audio * m.audio_dim * ACT
    text = batch * m.text_tokens * (m.dim + m.audio_dim) * ACT
    rotary = batch * s * (m.dim + m.audio_dim) * 4 + batch * audio * 2 * m.audio_dim * 4
    steps = {"video ffn": 7 * v + 2 * m.ffn_mult * v + 7 * w + text + rotary}
    if ulysses > 1:
        gathered = batch * math.ceil(m.video_tokens / ring) * m.dim * ACT / ulysses
        steps["ulysses all-to-all"] = 16 * v + 4 * gathered + w + rotary
    if ring > 1:
        steps["ring merge"] = v + (7 + 3 + 4 + 1 + 8) * v + w + rotary
    return _peak(steps, s)


def h3_peak(m: H3Dims, ulysses: int, ring: int) -> dict[str, float]:
    """Bytes one rank holds at the steps of a MiniMax-H3 call that can be its peak.

    The forward keeps its per-modality embeddings (video and audio from fp32 projections, text bf16:
    E = (V + A)·D·4 + T·D·act) for the whole call, and the packed sequence it scatters them into
    (P = S·D·act) until block 0 returns: the split is a hook on block 0's input. With s = ⌈S / (ulysses·ring)⌉
    local rows (a = s·D·act, i = s·inner·act, f = FFN / D), following MiniMaxH3TransformerBlock:
    - FFN, at SwiGLU's product: block 0's local input, the stream after attention, the FFN input (3a),
      the up-projection (2f·a), the gate's SiLU and the product (2f·a).
    - Ulysses, at the concatenation of what the all-to-all received: block input and its modulated norm (2a);
      q/k/v and one more tensor of the attention's width (4i); the stacked q/k/v, the all-to-all's send and
      receive buffers and the concatenation (4 × 3i: on this family's peak rank the send buffer is still alive);
      four tensors over the ring shard's rows at 1/ulysses of the heads (4 × ⌈S / ring⌉·inner·act / ulysses).
    - Ring: block input (a); q/k/v, their stack, joined and transposed (12i), the K/V block in flight (2i), six
      fp32 terms of the log-sum-exp merge (12i).
    Every step holds E, P, the rotary cos and sin of the local rows (fp32, 6·rope_freq_dim each) and the
    per-row modulation indices (int64, whole and local).
    """
    s = math.ceil(m.rows / (ulysses * ring))
    a, i = s * m.dim * ACT, s * m.inner * ACT
    whole = ((m.video_tokens + m.audio_tokens) * m.dim * 4 + m.text_tokens * m.dim * ACT + m.rows * m.dim * ACT
             + m.rows * 8 + s * 8 + 2 * s * 6 * m.rope_freq_dim * 4)
    steps = {"ffn": whole + 3 * a + 4 * m.ffn / m.dim * a}
    if ulysses > 1:
        steps["ulysses all-to-all"] = whole + 2 * a + 16 * i + 4 * math.ceil(m.rows / ring) * m.inner * ACT / ulysses
    if ring > 1:
        steps["ring merge"] = whole + a + 26 * i
    return _peak(steps, s)


def _peak(steps: dict[str, float], tokens: int) -> dict[str, float]:
    peak = max(steps, key=steps.get)
    return {**steps, "peak": steps[peak], "peak_step": peak, "tokens_per_rank": tokens}


# -- the released models at 720p (1280×704: 720 rounded to the ×32 both families' latents need) ----------------
VIDEO = (1280, 704)


def _defaults(cls_name: str) -> dict:
    """The released config as diffusers lays it out: its defaults for the class (MiniMax-H3's released size;
    LTX-2's 48 blocks, whose widths LTX-2.3 keeps)."""
    import diffusers

    signature = inspect.signature(getattr(diffusers, cls_name).__init__)
    return {name: p.default for name, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}


def released_ltx2(text_tokens: int = 1024) -> LTX2Dims:
    """LTX-2.3 at LTX2Pipeline's defaults: 121 frames at 24 fps (16 latent frames at ×8), 126 audio latents (25 a
    second), text padded to max_sequence_length 1024."""
    c, (width, height), frames = _defaults("LTX2VideoTransformer3DModel"), VIDEO, 121
    return LTX2Dims(dim=c["num_attention_heads"] * c["attention_head_dim"],
                    audio_dim=c["audio_num_attention_heads"] * c["audio_attention_head_dim"],
                    video_tokens=((frames - 1) // 8 + 1) * (height // 32) * (width // 32),
                    audio_tokens=ltx2_tiny.audio_frames(frames, 24.0), text_tokens=text_tokens)


def released_h3(text_tokens: int = 512) -> H3Dims:
    """MiniMax-H3 at its shortest, default video, 5 s (124 frames at 24 fps: 37 latent frames), 2×2 patches of the
    ×16 latents, stereo audio at 40 latents a second; the text unpadded (its rows are the prompt's tokens: 512)."""
    c, (width, height) = _defaults("MiniMaxH3Transformer3DModel"), VIDEO
    return H3Dims(dim=c["hidden_size"], inner=c["num_attention_heads"] * c["attention_head_dim"], ffn=c["ffn_dim"],
                  rope_freq_dim=c["rope_freq_dim"],
                  video_tokens=h3_tiny.video_latent_frames(h3_tiny.FRAMES) * (height // 32) * (width // 32),
                  audio_tokens=2 * h3_tiny.audio_latents(h3_tiny.FRAMES), text_tokens=text_tokens)


# -- mini models: the same blocks at a tiny width, measured on real ranks by bench/memory_table.py ---------------
MINI_VIDEO = {"ltx2": (121, 256), "minimax_h3": (124, 128)}  # frames, side of the square video
_LTX2, _H3 = MINI_VIDEO.values()
MINI = {  # the built-in tiny LTX-2 (parallel/families/ltx2/tiny.py: its 25 fps); a mini MiniMax-H3 of the released
    # proportions (attention 4/3 and FFN 8/3 of the hidden size)
    "ltx2": LTX2Dims(dim=ltx2_tiny.VIDEO_WIDTH, audio_dim=ltx2_tiny.AUDIO_HEADS * tiny_models.HEAD_DIM,
                     video_tokens=((_LTX2[0] - 1) // 8 + 1) * (_LTX2[1] // 32) ** 2,
                     audio_tokens=ltx2_tiny.audio_frames(_LTX2[0]), text_tokens=13),
    "minimax_h3": H3Dims(dim=48, inner=64, ffn=128, rope_freq_dim=2,
                         video_tokens=h3_tiny.video_latent_frames(_H3[0]) * (_H3[1] // 32) ** 2,
                         audio_tokens=2 * h3_tiny.audio_latents(_H3[0]), text_tokens=h3_tiny.TEXT_TOKENS),
}
CFG = {"ltx2": True, "minimax_h3": False}  # MiniMax-H3 is guidance-distilled: no second branch


def _fp32_kept(model):
    """bf16, with the modules the released checkpoint keeps in fp32 (as from_pretrained(torch_dtype=bf16) loads it)."""
    import torch

    model.to(torch.bfloat16)
    for name in getattr(model, "_keep_in_fp32_modules", None) or ():
        model.get_submodule(name).float()
    return model


def mini_pipeline(family: str):
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    if family == "ltx2":
        return ltx2_tiny.build_tiny(0).to(torch.bfloat16)  # LTX-2 keeps no module in fp32
    m = MINI[family]
    pipeline = h3_tiny.build_tiny(0)
    pipeline.update_components(transformer=_fp32_kept(tiny_models._seeded(
        0, MiniMaxH3Transformer3DModel, num_attention_heads=tiny_models.HEADS,
        attention_head_dim=m.inner // tiny_models.HEADS, hidden_size=m.dim, num_layers=2, num_refiner_layers=1,
        ffn_dim=m.ffn, in_channels=h3_tiny.LATENT, audio_in_channels=h3_tiny.AUDIO_LATENT, text_dim=h3_tiny.TEXT_WIDTH,
        freq_dim=32, time_embed_hidden_dim=m.dim, time_embed_dim=m.dim // 2, rope_freq_dim=m.rope_freq_dim)))
    return pipeline


def mini_call(family: str) -> dict:
    """One transformer call's inputs (LTX-2: both CFG branches, its STG passes off; MiniMax-H3: 2 steps are one
    call, its scheduler counting the final step)."""
    import torch

    frames, side = MINI_VIDEO[family]
    make = ltx2_tiny.tiny_inputs if family == "ltx2" else h3_tiny.tiny_inputs
    inputs = make(batch=1, height=side, width=side, seed=0, negative=CFG[family], text_tokens=MINI[family].text_tokens,
                  num_frames=frames)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    call = {"height": side, "width": side}
    if family == "ltx2":
        return {**inputs, **call, "num_inference_steps": 1, "guidance_scale": 4.0, "stg_scale": 0.0,
                "audio_stg_scale": 0.0, "output_type": "latent"}
    return {**inputs, **call, "num_inference_steps": 2}


def mini_peak(family: str, u: int, r: int, cfg: int, audio_split: bool = False) -> dict[str, float]:
    m = MINI[family]
    if family == "ltx2":
        return ltx2_peak(m, u, r, batch=2 // cfg, audio_split=audio_split)
    return h3_peak(m, u, r)
