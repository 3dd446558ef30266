"""Krea 2 and Qwen-Image 2.1 in a real ComfyUI 0.33.0, one server for both.

Krea 2, which ComfyUI 0.33 runs natively: a tiny model of ComfyUI's own shape (ComfyUI reads its widths and depth
from the file but fixes heads of 128, 20 text heads and an MLP multiplier of 4: 2 heads of 128 over 1 key/value
head, a 40-wide text of 3 stacked layers) saved as a diffusers folder (for xDiT Text Encode's pool) and as Krea's
single file. The Krea 2 Turbo template's sampling part (UNETLoader → KSampler on EmptyLatentImage, cfg 1 with
ConditioningZeroOut; and cfg 4 with a negative) with the loader swapped for Load Diffusion Model (xDiT Pool) on
Ulysses 2 and on CFG 2 equals ComfyUI's own Krea 2 model on the same file within 1e-4. xDiT Text Encode + ComfyUI's
EmptySD3LatentImage + xDiT Sampler on the built-in tiny Krea 2 (Ulysses 2) gives a LATENT in ComfyUI's own Wan 2.1
format equal to diffusers' Krea2Pipeline within 1e-4.

Qwen-Image 2.1, which ComfyUI 0.33 lacks (no TextEncodeQwenImage21, no QwenImage21 latent format): xDiT Text Encode +
xDiT Empty Latent + xDiT Sampler on the built-in tiny model (64 channels at 1/16, the released VAE's statistics), its
prefix K/V cache on, on Ulysses 2 and on CFG 2 (cfg 4: its true CFG), give a LATENT in the pack's declared QwenImage21
format equal to diffusers' QwenImage21Pipeline within 1e-4; and with a picture given to both xDiT Text Encodes (its edit
mode) equal to that pipeline given the prompt strings and the picture, another picture missing.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file

from original_layouts import original_layout
from test_comfyui import native_format_taken, saved_latent
from test_comfyui_model import latents_of
from xdit_test_helpers import TOLERANCE, diffusers_latents, load_pipeline_folder

KREA, STEPS, SEED, SIZE = "tiny-krea2-comfy", 4, 5, 64
POSITIVE, NEGATIVE = "a lighthouse at dusk", "blurry"
LAYOUT = {"nproc": 2, "ulysses_degree": 1, "ring_degree": 1, "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1,
          "cfg_parallel": False, "dp_degree": 1, "devices": "", "threads_per_rank": 1, "endpoint": ""}


def _entry(comfy, prompt) -> dict:
    entry = comfy.wait(comfy.queue(prompt), 900)
    errors = [(m[1]["node_type"], m[1]["exception_message"], m[1]["traceback"][-3:])
              for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "success", errors or json.dumps(entry["status"])[-2000:]
    return entry


def _run(comfy, prompt) -> dict[str, torch.Tensor]:
    return latents_of(comfy, _entry(comfy, prompt))


# ---------------------------------------------------------------------------------------------------- Krea 2
def krea_file(comfy):
    """The ComfyUI-shaped tiny Krea 2 transformer, written as Krea's single file (KREA), and returned."""
    from diffusers import Krea2Transformer2DModel

    from parallel.families.krea2 import _random_norms
    from parallel.loading import tiny_models as tm

    transformer = tm._seeded(6, Krea2Transformer2DModel, in_channels=64, num_layers=2, attention_head_dim=128,
                             num_attention_heads=2, num_key_value_heads=1, intermediate_size=768, timestep_embed_dim=256,
                             text_hidden_dim=40, num_text_layers=3, text_num_attention_heads=20,
                             text_num_key_value_heads=20, text_intermediate_size=128)
    _random_norms(transformer, 6)
    weights = original_layout("krea2", transformer)
    save_file({k: v.contiguous() for k, v in weights.items()}, comfy.work / "models" / "diffusion_models" / f"{KREA}.safetensors")
    return transformer


@pytest.fixture(scope="module")
def krea_files(comfy) -> str:
    """The tiny Krea 2: Krea's single file (krea_file) and its diffusers folder (text encoders included)."""
    from parallel.loading import tiny_models as tm

    pipe = tm.build_tiny_pipeline("krea2", seed=6)
    tokenizer, text_encoder = tm._qwen3_vl(7, 40, "Qwen3VLModel", layers=3)
    pipe = type(pipe)(**{**pipe.components, "transformer": krea_file(comfy), "tokenizer": tokenizer,
                         "text_encoder": text_encoder}, text_encoder_select_layers=(1, 2, 3))
    pipe.save_pretrained(comfy.work / "models" / "diffusers" / KREA, safe_serialization=True)
    return KREA


def _krea_template(model: dict) -> dict:
    """The Krea 2 Turbo template's sampling: EmptyLatentImage, KSampler euler/simple at cfg 1 on the prompt and its
    ConditioningZeroOut; and at cfg 4 with a negative prompt (Krea's own guidance, 3)."""
    ksampler = {"seed": SEED, "steps": STEPS, "sampler_name": "euler", "scheduler": "simple", "latent_image": ["latent", 0],
                "denoise": 1.0, "model": ["unet", 0], "positive": ["text", 0]}
    return {
        "pool": {"class_type": "XDiTPool", "inputs": {**LAYOUT, "model": KREA, "nproc": 1, "text_encoders": True,
                                                       "dtype": "auto"}},
        "text": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["pool", 0], "text": POSITIVE}},
        "negative": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["pool", 0], "text": NEGATIVE}},
        "zero": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["text", 0]}},
        "latent": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "unet": model,
        "turbo": {"class_type": "KSampler", "inputs": {**ksampler, "cfg": 1.0, "negative": ["zero", 0]}},
        "save-turbo": {"class_type": "SaveLatent", "inputs": {"samples": ["turbo", 0], "filename_prefix": "turbo"}},
        "guided": {"class_type": "KSampler", "inputs": {**ksampler, "cfg": 4.0, "negative": ["negative", 0]}},
        "save-guided": {"class_type": "SaveLatent", "inputs": {"samples": ["guided", 0], "filename_prefix": "guided"}},
    }


def _swapped(**layout) -> dict:
    return {"class_type": "XDiTLoadDiffusionModel", "inputs": {
        **LAYOUT, "unet_name": f"{KREA}.safetensors", "weight_dtype": "default", **layout}}


@pytest.fixture(scope="module")
def krea_stock(comfy, krea_files) -> dict[str, torch.Tensor]:
    return _run(comfy, _krea_template({"class_type": "UNETLoader", "inputs": {"unet_name": f"{KREA}.safetensors",
                                                                             "weight_dtype": "default"}}))


@pytest.mark.parametrize("layout", [{"ulysses_degree": 2}, {"cfg_parallel": True}], ids=["ulysses2", "cfg2"])
def test_krea2_with_the_loader_swapped_equals_comfyuis_own_krea2(comfy, krea_stock, layout):
    swapped = _run(comfy, _krea_template(_swapped(**layout)))
    for name in ("turbo", "guided"):
        assert swapped[name].shape == krea_stock[name].shape == (1, 16, 1, SIZE // 8, SIZE // 8)
        assert (swapped[name] - krea_stock[name]).abs().max().item() <= TOLERANCE, name
        assert krea_stock[name].abs().max().item() > 0.1
    # negative control: guidance changes the result, so agreeing per cfg is agreeing on something
    assert (swapped["guided"] - krea_stock["turbo"]).abs().max().item() > 1e-2


def _sampler_workflow(family: str, cfg: float, empty: str, prefix: str, layout=None) -> dict:
    """xDiT Pool (the built-in tiny model, `layout`: Ulysses 2 unless told) → xDiT Text Encode ×2 → `empty` → xDiT
    Sampler → SaveLatent."""
    empty_inputs = {"width": SIZE, "height": SIZE, "batch_size": 1}
    return {
        "1": {"class_type": "XDiTPool", "inputs": {**LAYOUT, "model": f"xdit-tiny-{family} (built-in, no download)",
                                                    **(layout or {"ulysses_degree": 2}), "text_encoders": True,
                                                    "dtype": "auto"}},
        "2": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": POSITIVE}},
        "3": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": NEGATIVE}},
        "4": {"class_type": empty, "inputs": {**empty_inputs, **({"pool": ["1", 0]} if empty.startswith("XDiT") else {})}},
        "5": {"class_type": "XDiTSampler", "inputs": {
            "pool": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": SEED,
            "steps": STEPS, "cfg": cfg, "sampler": "default", "denoise": 1.0, "preview": True}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}},
    }


def _in_comfy_space(pipeline, packed: torch.Tensor) -> torch.Tensor:
    """The pipeline's packed model-space latents as ComfyUI keeps a Wan 2.1-format image: [B, 16, 1, h, w] in the
    VAE's space (comfy.latent_formats.Wan21.process_out: the VAE's per-channel std and mean)."""
    latents = pipeline._unpack_latents(packed, SIZE, SIZE)
    config = pipeline.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
    return latents * std + mean


def test_krea2_xdit_sampler_equals_diffusers_in_comfyuis_own_latent_format(comfy, tiny_model_dirs):
    entry = _entry(comfy, _sampler_workflow("krea2", 4.0, "EmptySD3LatentImage", "krea2"))
    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs["krea2"])
    noise = torch.randn((1, 16, SIZE // 8, SIZE // 8), generator=torch.manual_seed(SEED))
    call = {"prompt": POSITIVE, "negative_prompt": NEGATIVE, "num_inference_steps": STEPS, "height": SIZE, "width": SIZE,
            "latents": pipeline._pack_latents(noise, 1, 16, SIZE // 8, SIZE // 8)}
    expected = _in_comfy_space(pipeline, diffusers_latents(pipeline, "krea2", guidance_scale=3.0, **call))
    latent = saved_latent(comfy, entry)
    assert latent.shape == expected.shape == (1, 16, 1, SIZE // 8, SIZE // 8)
    assert (latent - expected).abs().max().item() <= TOLERANCE
    assert native_format_taken(comfy, "Krea2Pipeline", "Wan21")
    # negative control: ComfyUI's cfg 4 is Krea's guidance 3, not 4
    other = _in_comfy_space(pipeline, diffusers_latents(pipeline, "krea2", guidance_scale=4.0, **call))
    assert (latent - other).abs().max().item() > 100 * TOLERANCE


# ---------------------------------------------------------------------------------------------------- Qwen-Image 2.1
QWEN21 = "qwen-image-2.1"


def _qwen21_comfy(**call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' QwenImage21Pipeline in this process on ComfyUI's noise for SEED, true CFG 4 (ComfyUI's cfg 4), the
    prefix K/V cache on (its default), `call` added: its tokens as ComfyUI's [1, 64, h, w] (the decode's own
    `latents * std + mean`, before the VAE), and the VAE's mean and std."""
    from parallel.loading.builtin_models import builtin_model_dir

    pipeline = load_pipeline_folder(builtin_model_dir(f"xdit-tiny-{QWEN21}"))  # the pool's own folder
    side = SIZE // 16
    noise = torch.randn((1, 64, side, side), generator=torch.manual_seed(SEED))
    tokens = diffusers_latents(pipeline, QWEN21, prompt=POSITIVE, negative_prompt=NEGATIVE, true_cfg_scale=4.0,
                               use_kv_cache=True, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                               latents=pipeline._pack_latents(noise, 1, 64, side, side), **call)
    config = pipeline.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (config.latents_mean, config.latents_std))
    return pipeline._unpack_latents(tokens, SIZE, SIZE, 16)[:, :, 0] * std + mean, mean, std


@pytest.fixture(scope="module")
def qwen21_reference() -> dict[str, torch.Tensor]:
    """diffusers' text-to-image result in ComfyUI's space, and in the model's space (the negative control)."""
    comfy, mean, std = _qwen21_comfy()
    return {"comfy": comfy, "model_space": comfy.sub(mean).div(std)}


# the prefix K/V layers each rank stores: 4 blocks for each branch it runs (cond and uncond; under CFG 2 one)
@pytest.mark.parametrize("layout, cached", [({"ulysses_degree": 2}, 8), ({"cfg_parallel": True}, 4)],
                         ids=["ulysses2", "cfg2"])
def test_qwen_image21_xdit_nodes_equal_diffusers_in_the_declared_latent_format(comfy, qwen21_reference, layout, cached):
    before = len(comfy.log.read_text())
    entry = _entry(comfy, _sampler_workflow(QWEN21, 4.0, "XDiTEmptyLatent", "qwen21", layout))
    latent, expected = saved_latent(comfy, entry), qwen21_reference["comfy"]
    assert latent.shape == expected.shape == (1, 64, SIZE // 16, SIZE // 16)
    assert (latent - expected).abs().max().item() <= TOLERANCE
    log = comfy.log.read_text()
    assert log[before:].count(f"prefix K/V cache: {cached} layers stored") == 2  # each rank's report: it was on
    assert "the pack's declared QwenImage21 format" in log
    assert not native_format_taken(comfy, "QwenImage21Pipeline", "QwenImage21")
    # negative control: the same numbers without the declared standardisation undone are not ComfyUI's LATENT
    assert (latent - qwen21_reference["model_space"]).abs().max().item() > 100 * TOLERANCE


def test_qwen_image21_text_encode_with_a_picture_edits_as_diffusers(comfy):
    """LoadImage → xDiT Text Encode with the picture, positive and negative (Qwen3-VL sees it; the conditioning carries
    the picture and where it sits in the prompt) → xDiT Empty Latent → xDiT Sampler on the built-in tiny model (Ulysses
    2, cfg 4, the prefix K/V cache on, the picture's tokens in it) equals diffusers' QwenImage21Pipeline given the prompt
    strings and the picture; another picture misses by far more."""
    import numpy as np
    import PIL.Image

    rng = np.random.default_rng(5)
    for name in ("qwen21-ref.png", "qwen21-other.png"):
        PIL.Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(comfy.work / "input" / name)
    graph = _sampler_workflow(QWEN21, 4.0, "XDiTEmptyLatent", "qwen21-edit")
    graph["7"] = {"class_type": "LoadImage", "inputs": {"image": "qwen21-ref.png"}}
    for node in ("2", "3"):
        graph[node]["inputs"]["image"] = ["7", 0]
    latent = saved_latent(comfy, _entry(comfy, graph))

    def expected(name: str) -> torch.Tensor:
        return _qwen21_comfy(image=PIL.Image.open(comfy.work / "input" / name).convert("RGB"))[0]

    assert latent.shape == (1, 64, SIZE // 16, SIZE // 16)
    assert (latent - expected("qwen21-ref.png")).abs().max().item() <= TOLERANCE
    assert (latent - expected("qwen21-other.png")).abs().max().item() > 100 * TOLERANCE
