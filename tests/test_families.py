"""The family registry (parallel/families/) and the ComfyUI adapter built from its data.

The adapter's conversions are checked against ComfyUI's own `comfy/latent_formats.py`, read from the
ComfyUI source snapshots in ../shared/comfyui (it needs torch only), and against the scale/shift values
ComfyUI documents for each format, so a family that names the wrong format fails here. The oldest supported
ComfyUI (0.3.64) lacks FLUX.2's and HunyuanVideo 1.5's formats, so the families' declarations stand in; ComfyUI
0.33 has both, and there its own classes are taken (nodes/comfy_compat.py), with the same numbers.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch

from parallel.families import FAMILIES
from parallel.families.base import unpack_2x2
from xdit_test_helpers import ROOT, import_node_module

COMFYUI_SOURCE = ROOT.parent / "shared" / "comfyui" / "ComfyUI-0.3.64-a125cd84.tar.gz"
COMFYUI_CURRENT_SOURCE = ROOT.parent / "shared" / "comfyui" / "ComfyUI-0.33.0-2f35f4a0.tar.gz"


def test_importing_the_families_imports_no_diffusers():
    """The ComfyUI process reads the families' data: that must not pull diffusers or transformers in."""
    code = ("import sys, parallel.families, parallel.model_executor, parallel.loading.builtin_models, parallel.loading.checkpoints; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_every_diffusers_class_finds_its_family():
    import diffusers

    for family in FAMILIES:
        assert FAMILIES.for_transformer(getattr(diffusers, family.transformer)) is family
        for pipeline, wrapper in family.pipelines.items():
            assert FAMILIES.pipeline_wrapper(getattr(diffusers, pipeline)) is wrapper
            # every pipeline says how ComfyUI keeps its latents, or why this ComfyUI cannot (FLUX.2: not in 0.3.64)
            assert set(wrapper.comfy.latent_formats) or "ComfyUI" in wrapper.comfy.expects
    with pytest.raises(ValueError, match="StableDiffusionPipeline is not a supported pipeline; supported: .*FluxPipeline"):
        FAMILIES.pipeline_wrapper(diffusers.StableDiffusionPipeline)


def test_the_readmes_capability_table_is_the_plans():
    """README.md shows the table `python -m parallel.run --list-supported` derives from the registered plans."""
    from parallel.model_executor import capability_table

    assert capability_table() in (ROOT / "README.md").read_text(), "regenerate README.md's table from --list-supported"


def test_declared_attention_layers_get_one_dispatch_wrapper_each():
    """A family's `attention_layers` is all the engine needs to wrap its attention (no shared file names it)."""
    import importlib

    from parallel.model_executor.attention import dispatch as attention_dispatch
    from parallel.model_executor.register import xFuserLayerWrappersRegister

    declared = {name: site for family in FAMILIES for name, site in family.attention_layers.items()}
    assert {"FluxAttention", "WanAttention"} <= set(declared)
    for name, site in declared.items():
        module = importlib.import_module(site)
        assert callable(module.dispatch_attention_fn)
        layer_class = getattr(module, name)
        wrapper = xFuserLayerWrappersRegister.get_wrapper(layer_class)
        assert wrapper.call_site == (site, "dispatch_attention_fn")
        assert xFuserLayerWrappersRegister.get_wrapper(layer_class) is wrapper  # built once per class
        assert name in xFuserLayerWrappersRegister.supported_names()
    source = Path(attention_dispatch.__file__).read_text()
    assert not any(family.name in source.lower() or name in source for family in FAMILIES for name in declared)
    with pytest.raises(ValueError, match="Linear is not a supported layer; supported: .*FluxAttention"):
        xFuserLayerWrappersRegister.get_wrapper(torch.nn.Linear(2, 2))


def _latent_formats(source: Path, root: Path) -> types.ModuleType:
    """comfy/latent_formats.py of a ComfyUI source snapshot, as a module named as ComfyUI names it."""
    if not source.is_file():
        pytest.skip(f"no ComfyUI source at {source}")
    with tarfile.open(source) as archive:
        archive.extract("comfy/latent_formats.py", root, filter="data")
    module = types.ModuleType("comfy.latent_formats")
    path = root / "comfy" / "latent_formats.py"
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def latent_formats(tmp_path_factory):
    return _latent_formats(COMFYUI_SOURCE, tmp_path_factory.mktemp("comfy"))


@pytest.fixture(scope="module")
def current_latent_formats(tmp_path_factory):
    return _latent_formats(COMFYUI_CURRENT_SOURCE, tmp_path_factory.mktemp("comfy_current"))


def _adapters(monkeypatch, latent_formats):
    comfy = types.ModuleType("comfy")
    comfy.latent_formats = latent_formats
    return import_node_module(monkeypatch, "adapters", {"comfy": comfy, "comfy.latent_formats": latent_formats})


@pytest.fixture
def adapters(monkeypatch, latent_formats):
    return _adapters(monkeypatch, latent_formats)


# ComfyUI's values (DESIGN.md "Facts"): model space = (x − shift) · scale. A wrong shift (-1.0) is the negative control.
IMAGE_FORMATS = [
    ("PixArtAlphaPipeline", "SD15", 4, 0.18215, 0.0),
    ("PixArtSigmaPipeline", "SDXL", 4, 0.13025, 0.0),
    ("StableDiffusion3Pipeline", "SD3", 16, 1.5305, 0.0609),
    ("FluxPipeline", "Flux", 16, 0.3611, 0.1159),
    ("FluxKontextPipeline", "Flux", 16, 0.3611, 0.1159),
]


@pytest.mark.parametrize("pipeline, name, channels, scale, shift", IMAGE_FORMATS)
def test_image_latents_convert_as_comfyui_does(adapters, latent_formats, pipeline, name, channels, scale, shift):
    adapter = adapters.adapter_for(pipeline, 8)
    x = torch.randn(2, channels, 6, 4, generator=torch.Generator().manual_seed(0))
    assert adapter.format_name(channels) == name
    assert adapter.job_size(x) == {"height": 48, "width": 32}
    model = adapter.to_model(x)
    unpacked = unpack_2x2(model, 48, 32) if adapter.data.packed else model
    assert torch.equal(unpacked, (x - shift) * scale)
    assert not torch.allclose(unpacked, (x + 1.0) * scale)
    assert torch.equal(unpacked, getattr(latent_formats, name)().process_in(x))
    assert torch.equal(adapter.to_comfy(model, 48, 32), getattr(latent_formats, name)().process_out(unpacked))
    assert torch.allclose(adapter.to_comfy(model, 48, 32), x, atol=1e-6)
    if adapter.data.packed:  # Flux: [B, H/2·W/2, 4C] tokens, as FluxPipeline._pack_latents makes them
        from diffusers import FluxPipeline

        assert torch.equal(model, FluxPipeline._pack_latents(unpacked, 2, channels, 6, 4))
        assert torch.equal(adapter.noise_to_model(x), FluxPipeline._pack_latents(x, 2, channels, 6, 4))


def test_qwen_image_latents_keep_comfyuis_one_frame_and_its_cfg_is_true_cfg(adapters, latent_formats):
    """Qwen-Image samples images in Wan 2.1's latent space: ComfyUI keeps them [B, 16, 1, H, W] (Wan21 is a video
    format) and hands EmptySD3LatentImage's [B, 16, H, W] to its sampler as one frame; its cfg is true CFG."""
    from diffusers import QwenImagePipeline

    qwen, fmt = adapters.adapter_for("QwenImagePipeline", 8), latent_formats.Wan21()
    x = torch.randn(2, 16, 1, 6, 4, generator=torch.Generator().manual_seed(0))
    samples = qwen.comfy_latent(x)
    assert torch.equal(samples, x[:, :, 0]) and qwen.job_size(samples) == {"height": 48, "width": 32}
    model = qwen.to_model(samples)
    assert torch.equal(model, QwenImagePipeline._pack_latents(fmt.process_in(x)[:, :, 0], 2, 16, 6, 4))
    assert torch.equal(qwen.to_comfy(model, 48, 32), fmt.process_out(fmt.process_in(x)))  # 5-D, as ComfyUI returns it
    assert torch.allclose(qwen.to_comfy(model, 48, 32), x, atol=1e-5)
    assert qwen.guidance_parameters(4.0, None, True) == (4.0, {"true_cfg_scale": 4.0})
    assert qwen.guidance_parameters(1.0, None, False) == (1.0, {"true_cfg_scale": 1.0})


def test_flux2_latents_take_the_declared_format_where_comfyui_064_has_none(adapters, latent_formats):
    """ComfyUI 0.3.64 has no FLUX.2 latent format: the family's declaration stands in (128 channels at 1/16, the
    identity, ComfyUI's preview factors over the 32 unfolded channels). The pipelines take ComfyUI's LATENT as it
    is and keep (and, with model_latents, return) it as one token per latent pixel."""
    from diffusers import Flux2KleinPipeline

    assert not hasattr(latent_formats, "Flux2")
    for pipeline in ("Flux2KleinPipeline", "Flux2Pipeline"):
        flux2 = adapters.adapter_for(pipeline, 16)
        x = torch.randn(2, 128, 3, 5, generator=torch.Generator().manual_seed(0))
        fmt = flux2.latent_format(128)
        assert (fmt.latent_channels, fmt.spacial_downscale_ratio, len(fmt.latent_rgb_factors)) == (128, 16, 32)
        assert flux2.job_size(x) == {"height": 48, "width": 80}
        assert torch.equal(flux2.to_model(x), x) and torch.equal(flux2.noise_to_model(x), x)
        tokens = Flux2KleinPipeline._pack_latents(x)
        assert torch.equal(flux2.to_comfy(tokens, 48, 80), x)
        assert not torch.equal(flux2.to_comfy(tokens.flip(1), 48, 80), x)
        # the preview unfolds the (c, 2, 2) patches as diffusers' own unpatchify does
        unfolded = fmt.latent_rgb_factors_reshape(flux2.preview_latents(tokens[:1], 48, 80))
        assert torch.equal(unfolded, Flux2KleinPipeline._unpatchify_latents(x[:1]))
        with pytest.raises(adapters.ConditioningError, match="has 16 channels; expected 128"):
            flux2.job_size(torch.zeros(1, 16, 4, 4))
    dev = adapters.adapter_for("Flux2Pipeline", 16)
    assert dev.guidance_parameters(1.0, 2.5, False) == (2.5, {})
    with pytest.raises(adapters.ConditioningError, match="guidance-distilled .* set cfg to 1"):
        dev.guidance_parameters(3.0, None, True)


def test_hunyuan_video15_latents_and_xdit_text_travel_through_comfyui(adapters, latent_formats):
    """ComfyUI 0.3.64 has no HunyuanVideo 1.5 format: the declared one scales by the VAE's 1.03682 (×16, 3-D, no
    previews); xDiT Text Encode's other text inputs (masks, byT5 glyph text) reach the pipeline per branch."""
    hv = adapters.adapter_for("HunyuanVideo15Pipeline", 16)
    assert not hasattr(latent_formats, "HunyuanVideo15")
    x = torch.randn(1, 32, 3, 2, 4, generator=torch.Generator().manual_seed(0))
    assert hv.job_size(x) == {"height": 32, "width": 64, "num_frames": 9}
    assert torch.allclose(hv.to_model(x), x * 1.03682) and torch.allclose(hv.to_comfy(hv.to_model(x), 0, 0), x, atol=1e-6)
    assert hv.latent_format(32).latent_rgb_factors is None
    mask, glyphs = torch.ones(1, 7), torch.randn(1, 5, 16)
    positive = [[torch.randn(1, 7, 32), {adapters.XDIT_TEXT + "prompt_embeds_mask": mask,
                                         adapters.XDIT_TEXT + "prompt_embeds_2": glyphs, "other": 1}]]
    negative = [[torch.randn(1, 7, 32), {adapters.XDIT_TEXT + "prompt_embeds_mask": mask * 0}]]
    tensors, _ = hv.pipeline_inputs(positive, negative, 2, {})
    assert set(tensors) == {"prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "negative_prompt_embeds",
                            "negative_prompt_embeds_mask"}
    assert tensors["prompt_embeds_2"].shape == (2, 5, 16) and tensors["negative_prompt_embeds_mask"].sum() == 0


def test_comfyui_033_has_flux2_and_hunyuan_video15_formats_and_they_are_taken(monkeypatch, latent_formats,
                                                                             current_latent_formats):
    """On ComfyUI 0.33 the adapter takes ComfyUI's own Flux2 and HunyuanVideo15 classes (not the declarations), and
    the declarations that stand in for them on 0.3.64 convert and preview as those classes do. Negative control: on
    0.3.64 the same call gives the declared stand-in."""
    x = {128: torch.randn(1, 128, 3, 5, generator=torch.Generator().manual_seed(1)),
         32: torch.randn(1, 32, 2, 3, 5, generator=torch.Generator().manual_seed(2))}
    for pipeline, channels, name in (("Flux2KleinPipeline", 128, "Flux2"), ("Flux2Pipeline", 128, "Flux2"),
                                     ("HunyuanVideo15Pipeline", 32, "HunyuanVideo15"),
                                     ("HunyuanVideo15ImageToVideoPipeline", 32, "HunyuanVideo15")):
        native = _adapters(monkeypatch, current_latent_formats).adapter_for(pipeline, 16).latent_format(channels)
        assert type(native) is getattr(current_latent_formats, name), pipeline
        old = _adapters(monkeypatch, latent_formats).adapter_for(pipeline, 16).latent_format(channels)
        assert type(old) is latent_formats.LatentFormat and not hasattr(latent_formats, name)
        assert torch.allclose(old.process_in(x[channels]), native.process_in(x[channels]), rtol=0, atol=1e-7)
        assert torch.allclose(old.process_out(x[channels]), native.process_out(x[channels]), rtol=0, atol=1e-7)
        assert (old.latent_channels, old.spacial_downscale_ratio, old.latent_dimensions) == \
               (native.latent_channels, native.spacial_downscale_ratio, native.latent_dimensions)
        if name == "Flux2":  # the previews: the same factors over the same unfolded channels
            assert old.latent_rgb_factors == native.latent_rgb_factors
            assert old.latent_rgb_factors_bias == native.latent_rgb_factors_bias
            assert torch.equal(old.latent_rgb_factors_reshape(x[128]), native.latent_rgb_factors_reshape(x[128]))


def test_qwen_image21_latents_take_the_declared_standardisation_where_comfyui_033_has_none(monkeypatch,
                                                                                         current_latent_formats):
    """ComfyUI 0.33 has no Qwen-Image 2.1 format: the declaration stands in, its statistics the VAE's own (diffusers'
    AutoencoderKLQwenImage21 defaults); ComfyUI's [B, 64, H/16, W/16] goes to the pipeline standardised as its
    pipeline standardises (x − mean) / std, as one token per latent pixel, and comes back as its decode undoes it."""
    import inspect

    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline

    assert not hasattr(current_latent_formats, "QwenImage21")
    qwen = _adapters(monkeypatch, current_latent_formats).adapter_for("QwenImage21Pipeline", 16)
    defaults = inspect.signature(AutoencoderKLQwenImage21.__init__).parameters
    mean, std = (torch.tensor(defaults[name].default).view(1, 64, 1, 1) for name in ("latents_mean", "latents_std"))
    x = torch.randn(2, 64, 4, 6, generator=torch.Generator().manual_seed(0))
    assert qwen.job_size(x) == {"height": 64, "width": 96}
    model = qwen.to_model(x)
    assert torch.allclose(model, QwenImage21Pipeline._pack_latents((x - mean) / std, 2, 64, 4, 6), rtol=0, atol=1e-6)
    assert torch.equal(qwen.noise_to_model(x), QwenImage21Pipeline._pack_latents(x, 2, 64, 4, 6))
    decoded = QwenImage21Pipeline._unpack_latents(model, 64, 96, 16)[:, :, 0] * std + mean  # its decode's input
    assert torch.allclose(qwen.to_comfy(model, 64, 96), decoded, rtol=0, atol=1e-6)
    assert torch.allclose(qwen.to_comfy(model, 64, 96), x, rtol=0, atol=1e-5)
    assert not torch.allclose(qwen.to_comfy(model.flip(1), 64, 96), x, rtol=0, atol=1e-2)  # the tokens' order counts
    assert qwen.latent_format(64).latent_rgb_factors is None  # no previews declared
    assert qwen.guidance_parameters(4.0, None, True) == (4.0, {"true_cfg_scale": 4.0})


def test_wan_latents_use_comfyuis_wan21_and_wan22_formats(adapters, latent_formats):
    """16 channels (Wan 2.1, 2.2 A14B, ×8) and 48 (Wan 2.2 TI2V 5B, ×16); 4 frames per latent frame."""
    for channels, name, factor in ((16, "Wan21", 8), (48, "Wan22", 16)):
        wan = adapters.adapter_for("WanPipeline", factor)  # the pool's VAE factor (its `latent_scale` status)
        x = torch.randn(2, channels, 3, 6, 5)
        fmt = getattr(latent_formats, name)()
        assert wan.format_name(channels) == name
        assert wan.job_size(x) == {"height": 6 * factor, "width": 5 * factor, "num_frames": 9}
        assert torch.equal(wan.to_model(x), fmt.process_in(x))
        assert torch.equal(wan.to_comfy(x, 0, 0), fmt.process_out(x))
        assert torch.equal(wan.preview_latents(x[:1], 0, 0), x[:1, :, 1])
    with pytest.raises(adapters.ConditioningError, match="must be 5-D"):
        wan.job_size(torch.zeros(1, 16, 8, 8))
    with pytest.raises(adapters.ConditioningError, match="has 12 channels; expected 16 or 48"):
        wan.job_size(torch.zeros(1, 12, 2, 8, 8))


def test_conditioning_becomes_the_declared_tensor_inputs(adapters):
    cond = torch.randn(1, 5, 32)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    pixart = adapters.adapter_for("PixArtSigmaPipeline", 8)
    tensors, guidance = pixart.pipeline_inputs([[cond, {"attention_mask": mask}]], None, 2, {"prompt_embeds": 32})
    assert sorted(tensors) == ["prompt_attention_mask", "prompt_embeds"] and guidance is None
    assert torch.equal(tensors["prompt_attention_mask"], mask.expand(2, 5))
    flux = adapters.adapter_for("FluxPipeline", 8)
    extras = {"pooled_output": torch.randn(1, 16), "guidance": 2.5}
    widths = {f"{prefix}{name}": width for prefix in ("", "negative_")
              for name, width in (("prompt_embeds", 32), ("pooled_prompt_embeds", 16))}
    tensors, guidance = flux.pipeline_inputs([[cond, extras]], [[cond, extras]], 1, widths)
    assert sorted(tensors) == ["negative_pooled_prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                               "prompt_embeds"]
    assert flux.guidance_parameters(4.0, guidance, True) == (2.5, {"true_cfg_scale": 4.0})
    assert flux.guidance_parameters(1.0, None, False) == (3.5, {})
    assert pixart.guidance_parameters(4.0, None, True) == (4.0, {})
    with pytest.raises(adapters.ConditioningError, match="pooled_prompt_embeds is 8 wide but .* needs 16; .*DualCLIPLoader"):
        flux.pipeline_inputs([[cond, {"pooled_output": torch.randn(1, 8)}]], None, 1, widths)
    with pytest.raises(ValueError, match="no adapter for StableDiffusionPipeline"):
        adapters.adapter_for("StableDiffusionPipeline", 8)


def test_reference_latents_become_the_declared_image_input(adapters):
    """ReferenceLatent's VAE-space latents reach FluxKontextPipeline's `image` in model space, unpacked."""
    cond, reference = torch.randn(1, 5, 32), torch.randn(1, 16, 6, 10)
    extras = {"pooled_output": torch.randn(1, 16), "reference_latents": [reference]}
    kontext = adapters.adapter_for("FluxKontextPipeline", 8)
    tensors, _ = kontext.pipeline_inputs([[cond, extras]], [[cond, {"pooled_output": torch.randn(1, 16)}]], 2, {})
    assert torch.allclose(tensors["image"], ((reference - 0.1159) * 0.3611).expand(2, 16, 6, 10))
    without = kontext.pipeline_inputs([[cond, {"pooled_output": extras["pooled_output"]}]], None, 1, {})[0]
    assert "image" not in without  # no ReferenceLatent: the text alone, as ComfyUI's own Kontext
    flux = adapters.adapter_for("FluxPipeline", 8)  # declares no reference input: ReferenceLatent is not sent
    assert "image" not in flux.pipeline_inputs([[cond, extras]], None, 1, {})[0]
    with pytest.raises(adapters.ConditioningError, match="takes one reference image but the conditioning has 2"):
        kontext.pipeline_inputs([[cond, {**extras, "reference_latents": [reference, reference]}]], None, 1, {})


def test_wan21_i2v_takes_the_clip_vision_features_where_the_pool_lists_them(adapters):
    """WanImageToVideo's clip_vision_output becomes `image_embeds` (its penultimate hidden states) for a Wan 2.1
    I2V pool, whose status lists that width; a Wan 2.2 I2V pool (no such width) gets none; missing, one error."""
    import types

    cond, start = torch.randn(1, 5, 32), torch.randn(1, 16, 2, 4, 4)
    features = torch.randn(1, 257, 1280)
    extras = {"concat_latent_image": start, "clip_vision_output": types.SimpleNamespace(penultimate_hidden_states=features)}
    wan = adapters.adapter_for("WanImageToVideoPipeline", 8)
    widths = {"prompt_embeds": 32, "image_embeds": 1280}
    tensors, _ = wan.pipeline_inputs([[cond, extras]], None, 2, widths)
    assert torch.equal(tensors["image_embeds"], features) and tensors["image_latents"].shape == (2, 16, 2, 4, 4)
    assert "image_embeds" not in wan.pipeline_inputs([[cond, extras]], None, 1, {"prompt_embeds": 32})[0]
    with pytest.raises(adapters.ConditioningError, match="CLIPVisionEncode .* WanImageToVideo's clip_vision_output"):
        wan.pipeline_inputs([[cond, {"concat_latent_image": start}]], None, 1, widths)
    with pytest.raises(adapters.ConditioningError, match="image_embeds is 1024 wide but .* needs 1280"):
        wan.pipeline_inputs([[cond, {**extras, "clip_vision_output": types.SimpleNamespace(
            penultimate_hidden_states=torch.randn(1, 257, 1024))}]], None, 1, widths)


def test_hunyuan_video15_takes_comfyuis_own_encoders_conditioning(adapters):
    """ComfyUI 0.33's hunyuan_video_15 text encoder gives the LLM text as `cond` (with `attention_mask` only where it
    pads) and the byT5 glyph text as `conditioning_byt5small` (only for a prompt with quoted text): they become the
    pipeline's two text streams with their masks; a missing glyph stream is one masked token; widths are checked."""
    hv = adapters.adapter_for("HunyuanVideo15Pipeline", 16)
    widths = {f"{p}{n}": w for p in ("", "negative_") for n, w in (("prompt_embeds", 32), ("prompt_embeds_2", 16))}
    cond, glyphs = torch.randn(1, 7, 32), torch.randn(1, 5, 16)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    tensors, _ = hv.pipeline_inputs([[cond, {"attention_mask": mask, "conditioning_byt5small": glyphs}]],
                                    [[cond, {}]], 2, widths)
    assert torch.equal(tensors["prompt_embeds"], cond.expand(2, 7, 32))
    assert torch.equal(tensors["prompt_embeds_mask"], mask.expand(2, 7))
    assert torch.equal(tensors["prompt_embeds_2"], glyphs.expand(2, 5, 16))
    assert torch.equal(tensors["prompt_embeds_mask_2"], torch.ones(2, 5, dtype=torch.int64))
    assert torch.equal(tensors["negative_prompt_embeds_mask"], torch.ones(2, 7, dtype=torch.int64))
    assert tensors["negative_prompt_embeds_2"].shape == (2, 1, 16) and not tensors["negative_prompt_embeds_2"].any()
    assert not tensors["negative_prompt_embeds_mask_2"].any()
    with pytest.raises(adapters.ConditioningError, match="prompt_embeds_2 is 1472 wide but .* needs 16; .*hunyuan_video_15"):
        hv.pipeline_inputs([[cond, {"conditioning_byt5small": torch.randn(1, 5, 1472)}]], None, 1, widths)
    with pytest.raises(adapters.ConditioningError, match="prompt_embeds is 3584 wide but .* needs 32"):
        hv.pipeline_inputs([[torch.randn(1, 7, 3584), {}]], None, 1, widths)


def test_a_pipeline_without_a_text_mask_gets_the_valid_tokens(adapters):
    """Z-Image and FLUX.2 take no mask: a conditioning padded at its end (ComfyUI's encoders add `attention_mask`
    where they pad) reaches them as its valid tokens; padding other than at the end is one error."""
    for pipeline in ("ZImagePipeline", "Flux2KleinPipeline"):
        adapter = adapters.adapter_for(pipeline, 8 if pipeline == "ZImagePipeline" else 16)
        cond = torch.randn(1, 6, 32)
        tensors, _ = adapter.pipeline_inputs([[cond, {"attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}]], None, 1,
                                             {"prompt_embeds": 32})
        assert torch.equal(tensors["prompt_embeds"], cond[:, :4]) and set(tensors) == {"prompt_embeds"}
        with pytest.raises(adapters.ConditioningError, match="pads its prompts to different lengths, and .* takes no mask"):
            adapter.pipeline_inputs([[cond, {"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]])}]], None, 1, {})


def test_hunyuan_video15_image_to_video_takes_comfyuis_node_conditioning(adapters):
    """HunyuanVideo15ImageToVideo's start-image encoding (`concat_latent_image`, VAE space, zeros after the first
    frame, `concat_mask` 0 there) becomes `image_latents`; its optional clip_vision_output's last hidden states
    `image_embeds` (width checked); without a clip_vision_output none are sent; a second start frame is refused."""
    import types

    i2v = adapters.adapter_for("HunyuanVideo15ImageToVideoPipeline", 16)
    widths = {"prompt_embeds": 32, "image_embeds": 16}
    start = torch.zeros(1, 32, 3, 2, 2)
    start[:, :, 0] = torch.randn(1, 32, 2, 2)
    mask = torch.ones(1, 1, 3, 2, 2)
    mask[:, :, 0] = 0
    extras = {"concat_latent_image": start, "concat_mask": mask}
    tensors, _ = i2v.pipeline_inputs([[torch.randn(1, 7, 32), extras]], None, 2, widths)
    assert torch.equal(tensors["image_latents"], start.expand(2, -1, -1, -1, -1)) and "image_embeds" not in tensors
    vision = types.SimpleNamespace(last_hidden_state=torch.randn(1, 9, 16), penultimate_hidden_states=torch.randn(1, 9, 8))
    tensors, _ = i2v.pipeline_inputs([[torch.randn(1, 7, 32), {**extras, "clip_vision_output": vision}]], None, 1, widths)
    assert torch.equal(tensors["image_embeds"], vision.last_hidden_state)
    with pytest.raises(adapters.ConditioningError, match="image_embeds is 8 wide but .* needs 16"):
        i2v.pipeline_inputs([[torch.randn(1, 7, 32), {**extras, "clip_vision_output": types.SimpleNamespace(
            last_hidden_state=torch.randn(1, 9, 8))}]], None, 1, widths)
    with pytest.raises(adapters.ConditioningError, match="give HunyuanVideo15ImageToVideo a single start_image"):
        two = mask.clone()
        two[:, :, 1] = 0
        i2v.pipeline_inputs([[torch.randn(1, 7, 32), {**extras, "concat_mask": two}]], None, 1, widths)
    with pytest.raises(adapters.ConditioningError, match="through ComfyUI's HunyuanVideo15ImageToVideo node"):
        i2v.pipeline_inputs([[torch.randn(1, 7, 32), {}]], None, 1, widths)
