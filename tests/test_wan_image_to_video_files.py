"""Wan image-to-video from the files ComfyUI users keep, with the VAE file beside them (`--vae`).

Wan 2.2 I2V A14B as its two expert files (`wan2.2_i2v_{high,low}_noise_14B_*`) and Wan 2.1 I2V 14B as one file,
each with `wan_2.1_vae.safetensors`: tiny models of the real structure (Wan's head size 128, the Wan 2.1 VAE's
levels and blocks at a narrow width) written in Wan's own layouts (the VAE's names checked to convert back
with diffusers' own converter). The pipeline assembled from the files equals diffusers' single-process
pipeline they were written from (its scheduler set to the shipped one): through a served Ulysses-2 pool that
encodes the start image with the file's VAE, and decodes the result on both ranks equal to the same tiled
decode in one process (a single-file pool's xDiT VAE Decode); and, for Wan 2.1 I2V, through contract E with
the start image's CLIP vision features given (`image_embeds`, what ComfyUI's CLIPVisionEncode gives), since a
file pool has no image encoder, equal to diffusers computing them with its own. Another VAE's weights, or
another image's features, miss. Each wrong combination is one error naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.loading.pipelines import load_pipeline
from parallel.model_executor.vae_decode import fit_tiles

from original_layouts import original_layout, wan_vae_to_original
from pool_helpers import serving
from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun

FAMILY = "wan22-i2v"
SIZE, FRAMES = 64, 5
CALL = {"num_inference_steps": 3, "guidance_scale": tiny_models.MODELS[FAMILY].guidance, "height": SIZE,
        "width": SIZE, "num_frames": FRAMES}
HEADS = {"num_attention_heads": 2, "attention_head_dim": 128}  # Wan's head size is 128 in every released model
CLIP_WIDTH = 16


def _vae(seed: int) -> AutoencoderKLWan:
    """The Wan 2.1 VAE's levels, blocks and attention (the layout diffusers' converter knows) at width 8."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                temperal_downsample=[False, True, True]).eval()


def _transformer(like, seed: int, **changes) -> WanTransformer3DModel:
    config = {k: v for k, v in like.config.items() if not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel.from_config({**config, **HEADS, **changes}).eval()
    tiny_models._peak_attention(transformer, tiny_models.QK_SCALE)
    return transformer


def _clip_vision(seed: int):
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=CLIP_WIDTH, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_rescale=False)
    return processor, tiny_models._seeded(seed, CLIPVisionModel, config)


def _save(path, weights: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v_files")
    pipe = tiny_models.build_tiny_pipeline(FAMILY, seed=3)
    vae = _vae(5)
    experts = {"transformer": _transformer(pipe.transformer, 3), "transformer_2": _transformer(pipe.transformer, 6)}
    out = {"vae": root / "vae" / "wan_2.1_vae.safetensors", "other_vae": _vae(8)}
    _save(out["vae"], wan_vae_to_original(vae))
    for kind, name in (("high", "transformer"), ("low", "transformer_2")):
        out[kind] = root / "i2v" / f"wan2.2_i2v_{kind}_noise_14B_fp16.safetensors"
        _save(out[kind], original_layout("wan", experts[name]))
    out["a14b"] = WanImageToVideoPipeline(**{**pipe.components, **experts, "vae": vae},
                                          boundary_ratio=pipe.config.boundary_ratio)
    # Wan 2.1 I2V 14B: one transformer that also cross-attends to CLIP vision features of the start image
    transformer = _transformer(pipe.transformer, 4, image_dim=CLIP_WIDTH, added_kv_proj_dim=256)
    out["wan21"] = root / "wan2.1_i2v_720p_14B_fp16.safetensors"
    _save(out["wan21"], original_layout("wan", transformer))
    processor, encoder = _clip_vision(7)
    out["wan21_pipe"] = WanImageToVideoPipeline(**{**pipe.components, "transformer": transformer, "transformer_2": None,
                                                   "vae": vae, "image_processor": processor, "image_encoder": encoder})
    out["inputs"] = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE, num_frames=FRAMES)
    return out


def _reference(pipeline, files, shipped, **inputs) -> torch.Tensor:
    pipeline.scheduler = type(shipped).from_config(shipped.config)
    return diffusers_latents(pipeline, FAMILY, **inputs, **CALL)


def test_the_files_assemble_wan22_i2v_a14b(files):
    pipeline = load_pipeline(files["low"], vae=files["vae"], dtype="fp32")
    assert type(pipeline).__name__ == "WanImageToVideoPipeline"
    assert pipeline.config.boundary_ratio == 0.9 and pipeline.scheduler.config.flow_shift == 5.0
    written = files["a14b"].vae.state_dict()
    loaded = pipeline.vae.state_dict()
    assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written)
    assert pipeline.transformer.config.in_channels == 36 and pipeline.transformer_2 is not None


def test_wan22_i2v_files_on_a_pool_encode_and_decode_with_the_vae_file(files, tmp_path):
    inputs = files["inputs"]
    params = {"steps": CALL["num_inference_steps"], "guidance_scale": CALL["guidance_scale"], "height": SIZE,
              "width": SIZE, "call": {"num_frames": FRAMES}}
    with serving(files["high"], tmp_path, "--vae", str(files["vae"]), "--nproc", "2", "--ulysses-degree", "2",
                 "--dtype", "fp32") as client:
        assert client.status()["pipeline"] == "WanImageToVideoPipeline"
        latents = client.sample(inputs, params)
        clip = torch.randn((1, 16, 2, 16, 16), generator=torch.Generator().manual_seed(2))  # tiles of 8: 4 of them
        decoded, info = client.decode(clip)
    shipped = load_pipeline(files["high"], vae=files["vae"], dtype="fp32").scheduler
    expected = _reference(files["a14b"], files, shipped, **inputs)
    assert (latents - expected).abs().max().item() <= TOLERANCE
    other = WanImageToVideoPipeline(**{**files["a14b"].components, "vae": files["other_vae"]},
                                    boundary_ratio=files["a14b"].config.boundary_ratio)
    assert (latents - _reference(other, files, shipped, **inputs)).abs().max().item() > 10 * TOLERANCE  # the VAE is used
    vae = files["a14b"].vae
    fit_tiles(vae, clip, 2)
    with torch.no_grad():
        tiled = vae.tiled_decode(clip, return_dict=False)[0]
    assert (decoded - tiled).abs().max().item() <= TOLERANCE and min(r["tiles"] for r in info["ranks"]) >= 1


def test_wan21_i2v_file_takes_the_clip_vision_features(files, tmp_path):
    reference_pipe = files["wan21_pipe"]
    image = files["inputs"]["image"]
    with torch.no_grad():
        embeds = reference_pipe.encode_image(image, torch.device("cpu"))
        other_embeds = reference_pipe.encode_image(1 - image, torch.device("cpu"))
    inputs = {k: v for k, v in files["inputs"].items()}
    path = tmp_path / "in.safetensors"
    save_file({**inputs, "image_embeds": embeds.contiguous()}, path)
    output = tmp_path / "out.safetensors"
    run = torchrun(2, "-m", "parallel.run", "--model", str(files["wan21"]), "--vae", str(files["vae"]),
                   "--inputs", str(path), "--output", str(output), "--dtype", "fp32",
                   "--steps", str(CALL["num_inference_steps"]), "--guidance-scale", str(CALL["guidance_scale"]),
                   "--height", str(SIZE), "--width", str(SIZE), "--num-frames", str(FRAMES), "--ulysses-degree", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    got = load_file(output)["latents"]
    shipped = load_pipeline(files["wan21"], vae=files["vae"], dtype="fp32").scheduler
    assert (got - _reference(reference_pipe, files, shipped, **inputs)).abs().max().item() <= TOLERANCE
    reference_pipe.encode_image = lambda *args: other_embeds
    try:
        assert (got - _reference(reference_pipe, files, shipped, **inputs)).abs().max().item() > 10 * TOLERANCE
    finally:
        del reference_pipe.encode_image

    no_features = tmp_path / "no_features.safetensors"
    save_file(inputs, no_features)
    run = torchrun(1, "-m", "parallel.run", "--model", str(files["wan21"]), "--vae", str(files["vae"]),
                   "--inputs", str(no_features), "--output", str(output), "--steps", "1", "--height", str(SIZE),
                   "--width", str(SIZE), "--num-frames", str(FRAMES))
    assert run.returncode != 0
    assert "cross-attends to the start image's CLIP vision features: send `image_embeds`" in run.stderr
    assert "Traceback" not in run.stderr


def test_each_wrong_combination_is_one_error_naming_the_fix(files, tmp_path):
    """The files load without their VAE (a pool serving model calls needs none); sampling is then one error."""
    assert load_pipeline(files["high"]).vae is None
    inputs = tmp_path / "in.safetensors"
    save_file(files["inputs"], inputs)
    run = torchrun(1, "-m", "parallel.run", "--model", str(files["high"]), "--inputs", str(inputs), "--output",
                   str(tmp_path / "out.safetensors"), "--steps", "1", "--height", str(SIZE), "--width", str(SIZE),
                   "--num-frames", str(FRAMES))
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert ("needs its VAE file beside it to sample (its pipeline encodes the start image with it): choose the Wan "
            "2.1 VAE (wan_2.1_vae.safetensors) as the pool's vae (--vae FILE") in run.stderr, run.stderr[-2000:]
    with pytest.raises(ValueError, match="is not a Wan 2.1 VAE .* file .* takes the Wan 2.1 VAE"):
        load_pipeline(files["high"], vae=files["wan21"])
    alone = tmp_path / "wan22_i2v_expert.safetensors"
    alone.write_bytes(files["high"].read_bytes())
    with pytest.raises(ValueError, match="is one expert of Wan 2.2 I2V A14B, but its name does not say which"):
        load_pipeline(alone, vae=files["vae"])
    with pytest.raises(ValueError, match="pipeline folder with its own VAE: drop --vae"):
        load_pipeline(tmp_path, vae=files["vae"])
    wide = tmp_path / "wan2.2_vae.safetensors"
    weights = wan_vae_to_original(_vae(5))
    weights["conv2.weight"] = torch.zeros(48, 48, 1, 1, 1)
    save_file(weights, wide)
    with pytest.raises(ValueError, match="48 latent channels .* only the Wan 2.1 VAE"):
        load_pipeline(files["high"], vae=wide)
