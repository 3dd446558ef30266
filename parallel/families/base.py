"""What a model family declares, and the registry that finds a family from a diffusers object.

A family is one module in this package: its transformer's parallel plan, its pipeline wrappers (hooks,
call parameters, tensor inputs, the ComfyUI data), its LoRA converter, its single-file checkpoint layout
and its tiny built-in models. The registry is keyed by the names of the diffusers classes a family
wraps and matched against an object's class and its bases, so importing the registry (as the ComfyUI
process does) never imports diffusers.
"""

from __future__ import annotations

import contextlib

import re

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from ..model_executor.plans import ParallelPlan


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
    model_call_refused: why a model call of the pool cannot give what ComfyUI's own `model_class` gives (ComfyUI
                    computes the model otherwise than the pool's diffusers transformer): xDiT Model and the drop-in
                    loader refuse this family's pools and files in one line with it, rather than sample a
                    different model under ComfyUI's samplers.
    model_call_conds: keyword of ComfyUI's diffusion model call (context, y, guidance) → the pipeline's name
                    for it in a model call (the wrapper's model_call_inputs; "": ComfyUI's model passes it, this model
                    does not use it); `ref_latents` (ReferenceLatent's images)
                    travel as `reference_latents` and `reference_sizes` (see `references`); `ref_latents_method`
                    (ComfyUI's way of placing them, a string) as `reference_method`, its index in reference_methods.
    reference_methods: the `ref_latents_method`s the model call takes, the file's default first where ComfyUI's
                    model config names none (Qwen-Image: index, index_timestep_zero); any other is refused.
    audio_stream:   (input, output): the model samples video with sound from ComfyUI's AV latent (LTXVConcatAVLatent's
                    NestedTensor of the video and the audio latent); the audio goes to the pipeline as `input`, comes
                    back as its `output`, both in the loop's space as the video (`model_latents`); (): video alone.
    audio_axes:     the pipeline's audio latents are ComfyUI's audio stream with its axes in this order (MiniMax-H3:
                    ComfyUI's [B, 32, 2, L] is the pipeline's [B, 2, 32, L]); (): the same layout.
    conditioning_calls: key of a conditioning's extras → (the call parameter it sets, ComfyUI's value without it)
                    (LTXVConditioning's frame_rate, 25 when none set it).
    conditioning_inputs: key of the positive conditioning's extras → the pipeline input it is, as given (MiniMax-H3's
                    text encoder returns each token's modality tag as `minimax_token_tags`).
    derives_frames: the pipeline counts its frames from the latents' (MiniMax-H3: 5n+2 latent frames hold 17n+5
                    frames, not (T'−1)·temporal+1); the job names none.
    vae_normalises: ComfyUI's VAE for this family normalises latents inside it (LTXV's per-channel statistics), so its
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
    model_call_refused: str = ""
    model_call_conds: dict[str, str] = field(default_factory=dict)
    reference_methods: tuple[str, ...] = ()
    audio_stream: tuple[str, str] = ()
    audio_axes: tuple[int, ...] = ()
    conditioning_calls: dict[str, tuple[str, float]] = field(default_factory=dict)
    conditioning_inputs: dict[str, str] = field(default_factory=dict)
    derives_frames: bool = False
    vae_normalises: bool = False

    def __post_init__(self):
        if self.tokens not in ("", "loop", "call"):
            raise ValueError(f"ComfyData.tokens is {self.tokens!r}; expected \"\", \"loop\" or \"call\"")


class Variant(NamedTuple):
    """A released model a single-file checkpoint can hold; its shipped configs are parallel/loading/checkpoints/configs/<variant>/."""

    model: str  # the kind of model, as the built-in tiny models name it ("pixart-sigma", "flux")
    title: str  # what users call it
    marker: str  # how its tensor names and shapes show it


@dataclass(frozen=True)
class ExpertPair:
    """A model whose two experts are released as two files (Wan 2.2 A14B: high-noise and low-noise), told apart
    by a word in their file names; either file loads the pair, the partner found beside it.

    words:    (first expert's word, second's) in the order the pipeline names them `transformer`, `transformer_2`;
              matched whole, between separators (`..._high_noise_14B...`, `..._HIGH_fp8...`).
    variants: the variant one expert file is detected as → the variant the pair loads as (its shipped config
              holds both transformers, the boundary between them and the scheduler).
    """

    words: tuple[tuple[str, str], ...]
    variants: dict[str, str]

    def files(self, path: str | Path) -> tuple[Path, Path] | None:
        """(first expert's file, second's) when `path` is named as one of them; None when it is not."""
        path = Path(path)
        for first, second in self.words:
            for mine, other, index in ((first, second, 0), (second, first, 1)):
                pattern = rf"(?<![A-Za-z]){re.escape(mine)}(?![A-Za-z])"
                if re.search(pattern, path.name):
                    partner = path.with_name(re.sub(pattern, other, path.name, count=1))
                    return (path, partner) if index == 0 else (partner, path)
        return None


@dataclass(frozen=True)
class VaeFile:
    """The VAE file that goes beside a family's single-file transformers (ComfyUI's models/vae), for pipelines
    that encode a start image and for decoding on the pool (`--vae`). Its diffusers class and config are the
    shipped `vae/` of the detected variant (parallel/loading/checkpoints/configs/<variant>/vae).

    marker:  a tensor name only this VAE layout has.
    title:   the VAE as users call it, with the file ComfyUI users have ("Wan 2.1 VAE (wan_2.1_vae.safetensors)").
    read:    Shapes → config values the shapes pin down; raises ValueError for a VAE it cannot load.
    needed:  why the variants that list a `vae` in their shipped model_index.json need it (said when it is missing).
    convert: (original state dict, config) → diffusers' names, where diffusers' single-file loader has no
             converter for this VAE; None: diffusers' own.
    """

    marker: str
    title: str
    read: Callable[[Any], dict]
    needed: str
    convert: Callable[[dict, dict], dict] | None = None


@dataclass(frozen=True)
class SingleFile:
    """How a family's original single-file layout is recognised and converted (parallel/loading/checkpoints/).

    marker:   a tensor name only this layout has.
    title:    the family as error messages name it.
    variants: variant (config folder name) → Variant.
    read:     Shapes → (variant, config values the shapes pin down); raises ValueError for what it cannot load.
    convert:  (original state dict, config) → diffusers' names (may import diffusers).
    experts:  where a model's two experts come as two files, how they pair (ExpertPair).
    vae:      the VAE file that may go beside them (VaeFile); variants whose shipped model_index.json lists a
              `vae` need it.
    """

    marker: str
    title: str
    variants: dict[str, Variant]
    read: Callable[[Any], tuple[str, dict]]
    convert: Callable[[dict, dict], dict]
    experts: ExpertPair | None = None
    vae: VaeFile | None = None


@dataclass(frozen=True)
class TinyModel:
    """A built-in tiny model (`xdit-tiny-<name>`, parallel/loading/tiny_models.py): random weights, offline tokenizers.

    pipeline: the diffusers pipeline class name it builds (its wrapper says what inputs it takes).
    build:    seed → the fp32 diffusers pipeline (imports diffusers when called).
    inputs:   make_inputs' keyword arguments → the tensor inputs of one call, as if prompts were encoded.
    guidance: the guidance_scale the tests sample it with (the pipeline's own meaning).
    true_cfg: the call arguments that turn on classifier-free guidance where guidance_scale is distilled
              guidance (Flux: true_cfg_scale); tests add them for CFG parallel.
    cfg:      whether the model has classifier-free guidance at all (FLUX.2 [dev]: no).
    unguided: the guidance_scale of a run without classifier-free guidance (Z-Image: 0).
    """

    pipeline: str
    build: Callable[[int], Any]
    inputs: Callable[..., dict]
    guidance: float = 4.5
    true_cfg: dict[str, float] = field(default_factory=dict)
    cfg: bool = True
    unguided: float = 1.0


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] → [B, H/2·W/2, 4C]: 2×2 latent pixels per token, as packing pipelines (Flux) take them."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def references(inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """A model call's reference images, [B, C, h, w] each: `reference_latents` holds their pixels flattened and
    joined, [B, C, Σ h·w], `reference_sizes` each one's (h, w), [B, N, 2] (ComfyUI's ReferenceLatent, any sizes)."""
    flat, sizes = inputs.get("reference_latents"), inputs.get("reference_sizes")
    if flat is None:
        return []
    if sizes is None or sizes.ndim != 3 or sizes.shape[2] != 2 or flat.ndim != 3:
        raise ValueError("reference_latents [B, C, Σ h·w] go with reference_sizes [B, N, 2], each image's (h, w)")
    shapes = [(int(h), int(w)) for h, w in sizes[0].tolist()]
    if sum(h * w for h, w in shapes) != flat.shape[2]:
        raise ValueError(f"reference_sizes {shapes} do not add up to the {flat.shape[2]} pixels of reference_latents")
    parts = flat.split([h * w for h, w in shapes], dim=2)
    return [part.unflatten(2, shape) for part, shape in zip(parts, shapes)]


@contextlib.contextmanager
def replaced(owner, name: str, value):
    """`owner.name` is `value` inside the block (a module's function, or an instance's method)."""
    had, old = name in vars(owner), getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def pictures(images: torch.Tensor) -> list:
    """[N, 3, H, W] in [0, 1] → N 8-bit RGB PIL images, for pipelines that take only PIL images (they resize and
    crop them themselves). ComfyUI's images come from 8-bit files, so an 8-bit image goes through unchanged."""
    import PIL.Image

    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [PIL.Image.fromarray(picture) for picture in pixels]


def unpack_2x2(latents: torch.Tensor, height: int, width: int, scale: int = 8) -> torch.Tensor:
    """pack_2x2 undone, for an image of height × width pixels (VAE factor `scale`)."""
    b, _, d = latents.shape
    h, w = height // (2 * scale), width // (2 * scale)
    return latents.view(b, h, w, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h * 2, w * 2)


@dataclass(frozen=True)
class Family:
    """One model family.

    pipelines:   diffusers pipeline class name → its pipeline wrapper (a subclass of
                 `xFuserPipelineBaseWrapper` carrying the hooks, call parameters, tensor inputs and ComfyData).
    transformer: the diffusers transformer class name the plan applies to.
    plan:        how that transformer runs in parallel (model_executor/plans.py).
    convert_lora: (state dict, transformer) → a state dict diffusers' own LoRA loader reads, for layouts
                 it does not convert itself; None: diffusers reads every layout of this family.
    single_file: the family's original checkpoint layout, if single files of it load.
    tiny:        the family's built-in tiny models by name (tests, the demo, `xdit-tiny-<name>`).
    attention_layers: the family's attention classes that call diffusers' `dispatch_attention_fn`: class
                 name → the module holding the global they call; the engine wraps them by name.
    """

    name: str
    pipelines: dict[str, type]
    transformer: str
    plan: ParallelPlan
    convert_lora: Callable[[dict, Any], dict] | None = None
    single_file: SingleFile | None = None
    tiny: dict[str, TinyModel] = field(default_factory=dict)
    attention_layers: dict[str, str] = field(default_factory=dict)


class FamilyRegistry:
    """Families by the diffusers class names they wrap."""

    def __init__(self):
        self._families: dict[str, Family] = {}
        self._by_pipeline: dict[str, Family] = {}
        self._by_transformer: dict[str, Family] = {}

    def register(self, family: Family) -> Family:
        for name, table in ((family.name, self._families), (family.transformer, self._by_transformer),
                            *((pipeline, self._by_pipeline) for pipeline in family.pipelines)):
            if name in table:
                raise ValueError(f"{name} is declared by two families: {table[name].name} and {family.name}")
            table[name] = family
        return family

    def __iter__(self):
        return iter(self._families.values())

    def _find(self, obj: Any, table: dict[str, Family], kind: str) -> tuple[str, Family]:
        if isinstance(obj, str):
            names, shown = [obj], obj
        else:
            cls = obj if isinstance(obj, type) else type(obj)
            names, shown = [c.__name__ for c in cls.__mro__], cls.__name__
        for name in names:
            if name in table:
                return name, table[name]
        raise ValueError(f"{shown} is not a supported {kind}; supported: {', '.join(sorted(table))}")

    def pipeline_wrapper(self, pipeline: Any) -> type:
        """The wrapper class for a diffusers pipeline (object, class, or class name)."""
        name, family = self._find(pipeline, self._by_pipeline, "pipeline")
        return family.pipelines[name]

    def for_transformer(self, transformer: Any) -> Family:
        """The family whose plan fits this diffusers transformer (object, class, or class name)."""
        return self._find(transformer, self._by_transformer, "transformer")[1]

    def tensor_inputs(self) -> tuple[str, ...]:
        """Every tensor input some registered pipeline takes: the names contract E's IN files and pool jobs
        may carry (each pipeline's wrapper then checks its own)."""
        names = (name for family in self for wrapper in family.pipelines.values() for name in wrapper.all_tensor_inputs())
        return tuple(dict.fromkeys(names))

    def model_call_refusal(self, model_class: str) -> str:
        """Why ComfyUI's `model_class` (a comfy.supported_models class name, as ComfyUI detects a file) cannot run its
        model calls on a pool ("": it can, or no family declares it)."""
        return next((wrapper.comfy.model_call_refused for family in self for wrapper in family.pipelines.values()
                     if wrapper.comfy.model_class == model_class and wrapper.comfy.model_call_refused), "")

    def model_call_tensors(self) -> tuple[str, ...]:
        """Every tensor some registered pipeline takes in a single model call (model_call.py): the latents,
        their noise level and the families' conditioning."""
        names = (name for family in self for wrapper in family.pipelines.values() for name in wrapper.model_call_inputs)
        return tuple(dict.fromkeys((*MODEL_CALL_TENSORS, *names)))


FAMILIES = FamilyRegistry()
