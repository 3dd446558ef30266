"""LTX-2.x text- and image-to-video with sound (`LTX2Pipeline`, `LTX2ImageToVideoPipeline`, `LTX2ConditionPipeline`,
`LTX2InContextPipeline`): one transformer denoises video latents [B, 128, T', H/32, W/32] and audio latents [B, C, L, M]
together, each a token stream of its own (video: one token per latent pixel of each latent frame; audio: one per
latent frame, its channels × mel bins wide), with its own modulation, rotary table and text (Gemma's hidden states
through the pipeline's connectors, one stream per modality). Every block runs video and audio self-attention, text
cross-attention for each, then audio-to-video and video-to-audio cross-attention.

The plan splits the video tokens where they enter (with their per-token timesteps, where image-to-video gives them,
and the video rotary tables: both the video's own and the cross-modal one are made from the split positions) and
gathers them at proj_out; the split is uneven where the token count does not divide. Video self-attention runs USP.
The audio and the text stay whole on every rank (`Replicated`, with the reason): audio and text self-attention,
the text cross-attention and the audio-to-video attention (video queries, audio keys) then run locally, and
video-to-audio attention (audio queries, video keys) attends to each rank's own video keys and merges the partial
results by their log-sum-exp (`replicated_queries`), exactly. The text's padding is masked in cross-attention only,
which runs locally with its mask as diffusers runs it: nothing to trim.

CFG: the pipeline batches [negative, positive] in one call (cache_context "cond_uncond") and splits it after; CFG
parallel splits that batch and gathers the video and the audio prediction (`predictions=2`). Its spatio-temporal
(STG) and modality-isolation passes are one more call each on the positive branch alone: every CFG rank runs them
whole (the batch of one does not split), so guidance combines as the pipeline combines it. STG's default block (28)
is past a small model's blocks: `stg_block`, `stg_scale`, `audio_stg_scale` and the other guidance scales are call
parameters.

Image-to-video takes the start image's encoding in the first latent frame of the given latents (ComfyUI's
LTXVImgToVideoInplace); its tokens get timestep 0, so the video's timesteps are per token and split with them.
The condition pipeline encodes pictures on every rank and appends those past frame 0 to the video's tokens with their
own positions and per-token timesteps (the in-context one its reference videos too): the same split takes them.
Below conditioning_attention_strength 1 (or with a pixel mask) the in-context pipeline weakens the attention between
the references and the video with a [B, tokens, tokens] mask on the video's self-attention (an additive bias in the
transformer): its query rows split with the tokens, and `attention_masks` has USP apply it where the keys are.

Single files (file.py): LTX-2.3's whole checkpoint in Lightricks' layout, ComfyUI's scaled fp8 and GGUF kept quantized.
A model call may ask for ComfyUI >= 0.31's block order (comfy_block_order.py: hooks on diffusers' own blocks, per row).

PipeFusion is refused (`no_pipefusion`): video and audio cross-attend in every block, so a patch of video rows would
need the whole audio stream's state of the same step, which the patch pipeline does not carry.
"""

from __future__ import annotations

from ...model_executor.attention import TextLayout
from ...model_executor.plans import CfgMode, Gather, ParallelPlan, Replicated, Split
from ..base import FAMILIES, Family, TinyModel
from .file import SINGLE_FILE
from .pipelines import (xFuserLTX2ConditionPipeline, xFuserLTX2ImageToVideoPipeline, xFuserLTX2InContextPipeline,
                        xFuserLTX2Pipeline)
from .tiny import build_tiny, tiny_inputs

AUDIO_REPLICATED = Replicated(
    "audio", "5 s of audio are 126 tokens beside 14,000 video tokens at 720p: running them on every rank costs under 1% "
             "more compute, splitting them would add four all-to-alls to every block")
TEXT_REPLICATED = Replicated(
    "text", "the text is only cross-attended (keys and values): split, it would be gathered back in every block")

LTX2 = FAMILIES.register(Family(
    name="ltx2",
    pipelines={"LTX2Pipeline": xFuserLTX2Pipeline, "LTX2ImageToVideoPipeline": xFuserLTX2ImageToVideoPipeline,
               "LTX2ConditionPipeline": xFuserLTX2ConditionPipeline,
               "LTX2InContextPipeline": xFuserLTX2InContextPipeline},
    transformer="LTX2VideoTransformer3DModel",
    plan=ParallelPlan(
        inputs={"": {"hidden_states": Split(dim=1, expected_dims=3), "timestep": Split(dim=1, ndim=2),
                     "video_keyframes_mask": Split(dim=1, ndim=3),
                     "video_self_attention_mask": Split(dim=1, expected_dims=3)},
                "rope": {"coords": Split(dim=2, expected_dims=4)},
                "cross_attn_rope": {"coords": Split(dim=2, expected_dims=4)}},
        outputs={"proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn1": TextLayout.NONE},
        attention_masks={"transformer_blocks.*.attn1": "attention_mask"},
        replicated_queries=("transformer_blocks.*.video_to_audio_attn",),
        replicated={"audio_hidden_states": AUDIO_REPLICATED, "encoder_hidden_states": TEXT_REPLICATED,
                    "audio_encoder_hidden_states": TEXT_REPLICATED},
        text_input=None,
        cfg=CfgMode.BATCHED,
        uneven_tokens=True,
        predictions=2,
        no_pipefusion="video and audio cross-attend in every block: a patch of video rows would need the whole audio "
                      "of its step",
    ),
    single_file=SINGLE_FILE,
    tiny={"ltx2": TinyModel("LTX2Pipeline", build_tiny, tiny_inputs, guidance=4.0),
          "ltx2-i2v": TinyModel("LTX2ImageToVideoPipeline", lambda seed: build_tiny(seed, "LTX2ImageToVideoPipeline"),
                                tiny_inputs, guidance=4.0),
          "ltx2-condition": TinyModel("LTX2ConditionPipeline", lambda seed: build_tiny(seed, "LTX2ConditionPipeline"),
                                      tiny_inputs, guidance=4.0),
          "ltx2-ic": TinyModel("LTX2InContextPipeline", lambda seed: build_tiny(seed, "LTX2InContextPipeline"),
                               tiny_inputs, guidance=4.0)},
    attention_layers={"LTX2Attention": "diffusers.models.transformers.transformer_ltx2"},
))
