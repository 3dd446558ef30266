"""FLUX.2 [klein] from the files ComfyUI users keep: the transformer in BFL's layout (`flux-2-klein-4b.safetensors`,
`flux-2-klein-base-4b.safetensors`; as scaled fp8 and Q8_0 GGUF too) with the FLUX.2 VAE file beside it
(`--vae flux2-vae.safetensors`), whose batch-norm statistics the pipeline denormalises its latents with.

A tiny [klein] of the real structure (head size 128 over four rotary axes of 32; a VAE of four levels with 32
norm groups and random batch-norm statistics) is written in BFL's layouts, each checked to convert back exactly
(the transformer with diffusers' own converter). Detection reads every size from the shapes and the
distillation from the name; the files give the pipeline they were written from, and sample equal to it
(its scheduler set to the shipped one): in one process, through contract E on Ulysses 2 with CFG parallel
(the base model), and from the quantized files equal to the weights they mean. Another VAE's statistics
miss; the transformer without its VAE is one error naming it.
"""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.loading.checkpoints import CheckpointFile, detect_checkpoint
from parallel.loading.pipelines import load_pipeline

from original_layouts import flux2_to_bfl, flux2_vae_to_original
from quantized_files import fp8_scaled, gguf_file
from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun

FAMILY, SIZE = "flux2-klein", 64
CALL = {"num_inference_steps": 3, "guidance_scale": 4.0, "height": SIZE, "width": SIZE}


def _vae(seed: int) -> AutoencoderKLFlux2:
    vae = tiny_models._seeded(seed, AutoencoderKLFlux2, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
                              latent_channels=32, norm_num_groups=32)
    generator = torch.Generator().manual_seed(seed)
    vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=generator))
    vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=generator) + 0.5)
    return vae.eval()


def _real_heads(pipe) -> Flux2Transformer2DModel:
    """The tiny transformer with FLUX.2's head size, 128 over four rotary axes of 32 (the reader assumes it)."""
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        transformer = Flux2Transformer2DModel.from_config({**config, "num_attention_heads": 2, "attention_head_dim": 128,
                                                           "axes_dims_rope": (32, 32, 32, 32)}).eval()
    return tiny_models._peak_attention(transformer, tiny_models.QK_SCALE)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2_files")
    pipe = tiny_models.build_tiny_pipeline(FAMILY, seed=3)
    transformer = _real_heads(pipe)
    out = {"vae": root / "vae" / "flux2-vae.safetensors", "base": root / "flux-2-klein-base-4b.safetensors",
           "distilled": root / "flux-2-klein-4b.safetensors", "other_vae": _vae(8)}
    out["vae"].parent.mkdir()
    save_file(flux2_vae_to_original(_vae(5)), out["vae"])
    weights = flux2_to_bfl(transformer.state_dict(), transformer.config)
    for name in ("base", "distilled"):
        save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in weights.items()}, out[name])  # Comfy-Org's prefix
    out["pipe"] = Flux2KleinPipeline(scheduler=pipe.scheduler, vae=_vae(5), text_encoder=None, tokenizer=None,
                                     transformer=transformer)
    out["inputs"] = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE, negative=True)
    return out


def _reference(files, shipped, vae=None, **changes) -> torch.Tensor:
    pipe = Flux2KleinPipeline(**{**files["pipe"].components, "scheduler": type(shipped).from_config(shipped.config),
                                 **({"vae": vae} if vae is not None else {})})
    return diffusers_latents(pipe, FAMILY, **files["inputs"], **{**CALL, **changes})


def test_detection_reads_the_sizes_and_the_name(files):
    written = files["pipe"].transformer.config
    for name, variant in (("base", "flux2-klein-base"), ("distilled", "flux2-klein")):
        detected = detect_checkpoint(files[name])
        assert detected.variant == variant
        for key, value in detected.overrides.items():
            expected = written[key]
            assert value == (list(expected) if isinstance(expected, tuple) else expected), key


def test_the_files_equal_the_pipeline_they_came_from(files):
    base = load_pipeline(files["base"], vae=files["vae"], dtype="fp32")
    assert type(base).__name__ == "Flux2KleinPipeline" and base.config.is_distilled is False
    written, loaded = files["pipe"].vae.state_dict(), base.vae.state_dict()
    assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written)
    got = diffusers_latents(base, FAMILY, **files["inputs"], **CALL)
    assert (got - _reference(files, base.scheduler)).abs().max().item() <= TOLERANCE
    assert (got - _reference(files, base.scheduler, vae=files["other_vae"])).abs().max().item() > 10 * TOLERANCE
    distilled = load_pipeline(files["distilled"], vae=files["vae"], dtype="fp32")
    assert distilled.config.is_distilled is True


@pytest.mark.parametrize("kind", ["fp8_scaled", "gguf_q8_0"])
def test_quantized_files_equal_the_weights_they_mean(comfyui_install, files, tmp_path, kind):
    """The quantized file through the engine's loader equals diffusers' pipeline around a transformer read from the
    same file without it (tests/independent_readers.py: ComfyUI's own fp8 dequantization, the gguf package's reader
    with Q8_0 in fp16 as diffusers' GGUF layers compute it, diffusers' own FLUX.2 converter)."""
    from independent_readers import flux2_transformer

    from parallel.loading.checkpoints.fp8 import storage_of

    weights = CheckpointFile(files["base"]).state_dict()
    quantized = tmp_path / ("flux-2-klein-base-4b-Q8_0.gguf" if kind == "gguf_q8_0" else "flux-2-klein-base-4b-fp8.safetensors")
    if kind == "gguf_q8_0":
        gguf_file(weights, quantized, "flux")
    else:
        save_file(fp8_scaled(weights, per_layer=False)[0], quantized)
    pipe = load_pipeline(quantized, vae=files["vae"], dtype="fp32")
    assert {"Q8_0", "float8_e4m3fn"} & storage_of(pipe.transformer).keys()
    read = flux2_transformer(comfyui_install, quantized, "gguf-Q8_0-fp16" if kind == "gguf_q8_0" else "fp8",
                             dict(pipe.transformer.config), tmp_path)
    plain = type(pipe)(**{**pipe.components, "transformer": read})
    got = diffusers_latents(pipe, FAMILY, **files["inputs"], **CALL)
    assert (got - diffusers_latents(plain, FAMILY, **files["inputs"], **CALL)).abs().max().item() <= TOLERANCE
    assert (got - _reference(files, pipe.scheduler)).abs().max().item() > TOLERANCE  # the quantization is real


def test_contract_e_with_cfg_parallel_equals_diffusers(files, tmp_path):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(files["inputs"], inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(files["base"]), "--vae", str(files["vae"]), "--inputs",
                   str(inputs), "--output", str(output), "--dtype", "fp32", "--steps", str(CALL["num_inference_steps"]),
                   "--guidance-scale", str(CALL["guidance_scale"]), "--height", str(SIZE), "--width", str(SIZE),
                   "--cfg-parallel")
    assert run.returncode == 0, run.stderr[-3000:]
    shipped = load_pipeline(files["base"], vae=files["vae"], dtype="fp32").scheduler
    assert (load_file(output)["latents"] - _reference(files, shipped)).abs().max().item() <= TOLERANCE


def test_a_flux2_dev_file_needs_no_vae(tmp_path):
    """FLUX.2 [dev] (told by its guidance embedder) returns packed latents, no VAE involved: its file alone loads
    and equals the pipeline it came from."""
    pipe = tiny_models.build_tiny_pipeline("flux2-dev", seed=3)
    transformer = _real_heads(pipe)
    path = tmp_path / "flux2-dev.safetensors"
    save_file({k: v.contiguous() for k, v in flux2_to_bfl(transformer.state_dict(), transformer.config).items()}, path)
    assert detect_checkpoint(path).variant == "flux2-dev"
    loaded = load_pipeline(path, dtype="fp32")
    assert type(loaded).__name__ == "Flux2Pipeline" and loaded.vae is None
    written = type(pipe)(**{**pipe.components, "transformer": transformer, "scheduler": loaded.scheduler})
    inputs = tiny_models.make_inputs("flux2-dev", height=SIZE, width=SIZE)
    call = {**CALL, "guidance_scale": 2.5}
    got = diffusers_latents(loaded, "flux2-dev", **inputs, **call)
    assert got.shape == (1, (SIZE // 16) ** 2, 128)
    assert (got - diffusers_latents(written, "flux2-dev", **inputs, **call)).abs().max().item() <= TOLERANCE
    other_guidance = diffusers_latents(loaded, "flux2-dev", **inputs, **{**call, "guidance_scale": 4.0})
    assert (got - other_guidance).abs().max().item() > 10 * TOLERANCE  # the guidance embedder is loaded and used


def test_without_its_vae_it_loads_for_model_calls_and_sampling_names_the_file(files, tmp_path):
    from parallel.loading.checkpoints.load import missing_vae

    alone = load_pipeline(files["base"])
    assert alone.vae is None and alone.transformer is not None
    assert re.search(r"is FLUX.2 \[klein\] base, which needs its VAE file beside it to sample \(.*batch-norm "
                     r"statistics\): choose the FLUX.2 VAE \(flux2-vae.safetensors\) as the pool's vae", missing_vae(alone))
    assert missing_vae(load_pipeline(files["base"], vae=files["vae"])) is None
    wan_like = tmp_path / "wan_2.1_vae.safetensors"
    save_file({"conv2.weight": torch.zeros(16, 16, 1, 1, 1)}, wan_like)
    with pytest.raises(ValueError, match="is not a FLUX.2 VAE .* file"):
        load_pipeline(files["base"], vae=wan_like)
