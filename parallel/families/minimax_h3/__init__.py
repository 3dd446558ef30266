"""MiniMax-H3, text to video with sound (`MiniMaxH3ModularPipeline`, its `t2va` denoise blocks; diffusers runs it
only as a modular pipeline), first/last keyframe to video with sound (its `fl2va` blocks, when a job sends the
keyframes encoded) and reference to video with sound (its `ref2va` blocks on the `transformer_ref` partition, when a
job sends its references encoded with their kinds: pipelines.py): one transformer denoises ONE packed sequence
[text | keyframes or reference blocks | audio | video] — the text encoder's hidden states through a token refiner,
the keyframes (one latent frame of video rows each) or the references in reading order (an image's or a video's
latent frames at their own size, a video's soundtrack and an audio clip as audio rows), the audio latents (stereo:
two channel-major blocks of rows, 40 a second) and the video latents (2×2 patches of each latent frame) — with full
self-attention over every row in every block and no cross-attention. Each row carries its modality tag (0 video, 1
text, 2 audio) and its timestep index, which together pick its AdaLN modulation from a per-(timestep, modality)
table, and its (t, h, w) rotary position (a keyframe's rows: their own timestep, held at 0.999, and their anchor's
time; a reference's: its video rows held as a keyframe's, its audio rows clean, on a clock each reference
advances, so their order matters).

The plan splits the packed sequence where it enters the first block, as diffusers' own `_cp_plan` does: every row of
every modality is split (text and audio are most of the rows of a short video, and all attend to all: there is no
stream to leave whole; keyframe and reference rows are rows like any other, their tags, indices and positions built
by the pipeline before the split, so ref2va needs no plan of its own; `transformer_ref` is wrapped under the same
plan). Everything indexed per row is split with the rows — each block's modulation indices (tag and timestep
together), the rotary positions where the rotary module takes them (its cos/sin tables follow), the final norm's
timestep indices — so tags, modulation and rotary tables follow their rows. Attention runs USP over the sequence; the
text refiner before it runs locally on the whole text. The two output heads gather the sequence back before the
pipeline picks each modality's rows. The rows rarely divide by the degree: the split is uneven.

Guidance is distilled into the weights (no guider, no negative prompt): CFG parallel is refused with the reason.
A batch goes one sample per data-parallel rank (the pipeline packs one video per call).

PipeFusion is refused (`no_pipefusion`): the blocks take the modulation table and the per-row indices into it beside
the sequence, which PipeFusion's patches do not slice.
"""

from __future__ import annotations

from ...model_executor.attention import TextLayout
from ...model_executor.plans import Gather, ParallelPlan, Split
from ..base import FAMILIES, Family, TinyModel
from .file import SINGLE_FILE
from .pipelines import xFuserMiniMaxH3Pipeline
from .tiny import build_tiny, tiny_inputs

MINIMAX_H3 = FAMILIES.register(Family(
    name="minimax_h3",
    pipelines={"MiniMaxH3ModularPipeline": xFuserMiniMaxH3Pipeline},
    transformer="MiniMaxH3Transformer3DModel",
    plan=ParallelPlan(
        inputs={"rope": {"position_ids": Split(dim=0, expected_dims=2)},
                "transformer_blocks.0": {"hidden_states": Split(dim=1, expected_dims=3)},
                "transformer_blocks.*": {"adaln_indices": Split(dim=0, expected_dims=1)},
                "norm_out": {"timestep_indices": Split(dim=0, expected_dims=1)}},
        outputs={"proj_out": Gather(dim=1, expected_dims=3), "audio_proj_out": Gather(dim=1, expected_dims=3)},
        attention={"transformer_blocks.*.attn": TextLayout.NONE},
        text_input=None,
        uneven_tokens=True,
        predictions=2,
        no_pipefusion="its blocks take per-row modulation indices and rotary tables beside the sequence, which "
                      "PipeFusion's patches do not slice yet",
    ),
    single_file=SINGLE_FILE,
    tiny={"minimax-h3": TinyModel("MiniMaxH3ModularPipeline", build_tiny, tiny_inputs, guidance=1.0, cfg=False)},
    attention_layers={"MiniMaxH3Attention": "diffusers.models.transformers.transformer_minimax_h3"},
))
