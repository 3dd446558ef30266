"""Qwen-Image 2.1 (and Turbo, a checkpoint with its own `sample_sigmas`): one block-causal stream of [prefix; image].

The transformer joins the text and the condition images' tokens (slotted into the text where Qwen3-VL saw them)
into a prefix, and the target image's tokens after it; the prefix attends block-causally to itself, the image to
everything. Its text and condition-image tokens are modulated from t = 0, so their K/V are the same at every step:
with `use_kv_cache` (the default) the first step stores them and the later steps run the image's tokens alone
against them.

Sequence parallel keeps the prefix whole on every rank (`TextRows`: the blocks' `target_token_mask` marks the
image's rows) and splits the image's tokens (unevenly where they do not divide). The prefix's own attention runs,
in the calls diffusers' processor makes for it, whole on every rank (`TextLayout.CAUSAL_PREFIX`); the image's call
attends its queries shard to [prefix; image] through USP, the prefix's K/V joining each rank's own heads. So the
cached prefix K/V are computed once per job, at the first step, on the ranks running the branch they belong to
(CFG parallel: cond on one group, uncond on the other), and reused as one process reuses them: under Ulysses each
rank keeps only its heads of them (`PrefixKV`), under Ring every ring member keeps them (its queries see them
locally; the ring passes the image's K/V only). They are dropped when the call ends, fails or is cancelled.

Edit: `image`, the condition pictures [N, 3, H, W] in [0, 1] (every prompt sees them all), as 8-bit PIL images, the
only kind its `__call__` takes. Qwen3-VL reads each picture inside the prompt, so the embeddings must have been
encoded with them (`encode_text_with_images`: the pipeline's own encode_prompt, the pictures sized as `__call__` sizes
them, about 1024² of their aspect ratio), and their `image_pad_mask` (the slots the pictures' latent tokens fill)
travels with them: `__call__` takes no such argument, so its encode_prompt is handed it. The pictures' latent tokens
join the prefix: whole on every rank and in the prefix K/V cache as the text is.

Its true CFG is two calls per step named "cond" and "uncond", whose outputs hold each prompt's prefix: CFG parallel
exchanges the image's tokens alone (`output_tail`). Prompts of one batch with different lengths pad the text, which
sequence-parallel attention cannot mask: refused under Ulysses and Ring in one line. PipeFusion is not offered (see
`no_pipefusion`). Step cache: TaylorSeer, with a warm-up of 2 steps or more while the prefix K/V cache is on (see
`check_layout`); diffusers' first-block cache has no entry for its blocks, so it is refused in one line.

The pipeline builds its processor's chat template at construction, even when it is given embeddings: a folder
loads it without its text encoder, for images only where torchvision is missing (loading/vl_processors.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from typing import Any

import torch

from ..call_parameters import CallParameter
from ..layout.config import LayoutError
from ..model_executor.attention import TextLayout
from ..model_executor.pipeline import xFuserPipelineBaseWrapper
from ..model_executor.pipeline.img2img import linear_sigmas
from ..model_executor.plans import CfgMode, Gather, ParallelPlan, Split, TextRows
from ..request import STEP_CACHE
from .base import FAMILIES, Family, TinyModel, pictures, replaced
from .comfy_data import ComfyData, DeclaredLatentFormat

log = logging.getLogger(__name__)
MASKS = {"prompt_embeds": "prompt_embeds_mask", "negative_prompt_embeds": "negative_prompt_embeds_mask"}
SLOTS = {"prompt_embeds": "image_pad_mask", "negative_prompt_embeds": "negative_image_pad_mask"}  # condition pictures'
LIVE: "weakref.WeakSet" = weakref.WeakSet()  # every prefix K/V layer cache not yet dropped (tests look)


# ComfyUI's Qwen-Image 2.1 LATENT (`comfy.latent_formats.QwenImage21` in the ComfyUIs with Qwen-Image 2.1, from 0.37;
# 0.33 has none): the VAE's own latents [B, 64, H/16, W/16], standardised per channel on the way to the model, which
# takes them as one token per latent pixel. The statistics are the VAE's: diffusers' AutoencoderKLQwenImage21 config
# defaults (models/autoencoders/autoencoder_kl_qwenimage21.py, `latents_mean` / `latents_std`), which
# pipeline_qwenimage21.py applies as (x − mean) / std to its condition images and undoes before decoding
# (tests/test_families.py holds these against them). No preview factors are declared: on 0.33 it previews nothing.
COMFY_QWEN_IMAGE21 = DeclaredLatentFormat(
    channels=64, spatial=16,
    source="diffusers AutoencoderKLQwenImage21's default latents_mean / latents_std (its pipeline's standardisation)",
    latents_mean=(
        0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177, -0.6510, 0.2732, 0.7562,
        -0.6163, -1.0277, 3.8363, 2.0210, 0.0472, 0.9320, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464, -0.5236, 1.2826,
        3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555, 0.0746, -3.0751, -0.1076,
        1.7376, -1.0914, -1.9435, -0.2784, -1.3680, 0.4809, -0.4433, 0.3764, 0.5729, -2.0595, 1.0960, -1.3260, -2.0211,
        -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373, 1.4937, 0.2632, 0.5547, -1.7121, -0.1562, 0.0304),
    latents_std=(
        3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910, 3.0785, 3.6500, 3.9308, 3.0904, 2.8778, 3.7675,
        3.7320, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513, 3.9323, 3.4719,
        3.7498, 4.2830, 3.5694, 4.2467, 3.9037, 3.2947, 5.0770, 3.5075, 3.2700, 3.4767, 2.8063, 5.1125, 3.5327, 4.7833,
        3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168, 3.5643, 4.0550, 5.5614, 4.2963, 4.4080, 3.4959,
        3.8747, 3.7608, 3.5735, 3.1490, 3.7662, 3.6746, 3.4563, 3.8161),
)
CHANNELS = COMFY_QWEN_IMAGE21.channels  # the tiny model's too, so its LATENT is the released model's format


class xFuserQwenImage21Pipeline(xFuserPipelineBaseWrapper):
    default_sigmas = staticmethod(linear_sigmas)
    comfy = ComfyData(
        latent_formats={CHANNELS: "QwenImage21"}, tokens="call", declared_formats={"QwenImage21": COMFY_QWEN_IMAGE21},
        cfg_call="true_cfg_scale",
        expects="encode with xDiT Text Encode on this pool (Qwen3-VL; ComfyUI 0.33 has no Qwen-Image 2.1 encoder)",
        empty_latent="xDiT Empty Latent (64 channels at 1/16 size)")
    tensor_inputs = (*MASKS.values(), "image", *SLOTS.values())
    shared_inputs = ("image",)  # every prompt sees every condition picture
    embedding_sizes = {name: "context_in_dim" for name in MASKS}
    call_parameters = {
        "true_cfg_scale": CallParameter(float, "classifier-free guidance with the negative embeddings (1: off)", 0.0, 100.0),
        "use_kv_cache": CallParameter(int, "1: the prefix's K/V computed at the first step and reused (the default), "
                                           "0: computed at every step", 0, 1),
    }
    guidance, guidance_needs_negative = ("true_cfg_scale", 1.0), True
    prefix_cache: dict[str, int] = {}  # the last call's prefix K/V on this rank: layers stored, bytes kept

    def expected_latents_shape(self, batch: int, height: int, width: int) -> tuple[int, ...]:
        return (batch, self.image_tokens(height, width), self.module.transformer.config.in_channels)

    def image_tokens(self, height: int, width: int) -> int:
        return self.grid_tokens(height, width, self.module.vae_scale_factor, 2, 2) * 4  # 2×2 slots, one token each

    def cfg_parallel_hint(self, kwargs: dict[str, Any]) -> str:
        return ("CFG parallel on Qwen-Image 2.1 needs true_cfg_scale above 1 (got "
                f"{kwargs.get('true_cfg_scale', 1.0)}) and negative prompt embeddings; add both or turn CFG parallel off.")

    def check_layout(self, kwargs: dict[str, Any], batch: int) -> int:
        """TaylorSeer predicts a step from the full steps before it, and with the prefix K/V cache on the first step's
        blocks return the prefix's rows too: a step predicted from that one alone has the wrong length (diffusers'
        own fails mid-job on the shapes), so the second step must run in full."""
        tokens = super().check_layout(kwargs, batch)
        cache = kwargs.get(STEP_CACHE)
        if (cache is not None and cache.method == "taylorseer" and kwargs.get("use_kv_cache", 1)
                and cache.warmup < 2 and cache.interval > 1):
            raise LayoutError(f"--cache taylorseer with --cache-warmup {cache.warmup} on QwenImage21Pipeline would "
                              "predict a step from its first, whose blocks also return the cached prefix's rows; use "
                              "--cache-warmup 2 or more, or --call use_kv_cache=0")
        return tokens

    def converted(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Without guidance_scale (its __call__ takes none: true_cfg_scale is its guidance), masks checked; again on a
        pool rank's own tensors after a prepared submit."""
        kwargs.pop("guidance_scale", None)
        for embeds, mask in MASKS.items():
            if kwargs.get(mask) is not None and kwargs.get(embeds) is not None:
                kwargs[mask] = self._checked_mask(kwargs[mask], mask)
        for slots in SLOTS.values():
            if isinstance(kwargs.get(slots), torch.Tensor):
                kwargs[slots] = kwargs[slots].bool()
        return kwargs

    def check_inputs(self, kwargs: dict[str, Any], batch: int) -> None:
        """Condition pictures come with the slots their prompts were encoded with, as many as their tokens fill."""
        image = kwargs.get("image")
        given = {embeds: slots for embeds, slots in SLOTS.items() if kwargs.get(embeds) is not None}
        if image is None:
            if stray := [slots for slots in given.values() if kwargs.get(slots) is not None and kwargs[slots].any()]:
                raise ValueError(f"{stray[0]} marks condition-picture slots but no `image` was sent; send the pictures "
                                 "the prompt was encoded with")
            return super().check_inputs(kwargs, batch)
        filled = image.shape[0] * self.condition_size(image)[2] // 4  # a slot holds 2×2 latent tokens
        for embeds, slots in given.items():
            mask = kwargs.get(slots)
            if mask is None:
                raise ValueError(f"{embeds} come without {slots}: encode the prompts with the condition pictures "
                                 "(python -m parallel.make_inputs --image, or the pool's encode with an image)")
            marked = sorted(set(mask.sum(dim=-1).tolist())) if mask.ndim == 2 else []
            if tuple(mask.shape) != tuple(kwargs[embeds].shape[:2]) or marked != [filled]:
                raise ValueError(f"{slots} {list(mask.shape)} marks {marked} slots; {embeds} "
                                 f"{list(kwargs[embeds].shape)} with these {image.shape[0]} picture(s) of "
                                 f"{image.shape[3]}x{image.shape[2]} need [batch, tokens] marking {filled}: encode the "
                                 "prompts with these pictures")
        super().check_inputs(kwargs, batch)

    def condition_size(self, image: torch.Tensor) -> tuple[int, int, int]:
        """Width, height and latent tokens of each picture as `__call__` sizes it: its default output_resolution's
        area at the pictures' aspect ratio (the pipeline's own calculate_dimensions)."""
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[1] != 3:
            raise ValueError(f"image has shape {list(getattr(image, 'shape', []))}; QwenImage21Pipeline takes "
                             "condition pictures [N, 3, H, W] in [0, 1]")
        pipeline = self.module
        area = inspect.signature(type(pipeline).__call__).parameters["output_resolution"].default ** 2
        sizing = inspect.getmodule(type(pipeline)).calculate_dimensions
        width, height = sizing(area, image.shape[3] / image.shape[2])[:2]
        return width, height, (height // pipeline.vae_scale_factor) * (width // pipeline.vae_scale_factor)

    def _checked_mask(self, mask: torch.Tensor, name: str) -> torch.Tensor | None:
        """An all-valid mask is none (as the pipeline's encode_prompt drops it); padding under sequence parallel is
        refused (its attention takes no mask)."""
        if mask.bool().all():
            return None
        c = self.parallel_config
        if c.sp_degree > 1:
            raise LayoutError(f"{name} pads the shorter prompts of this batch; Ulysses and Ring attention take no mask: "
                              "send one prompt per job, or prompts of one token length")
        return mask.bool()

    def encode_text(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, mask, _ = self.module.encode_prompt(prompt, device=self.module.transformer.device)
        return {"prompt_embeds": embeds} if mask is None else {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def encode_text_with_images(self, prompt: str, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """The prompt encoded with its condition pictures as `__call__` encodes them (each resized, as RGBA, to its
        size there), with their `image_pad_mask`; `image` the pictures themselves, which the call's VAE encodes."""
        pipeline = self.module
        width, height, _ = self.condition_size(image)
        seen = [pipeline.image_processor.resize(picture.convert("RGBA"), height=height, width=width)
                for picture in pictures(image)]
        embeds, mask, slots = pipeline.encode_prompt(prompt, image=seen, device=pipeline.transformer.device)
        return {"prompt_embeds": embeds, **({} if mask is None else {"prompt_embeds_mask": mask}),
                "image_pad_mask": slots, "image": image}

    def call_context(self, kwargs: dict[str, Any]):
        """The pipeline's prefix K/V caches as PrefixKV (this rank's heads under Ulysses), dropped when the call ends
        however it ends; what they held is logged per rank."""
        from ..distributed import get_ulysses_group

        module = inspect.getmodule(type(self.module))
        made: list = []
        record = {"stores": 0, "bytes": 0}
        self.prefix_cache = record
        group = get_ulysses_group()
        base = module.QwenImage21KVCache

        def cache(layers: int):
            made.append(base(0))
            made[-1].layer_caches = [PrefixKV(group.rank_in_group, group.world_size, record) for _ in range(layers)]
            return made[-1]

        @contextlib.contextmanager
        def scope():
            try:
                with replaced(module, "QwenImage21KVCache", cache), self._condition_pictures(kwargs):
                    yield
            finally:
                for layers in made:
                    for layer in layers.layer_caches:
                        layer.drop()
                if record["stores"]:
                    log.info("prefix K/V cache: %d layers stored, %.1f MiB on this rank", record["stores"],
                             record["bytes"] / 2**20)

        return scope()

    def _condition_pictures(self, kwargs: dict[str, Any]):
        """`image` as the PIL pictures `__call__` takes; each prompt's `image_pad_mask` handed to the encode_prompt call
        that passes its embeddings on (`__call__` has no argument for it)."""
        slots = [(kwargs.get(embeds), kwargs.pop(name, None)) for embeds, name in SLOTS.items()]
        if kwargs.get("image") is None:
            return contextlib.nullcontext()
        kwargs["image"] = pictures(kwargs["image"])
        encode = self.module.encode_prompt

        def encode_prompt(*args, prompt_embeds=None, **rest):
            mask = next((mask for embeds, mask in slots if embeds is not None and embeds is prompt_embeds), None)
            return encode(*args, prompt_embeds=prompt_embeds, image_pad_mask=mask, **rest)

        return replaced(self.module, "encode_prompt", encode_prompt)


class PrefixKV:
    """One layer's prefix K/V (diffusers' QwenImage21KVLayerCache's store/get), [B, prefix, heads, head size]: this
    Ulysses rank's heads kept, the others given back as zeros, which its attention never reads (usp.py takes each
    rank's own heads of the prefix)."""

    def __init__(self, rank: int, ranks: int, record: dict):
        self.rank, self.ranks, self.record = rank, ranks, record
        self.k = self.v = None
        self.heads = 0
        LIVE.add(self)

    def _mine(self, tensor: torch.Tensor) -> torch.Tensor:
        part = tensor.shape[2] // self.ranks
        return tensor[:, :, self.rank * part:(self.rank + 1) * part].clone()

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.heads = k.shape[2]
        self.k, self.v = self._mine(k), self._mine(v)
        self.record["stores"] += 1
        self.record["bytes"] += 2 * self.k.numel() * self.k.element_size()

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            raise RuntimeError("the prefix K/V cache has not been stored, or was dropped with its call")
        if self.ranks == 1:
            return self.k, self.v
        part = self.heads // self.ranks
        whole = []
        for mine in (self.k, self.v):
            full = mine.new_zeros((*mine.shape[:2], self.heads, mine.shape[3]))
            full[:, :, self.rank * part:(self.rank + 1) * part] = mine
            whole.append(full)
        return whole[0], whole[1]

    def drop(self) -> None:
        self.k = self.v = None
        LIVE.discard(self)


# -- tiny built-in model ----------------------------------------------------------------------------------
TEXT_WIDTH = 16
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
                 "{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}")


def tiny_processor(tokenizer):
    """Qwen3-VL's processor on the tiny tokenizer (16-pixel patches merged 2×2, above the ~1024² the pipeline sizes
    condition pictures to, so that each slot it gives a picture holds 2×2 of its latent tokens), with a chat template
    for the pipeline's messages; without its video half where torchvision is missing (vl_processors)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.utils import is_torchvision_available

    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                      max_pixels=2048 * 2048)
    if is_torchvision_available():
        from transformers import Qwen3VLVideoProcessor

        return Qwen3VLProcessor(images, tokenizer, Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    from ..loading.vl_processors import images_only

    return images_only(Qwen3VLProcessor)(images, tokenizer, chat_template=CHAT_TEMPLATE)


def build_tiny(seed: int):
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                           QwenImage21Transformer2DModel)

    from ..loading import tiny_models as tm

    transformer = tm._transformer(seed, QwenImage21Transformer2DModel, in_channels=CHANNELS, out_channels=CHANNELS,
                                  num_layers=tm.BLOCKS, context_in_dim=TEXT_WIDTH, mlp_ratio=2, axes_dims_rope=(4, 6, 6))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # a modulation of trained size, not of init's
        torch.manual_seed(seed + 7)
        transformer.modulation[1].weight.normal_(0, 0.5)
    vae = tm._seeded(seed + 3, AutoencoderKLQwenImage21, base_dim=8, decoder_base_dim=8, z_dim=CHANNELS, dim_mult=[1] * 5,
                     num_res_blocks=1)  # the released statistics (its defaults), as ComfyUI's format holds them
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
                                                base_shift=0.5, max_shift=1.15)
    tokenizer, text_encoder = tm._qwen3_vl(seed + 1, TEXT_WIDTH, "Qwen3VLForConditionalGeneration")
    return QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=tiny_processor(tokenizer),
                               transformer=transformer)


def tiny_inputs(*, batch: int, height: int, width: int, seed: int, negative: bool, text_tokens: int | None,
                num_frames: int) -> dict:
    """Latents [B, H/16·W/16, 64] and 16-wide embeddings; a batch's later prompts shorter (3 tokens each, masked), the
    negatives of another length (5 fewer tokens), as the pipeline's encoder pads them."""
    from ..loading import tiny_models as tm

    gen = torch.Generator().manual_seed(seed)
    tokens = text_tokens or tm.TEXT_TOKENS
    out = {"latents": torch.randn(batch, (height // 16) * (width // 16), CHANNELS, generator=gen)}
    for (embeds, mask), length in zip(MASKS.items(), (tokens, max(1, tokens - 5))):
        if embeds.startswith("negative") and not negative:
            continue
        out[embeds] = torch.randn(batch, length, TEXT_WIDTH, generator=gen)
        valid = (length - 3 * torch.arange(batch)).clamp(min=1)
        out[mask] = torch.arange(length) < valid[:, None]
    return out


TEXT_ROWS = "target_token_mask"
QWEN_IMAGE21 = FAMILIES.register(Family(
    name="qwen-image-2.1",
    pipelines={"QwenImage21Pipeline": xFuserQwenImage21Pipeline},
    transformer="QwenImage21Transformer2DModel",
    plan=ParallelPlan(
        # Inside the blocks: [prefix; image], the prefix whole on every rank, the image's rows split (see above).
        inputs={"transformer_blocks.0": {"hidden_states": Split(dim=1, expected_dims=3, after_text=True)},
                "transformer_blocks.*": {"rotary_emb": Split(dim=0, expected_dims=2, after_text=True),
                                         TEXT_ROWS: Split(dim=0, expected_dims=1, after_text=True)}},
        outputs={"transformer_blocks.-1": Gather(dim=1, expected_dims=3, after_text=True)},
        attention={"transformer_blocks.*.attn": TextLayout.CAUSAL_PREFIX},
        text_input=None,
        text_rows=TextRows(path="transformer_blocks.0", mask=TEXT_ROWS),
        cfg=CfgMode.SEQUENTIAL,
        cfg_branches=("cond", "uncond"),
        uneven_tokens=True,
        output_tail=True,
        no_pipefusion="its prefix attends block-causally and is cached whole; image patches would need the prefix's "
                      "K/V per patch and step",
    ),
    tiny={"qwen-image-2.1": TinyModel("QwenImage21Pipeline", build_tiny, tiny_inputs, guidance=1.0,
                                      true_cfg={"true_cfg_scale": 4.0})},
    attention_layers={"QwenImage21Attention": "diffusers.models.transformers.transformer_qwenimage21"},
))
