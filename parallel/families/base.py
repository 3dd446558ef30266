"""What a model family declares, and the registry that finds a family from a diffusers object.

A family is one module in this package: its transformer's parallel plan, its pipeline wrappers (hooks,
call parameters, tensor inputs, the ComfyUI data), its LoRA converter, its single-file checkpoint layout
and its tiny built-in models. The registry is keyed by the names of the diffusers classes a family
wraps and matched against an object's class and its bases, so importing the registry (as the ComfyUI
process does) never imports diffusers.
"""

from __future__ import annotations

import contextlib
import math
import re

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from ..model_executor.plans import ParallelPlan
from .comfy_data import MODEL_CALL_TENSORS


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
    adapt:    (model made from the config, converted state dict) → whether it swapped modules for what the file
              holds and diffusers' class does not (MiniMax-H3's curve form); the weights then load into that model,
              not through diffusers' single-file loader (which builds its own).
    experts:  where a model's two experts come as two files, how they pair (ExpertPair).
    vae:      the VAE file that may go beside them (VaeFile); variants whose shipped model_index.json lists a
              `vae` need it.
    components: (file, shipped config folder, dtype) → the pipeline's other parts the same file holds (LTX-2's text
              connectors and VAE statistics in its whole checkpoint), by component name.
    """

    marker: str
    title: str
    variants: dict[str, Variant]
    read: Callable[[Any], tuple[str, dict]]
    convert: Callable[[dict, dict], dict]
    adapt: Callable[[Any, dict], bool] | None = None
    experts: ExpertPair | None = None
    vae: VaeFile | None = None
    components: Callable[[Any, Any, Any], dict] | None = None


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


def references(inputs: dict[str, torch.Tensor], latents: str = "reference_latents",
               sizes: str = "reference_sizes") -> list[torch.Tensor]:
    """A call's list of latents of any sizes as named tensors carry it (one typed tensor each, no pickle): `latents`
    holds them flattened and joined, [B, C, Σ size], `sizes` each one's size, [B, N, D]; back as N tensors
    [B, C, *size]. ComfyUI's ReferenceLatent images: `reference_latents` with (h, w) sizes; MiniMax-H3's keyframe
    conditions: `condition_latents` with (t, h, w) sizes."""
    flat, shapes = inputs.get(latents), inputs.get(sizes)
    if flat is None:
        return []
    if shapes is None or shapes.ndim != 3 or flat.ndim != 3:
        raise ValueError(f"{latents} [B, C, Σ size] go with {sizes} [B, N, D], each one's size")
    shapes = [tuple(int(n) for n in shape) for shape in shapes[0].tolist()]
    if sum(math.prod(shape) for shape in shapes) != flat.shape[2]:
        raise ValueError(f"{sizes} {shapes} do not add up to the {flat.shape[2]} entries of {latents}")
    parts = flat.split([math.prod(shape) for shape in shapes], dim=2)
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

    def model_call_tensors(self) -> tuple[str, ...]:
        """Every tensor some registered pipeline takes in a single model call (model_call.py): the latents,
        their noise level and the families' conditioning."""
        names = (name for family in self for wrapper in family.pipelines.values() for name in wrapper.model_call_inputs)
        return tuple(dict.fromkeys((*MODEL_CALL_TENSORS, *names)))


FAMILIES = FamilyRegistry()
