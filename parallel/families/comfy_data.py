"""What a family declares for ComfyUI: its latent format, its model class, how its conditioning and model calls map
to the pipeline's inputs (ComfyData), and the formats declared here where a ComfyUI lacks its own
(DeclaredLatentFormat). Pure data: the ComfyUI side (nodes/) reads it, the engine never imports ComfyUI.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# What every single model call carries beside its family's conditioning (model_call.py); `timestep` only where the
# model's own timestep is not sigma × 1000 (ComfyData.model_call_timestep)
MODEL_CALL_TENSORS = ("latents", "sigma", "timestep")


@dataclass(frozen=True)
class DeclaredLatentFormat:
    """A ComfyUI latent format the family declares for the ComfyUIs whose `comfy.latent_formats` lacks it (FLUX.2's
    and HunyuanVideo 1.5's are not in 0.3.64, Qwen-Image 2.1's not in 0.33); the nodes use ComfyUI's own class wherever
    it exists. Only formats whose process_in/out is a plain scale (ComfyUI's LatentFormat base) or a per-channel
    standardisation are declared this way.

    channels, spatial: the latent's channels and pixels per latent pixel; dimensions: 2 images, 3 video.
    scale_factor:   model space = ComfyUI's latent × scale_factor.
    latents_mean, latents_std: per channel, where the format standardises: model space = (ComfyUI's latent − mean) ×
                    scale_factor / std, as ComfyUI's Wan21 and QwenImage21 write it; None: a plain scale.
    rgb_factors, rgb_bias: the latent-to-RGB preview factors, one row per channel of the unfolded latent; None: the
                    format has no previews.
    preview_unfold: the channels are (c, p, p) patches: previews unfold them to c channels at p× the resolution
                    before the RGB factors apply (ComfyUI's `latent_rgb_factors_reshape`); 1: none.
    source: where the values come from.
    """

    channels: int
    spatial: int
    source: str
    dimensions: int = 2
    scale_factor: float = 1.0
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    rgb_factors: tuple[tuple[float, float, float], ...] | None = None
    rgb_bias: tuple[float, float, float] | None = None
    preview_unfold: int = 1


@dataclass(frozen=True)
class ComfyData:
    """What the ComfyUI side needs to turn its LATENT and CONDITIONING into this pipeline's inputs.

    latent_formats: latent channels → class name in `comfy.latent_formats` (its process_in/out convert
                    between ComfyUI's VAE space and the pipeline's model space).
    packed:         the pipeline takes latents packed 2×2 into tokens [B, H/2·W/2, 4C] (Flux; see pack_2x2).
    tokens:         where the pipeline holds latents as one token per latent pixel, [B, (T')·h·w, C]: "loop": in its
                    loop (previews, and results asked for with `model_latents`), its `latents` argument image-shaped
                    [B, C, h, w] (FLUX.2); "call": its `latents` argument and results too (Qwen-Image 2.1); "": neither.
    declared_formats: latent format name → DeclaredLatentFormat, for the names of `latent_formats` that not every
                    ComfyUI has.
    guidance_in_conditioning: the conditioning's "guidance" (FluxGuidance) is the pipeline's
                    distilled `guidance_scale` (`default_guidance` without one); ComfyUI's cfg then
                    becomes `true_cfg_scale`.
    cfg_call:       the call parameter ComfyUI's cfg sets where it is not `guidance_scale` (Qwen-Image's
                    classifier-free guidance is `true_cfg_scale`); "": guidance_scale.
    cfg_offset:     the pipeline's guidance_scale is ComfyUI's cfg minus this (Z-Image guides `pos + g·(pos − neg)`,
                    ComfyUI `neg + cfg·(pos − neg)`: g = cfg − 1), 0 without a negative.
    temporal:       frames per latent frame after the first (video: latents [B, C, T', H, W]); 0: images.
    expects:        how to make a conditioning this model takes (said when one does not fit).
    empty_latent:   which ComfyUI node makes a latent this model takes (said when one does not fit).
    reference_latents: the tensor input that takes the positive conditioning's `reference_latents`
                    (ComfyUI's ReferenceLatent) as model-space latents [B, C, h, w], when the conditioning
                    has one (without, the edit model samples from text alone); "": the model takes none.
    references:     how many reference images it takes at most (0: any number, given as one tensor, one size).
    reference_required: a conditioning without reference_latents is refused (the model edits, it cannot only draw).
    concat_latents: the tensor input that takes the positive conditioning's `concat_latent_image` (ComfyUI's
                    WanImageToVideo: its VAE's encoding of the start image and the frames after it), in the
                    VAE's own space; "": the model takes none.
    image_to_video_node: the ComfyUI node that makes that conditioning (said when it is missing).
    clip_vision:    the tensor input that takes the positive conditioning's `clip_vision_output` (ComfyUI's
                    CLIPVisionEncode, through WanImageToVideo) as its `clip_vision_state` [1, tokens, width], where the
                    pool's model lists it among its input widths; "": the model takes none.
    clip_vision_state: which hidden states of that output the model takes (Wan 2.1: the penultimate layer's,
                    HunyuanVideo 1.5: the last layer's, as ComfyUI's own models take them).
    clip_vision_required: without a clip_vision_output the conditioning is refused; False: the model samples
                    without vision features (ComfyUI's HunyuanVideo 1.5 does, its vision tokens left out).
    text_masks:     text input → the input that masks its padding, where the pipeline takes one other than
                    `prompt_attention_mask` (ComfyUI's own encoders give `attention_mask` for their `cond` only where
                    it pads; none: all valid). A text input without a mask input has its padding trimmed.
    conditioning_keys: a key of ComfyUI's own encoders' conditioning → the pipeline's text input it is
                    (HunyuanVideo 1.5's byT5 glyph text, `conditioning_byt5small`).
    optional_texts: text inputs the pipeline needs and ComfyUI's encoders may leave out (HunyuanVideo 1.5's glyph
                    text, for a prompt without quoted text): sent as one padding token, masked.
    model_class:    the class in `comfy.supported_models` whose model sampling (flow shift, prediction type),
                    latent format and conditioning an xDiT Model carries (ComfyUI's samplers on the pool);
                    "": no xDiT Model for this family.
    model_call_timestep: ComfyUI's model gives this model a timestep that is not sigma × 1000 (a discrete-schedule
                    eps model, PixArt: its model sampling's interpolated step), so the call carries ComfyUI's own.
    model_call_versions: model-call inputs that ask the pool to compute as ComfyUI's own `model_class` does since a
                    change of ComfyUI's (the pool follows the model's reference, diffusers' transformer, otherwise): the
                    input → the first ComfyUI version with the change; the ComfyUI side sends each, [B], 1 where its
                    version has reached that one, 0 where not (nodes/comfy_compat.py).
    model_call_conds: keyword of ComfyUI's diffusion model call (context, y, guidance) → the pipeline's name
                    for it in a model call (the wrapper's model_call_inputs; "": ComfyUI's model passes it, this model
                    does not use it; `keyword.key`: an entry of a dict keyword, MiniMax-H3's `minimax_payload`, whose
                    other entries are refused); `ref_latents` (ReferenceLatent's images)
                    travel as `reference_latents` and `reference_sizes` (see `references`); `ref_latents_method`
                    (ComfyUI's way of placing them, a string) as `reference_method`, its index in reference_methods.
    reference_methods: the `ref_latents_method`s the model call takes, the file's default first where ComfyUI's
                    model config names none (Qwen-Image: index, index_timestep_zero); any other is refused.
    audio_stream:   (input, output): the model samples video with sound from ComfyUI's AV latent (LTXVConcatAVLatent's
                    NestedTensor of the video and the audio latent); the audio goes to the pipeline as `input`, comes
                    back as its `output`, both in the loop's space as the video (`model_latents`); (): video alone.
    audio_axes:     the pipeline's audio latents are ComfyUI's audio stream with its axes in this order (MiniMax-H3:
                    ComfyUI's [B, 32, 2, L] is the pipeline's [B, 2, 32, L]); (): the same layout.
    audio_shifts:   ((transformer option, default), (transformer option, default)): ComfyUI's own model computes the
                    audio's sigma from the video's, moving it from the video's flow shift to the audio's (MiniMax-H3:
                    12 and 3, MiniMaxH3SigmaShift's options set others); its sampler carries the audio scaled onto the
                    video's schedule by the model call's `audio_scale` (nodes/av_calls.py); (): one schedule.
    audio_scale:    the model call entry holding that scale (a `keyword.key` of a dict keyword, as in model_call_conds).
    keyframes:      the dict keyword of the model call whose `keyframes` ({resolved_frame_index, latent} each, with its
                    `frame_count` and `seed`) ComfyUI's model puts in front of the video rows (MiniMax-H3's
                    `minimax_payload`, from MiniMaxH3ImageToVideo): they go to the pool noised as its model does, as
                    `condition_latents`, `condition_sizes` and `keyframe_anchors` (nodes/av_calls.py); its `refs`
                    (MiniMaxH3ReferenceToVideo's) as ref2va's `reference_kinds` and condition tensors; "": none.
    conditioning_calls: key of a conditioning's extras → (the call parameter it sets, ComfyUI's value without it)
                    (LTXVConditioning's frame_rate, 25 when none set it).
    conditioning_inputs: key of the positive conditioning's extras → the pipeline input it is, as given (MiniMax-H3's
                    text encoder returns each token's modality tag as `minimax_token_tags`).
    derives_frames: the pipeline counts its frames from the latents' (MiniMax-H3: 5n+2 latent frames hold 17n+5
                    frames, not (T'−1)·temporal+1); the job names none.
    vae_normalises: ComfyUI's VAE for this family normalises latents inside it (LTXV's, MiniMax-H3's statistics), so its
                    LATENT is the sampling loop's space, not the VAE's own: a decode on the pool converts it first.
    """

    latent_formats: dict[int, str]
    packed: bool = False
    tokens: str = ""
    declared_formats: dict[str, DeclaredLatentFormat] = field(default_factory=dict)
    guidance_in_conditioning: bool = False
    default_guidance: float = 3.5
    cfg_call: str = ""
    cfg_offset: float = 0.0
    temporal: int = 0
    expects: str = ""
    empty_latent: str = "an empty latent node made for this model"
    reference_latents: str = ""
    references: int = 1
    reference_required: bool = False
    concat_latents: str = ""
    image_to_video_node: str = "WanImageToVideo"
    clip_vision: str = ""
    clip_vision_state: str = "penultimate_hidden_states"
    clip_vision_required: bool = True
    text_masks: dict[str, str] = field(default_factory=dict)
    conditioning_keys: dict[str, str] = field(default_factory=dict)
    optional_texts: tuple[str, ...] = ()
    model_class: str = ""
    model_call_timestep: bool = False
    model_call_versions: dict[str, str] = field(default_factory=dict)
    model_call_conds: dict[str, str] = field(default_factory=dict)
    reference_methods: tuple[str, ...] = ()
    audio_stream: tuple[str, str] = ()
    audio_axes: tuple[int, ...] = ()
    audio_shifts: tuple[tuple[str, float], tuple[str, float]] = ()
    audio_scale: str = ""
    keyframes: str = ""
    conditioning_calls: dict[str, tuple[str, float]] = field(default_factory=dict)
    conditioning_inputs: dict[str, str] = field(default_factory=dict)
    derives_frames: bool = False
    vae_normalises: bool = False

    def __post_init__(self):
        if self.tokens not in ("", "loop", "call"):
            raise ValueError(f"ComfyData.tokens is {self.tokens!r}; expected \"\", \"loop\" or \"call\"")
