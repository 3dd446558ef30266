"""LTX-2.3 whole checkpoints kept quantized on the ranks: ComfyUI's scaled fp8 (`scaled_fp8` marker, per-tensor
`scale_weight`) and city96's GGUF Q8_0 of a tiny LTX-2.3 in Lightricks' layout — its transformer and text connectors
written by ComfyUI's own LTXAVModel under `model.diffusion_model.` (tests/ltx2_comfy_files.py's widths), the
text projections (`text_embedding_projection.*_aggregate_embed`, over Gemma 3's 49 stacked states of 32) and the VAEs'
latent statistics beside it as the official checkpoint keeps them — both files in one torchrun launch on Ulysses 2 in
fp32 compute (tests/engine_cases.py: the engine's loader and layout, as contract E runs them).

Each file's video and audio latents equal diffusers' own single-process LTX2Pipeline (17 frames at 96×160, 3 steps,
every guidance term) around a transformer diffusers itself loads (`from_single_file`, its converter; diffusers 0.42.1
leaves LTX-2.3's `prompt_adaln_single` unrenamed, so the reference renames it as the loader test does) and text
connectors loaded by the names tests/test_comfyui_loader_ltx2.py checks against ComfyUI's own model, from the weights
the file means: stored · scale for fp8 (tests/quantized_files.py), for Q8_0 as diffusers' GGUF layers compute them.
Every rank holds the transformer's layers quantized (float8_e4m3fn, Q8_0), its bytes reported ÷ the fp32 ones.
Negative control: the unquantized weights' result misses each by far more than the tolerance, so a loader that dropped
the scales or the quantization would fail.

The whole checkpoint with its decoders written by ComfyUI 0.33's own classes at tiny widths — VideoVAE (4-stage
encoder, and a decoder of LTX-2.3's four stages of mixed kinds, its config in the file's metadata as Lightricks ships
it) under `vae.`, CausalAudioAutoencoder under `audio_vae.`, VocoderWithBWE under `vocoder.` — serves a 2-rank pool.
Its video decode equals diffusers' own tiled decode (`AutoencoderKLLTX2Video.decode`, the same tiles) of the VAE
diffusers' converter loads (its fourth stage named as diffusers' LTX-2.3 conversion names it), whose untiled decode
equals ComfyUI's own decoder; control: that tiled decode with one rank's tiles dropped misses. Its audio decode equals
ComfyUI's AudioVAE chain (CausalAudioAutoencoder, then VocoderWithBWE) and ComfyUI's vocoder on the mel of diffusers'
converter-loaded AutoencoderKLLTX2Audio (diffusers has no vocoder converter: ComfyUI's own model checks our names);
control: the vocoder without its bandwidth extension misses.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantized_files import fp8_scaled, gguf_file
from ltx2_comfy_files import AUDIO_HEAD, AUDIO_WIDTH, CONFIG, HEAD, HEADS, VIDEO_WIDTH
from xdit_test_helpers import TOLERANCE, case_errors, run_engine_cases

PREFIX, CAPTION, STACKED, TOKENS, REGISTERS = "model.diffusion_model.", 32, 49, 256, 128  # ComfyUI's 128 registers
FRAMES, HEIGHT, WIDTH, RATE = 17, 96, 160, 25.0
CALL = {"num_inference_steps": 3, "guidance_scale": 4.0, "height": HEIGHT, "width": WIDTH, "frame_rate": RATE,
        "stg_block": 1}
STORAGE = {"fp8": "float8_e4m3fn", "gguf": "Q8_0"}
WRITE = """
import json, sys
path, config = sys.argv[1:3]
sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import torch, comfy.ops
from safetensors.torch import save_file
from comfy.ldm.lightricks.av_model import LTXAVModel
model = LTXAVModel(**json.loads(config), operations=comfy.ops.disable_weight_init, device="meta")
generator = torch.Generator().manual_seed(0)
save_file({"model.diffusion_model." + k: torch.randn(v.shape, generator=generator) * 0.2
           for k, v in model.state_dict().items()}, path)
"""


VIDEO_VAE = {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
             "encoder_base_channels": 128, "decoder_base_channels": 8, "norm_layer": "pixel_norm",
             "latent_log_var": "uniform", "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
             "encoder_blocks": [["res_x", {"num_layers": 0}], ["compress_space_res", {"multiplier": 2}],
                                ["res_x", {"num_layers": 0}], ["compress_time_res", {"multiplier": 2}],
                                ["res_x", {"num_layers": 0}], ["compress_all_res", {"multiplier": 2}],
                                ["res_x", {"num_layers": 0}], ["compress_all_res", {"multiplier": 2}],
                                ["res_x", {"num_layers": 0}]],
             "spatial_padding_mode": "zeros",  # LTX-2.3's decoder: four stages, mixed kinds, its own padding
             "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                                ["compress_space", {"residual": False, "multiplier": 2}],
                                ["res_x", {"num_layers": 2, "inject_noise": False}],
                                ["compress_time", {"residual": False, "multiplier": 1}],
                                ["res_x", {"num_layers": 1, "inject_noise": False}],
                                ["compress_all", {"residual": True, "multiplier": 2}],
                                ["res_x", {"num_layers": 1, "inject_noise": False}],
                                ["compress_all", {"residual": False, "multiplier": 2}],
                                ["res_x", {"num_layers": 1, "inject_noise": False}]]}
AUDIO_VAE = {"model": {"params": {"sampling_rate": 16000, "ddconfig": {
    "double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False, "in_channels": 2,
    "out_ch": 2, "ch": 128, "ch_mult": [1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0,
    "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}}},
    "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}}}  # 128 wide: the statistics' width
VOCODER = {"resblock_kernel_sizes": [3, 5], "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5]], "stereo": True,
           "resblock": "AMP1", "activation": "snakebeta", "use_bias_at_final": False, "apply_final_activation": False,
           "upsample_rates": [5, 2, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4], "upsample_initial_channel": 128}
BWE = {**VOCODER, "upsample_rates": [6, 5, 2, 2, 2], "upsample_kernel_sizes": [12, 11, 4, 4, 4], "upsample_initial_channel": 64,
       "input_sampling_rate": 16000, "output_sampling_rate": 48000, "hop_length": 80, "n_fft": 512, "num_mels": 64}
COMFY = """
import json, sys
args, sys.argv = sys.argv[1:], sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import torch
from safetensors.torch import load_file, save_file
from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
from comfy.ldm.lightricks.vae.causal_audio_autoencoder import CausalAudioAutoencoder
from comfy.ldm.lightricks.vocoders.vocoder import VocoderWithBWE
"""
WRITE_VAE = COMFY + """
path, config, audio, vocoder = args
generator = torch.Generator().manual_seed(5)
weights = {}
for prefix, model in (("vae.", VideoVAE(config=json.loads(config))), ("audio_vae.", CausalAudioAutoencoder(json.loads(audio))),
                      ("vocoder.", VocoderWithBWE(json.loads(vocoder)))):
    for k, v in model.state_dict().items():  # the vocoder's filters and mel bases as ComfyUI makes them
        if "per_channel_statistics" not in k:
            fixed = k.endswith("filter") or "mel_stft" in k
            scale = 0.1 if prefix != "vocoder." else 0.5 / (v.shape[1] * v.shape[2]) ** 0.5 if v.ndim == 3 else 0.01
            weights[prefix + k] = v.clone() if fixed else torch.randn(v.shape, generator=generator) * scale
save_file(weights, path)
"""
RUN_AUDIO = COMFY + """
path, video_config, audio, vocoder, inputs, output = args
weights, given = load_file(path), load_file(inputs)
autoencoder, bwe = CausalAudioAutoencoder(json.loads(audio)).eval(), VocoderWithBWE(json.loads(vocoder)).eval()
for prefix, model in (("audio_vae.", autoencoder), ("vocoder.", bwe)):
    missing, unexpected = model.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)},
                                                strict=False)
    assert not unexpected and all("per_channel_statistics" in k for k in missing), (missing, unexpected)
video = VideoVAE(config=json.loads(video_config)).eval()
missing, unexpected = video.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("vae.")}, strict=False)
assert not unexpected and all("per_channel_statistics" in k for k in missing), (missing, unexpected)
latents = given["latents"]
with torch.no_grad():
    frames = video.decoder(given["video"])  # the VAE's own space: no un-normalising
    mel = autoencoder.decode(latents, target_shape=(1, 2, latents.shape[2] * 4 - 3, 64))
    low = bwe.vocoder(given["mel"].transpose(2, 3))
    samples = low.shape[-1] * bwe.output_sample_rate // bwe.input_sample_rate
    save_file({"frames": frames, "waveform": bwe(given["mel"].transpose(2, 3)), "whole": bwe(mel.transpose(2, 3)),
               "without_bwe": torch.clamp(bwe.resampler(low), -1, 1)[..., :samples]}, output)
"""


def _whole_checkpoint(python, comfyui, work) -> dict:
    """ComfyUI's LTXAVModel's state dict (random) with the official checkpoint's top-level text projections and VAE
    statistics beside it."""
    subprocess.run([str(python), "-c", WRITE, str(work / "dit.safetensors"), json.dumps(CONFIG)], cwd=comfyui,
                   check=True, capture_output=True)
    gen = torch.Generator().manual_seed(3)
    weights = load_file(work / "dit.safetensors")
    for side, width in (("video", VIDEO_WIDTH), ("audio", AUDIO_WIDTH)):
        weights[f"text_embedding_projection.{side}_aggregate_embed.weight"] = torch.randn(
            width, CAPTION * STACKED, generator=gen) / (CAPTION * STACKED) ** 0.5
    for vae in ("vae", "audio_vae"):
        weights[f"{vae}.per_channel_statistics.mean-of-means"] = torch.randn(128, generator=gen) * 0.5
        weights[f"{vae}.per_channel_statistics.std-of-means"] = torch.rand(128, generator=gen) + 0.5
    return weights


def _inputs() -> dict:
    """17 frames at 96×160 (3 latent frames of 3×5), 17 audio frames of 8 channels × 16 mel bins, 256 text tokens
    of Gemma-style stacked states, left-padded (the negative more)."""
    gen = torch.Generator().manual_seed(4)
    out = {"latents": torch.randn(1, 128, 3, HEIGHT // 32, WIDTH // 32, generator=gen),
           "audio_latents": torch.randn(1, 8, 17, 16, generator=gen)}
    for prefix, padding in (("", 200), ("negative_", 230)):
        out[prefix + "prompt_embeds"] = torch.randn(1, TOKENS, CAPTION * STACKED, generator=gen)
        out[prefix + "prompt_attention_mask"] = (torch.arange(TOKENS) >= padding).long()[None]
    return out


@pytest.fixture(scope="module")
def files(comfyui_install, tmp_path_factory):
    """The fp8 and Q8_0 copies of the whole checkpoint, each one's meant weights, the plain ones, and the inputs."""
    comfyui, python = comfyui_install
    root = tmp_path_factory.mktemp("ltx2files")
    plain = _whole_checkpoint(python, comfyui, root)
    dit = {k: v for k, v in plain.items() if k.startswith(PREFIX)}
    top = {k: v for k, v in plain.items() if not k.startswith(PREFIX)}
    stored, meant = fp8_scaled(dit, per_layer=False)
    save_file({**stored, **top}, root / "ltx-2.3-tiny-fp8_scaled.safetensors")
    # city96's names: the transformer's unprefixed (GGUF names are short), the rest as in the whole checkpoint
    quantized = gguf_file({k.removeprefix(PREFIX): v for k, v in plain.items()}, root / "ltx-2.3-tiny-Q8_0.gguf",
                          "ltxv", as_diffusers=True)
    quantized = {(PREFIX + k if PREFIX + k in plain else k): v for k, v in quantized.items()}
    save_file(_inputs(), root / "in.safetensors")
    return {"paths": {"fp8": root / "ltx-2.3-tiny-fp8_scaled.safetensors", "gguf": root / "ltx-2.3-tiny-Q8_0.gguf"},
            "meant": {"fp8": {**{k: v for k, v in meant.items() if k != PREFIX + "scaled_fp8"}, **top},
                      "gguf": quantized, "plain": plain},
            "inputs": root / "in.safetensors", "root": root, "python": python, "comfyui": comfyui}


def _connectors(weights: dict):
    """diffusers' LTX2TextConnectors at the file's sizes, by the names test_comfyui_loader_ltx2 checks."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    connectors = LTX2TextConnectors(
        caption_channels=CAPTION, text_proj_in_factor=STACKED, video_connector_num_attention_heads=HEADS,
        video_connector_attention_head_dim=HEAD, video_connector_num_layers=1,
        video_connector_num_learnable_registers=REGISTERS, audio_connector_num_attention_heads=HEADS,
        audio_connector_attention_head_dim=AUDIO_HEAD, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=REGISTERS, rope_type="split", per_modality_projections=True,
        video_hidden_dim=VIDEO_WIDTH, audio_hidden_dim=AUDIO_WIDTH, video_gated_attn=True, audio_gated_attn=True)
    renamed = {f"{side}_text_proj_in.weight": weights[f"text_embedding_projection.{side}_aggregate_embed.weight"]
               for side in ("video", "audio")}
    for name, value in weights.items():
        for side in ("video", "audio"):
            prefix = f"{PREFIX}{side}_embeddings_connector."
            if name.startswith(prefix):
                rest = name[len(prefix):].replace("transformer_1d_blocks", "transformer_blocks")
                renamed[f"{side}_connector." + rest.replace("q_norm", "norm_q").replace("k_norm", "norm_k")] = value
    connectors.load_state_dict(renamed, strict=True)
    return connectors.eval()


def diffusers_result(weights: dict, inputs: dict, work) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' LTX2Pipeline, one process, fp32: its transformer by diffusers' own single-file loader from
    `weights`, the VAEs' statistics from them."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline,
                           LTX2VideoTransformer3DModel)

    (work / "config").mkdir(exist_ok=True)
    LTX2VideoTransformer3DModel.from_config(dict(
        num_attention_heads=HEADS, attention_head_dim=HEAD, in_channels=128, out_channels=128,
        cross_attention_dim=VIDEO_WIDTH, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=HEADS,
        audio_attention_head_dim=AUDIO_HEAD, audio_cross_attention_dim=AUDIO_WIDTH, num_layers=2, rope_type="split",
        gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
        use_prompt_embeddings=False, perturbed_attn=True)).save_config(work / "config")
    dit = {k.replace("prompt_adaln_single", "prompt_adaln"): v.contiguous() for k, v in weights.items()
           if k.startswith(PREFIX) and "embeddings_connector" not in k}
    save_file(dit, work / "weights.safetensors")
    transformer = LTX2VideoTransformer3DModel.from_single_file(
        str(work / "weights.safetensors"), config=str(work / "config"), local_files_only=True, torch_dtype=torch.float32)
    # small VAEs of the shipped ones' latent layout (never decoding here): ×32 / ×8, 128 channels; 8 × 64 mel bins
    vae = AutoencoderKLLTX2Video(block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
                                 layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                                 spatio_temporal_scaling=(True, True, True, False), upsample_factor=(1, 1, 1))
    audio_vae = AutoencoderKLLTX2Audio(ch_mult=(1,), num_res_blocks=1)
    assert (vae.spatial_compression_ratio, vae.temporal_compression_ratio, audio_vae.config.mel_bins) == (32, 8, 64)
    for model, name in ((vae, "vae"), (audio_vae, "audio_vae")):
        model.latents_mean.copy_(weights[f"{name}.per_channel_statistics.mean-of-means"])
        model.latents_std.copy_(weights[f"{name}.per_channel_statistics.std-of-means"])
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    pipeline = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
                            connectors=_connectors(weights), transformer=transformer, vocoder=None)
    call = {**CALL, "spatio_temporal_guidance_blocks": [CALL["stg_block"]]}
    del call["stg_block"]
    with torch.no_grad():
        video, audio = pipeline(**inputs, **call, output_type="latent", return_dict=False)
    return video, audio


@pytest.fixture(scope="module")
def runs(files):
    """Both files in one launch of 2 ranks, Ulysses 2, fp32 compute: {kind: (outputs, each rank's storage)}."""
    root, specs = files["root"], []
    for kind, path in files["paths"].items():
        specs.append({"name": kind, "model": str(path), "inputs": str(files["inputs"]), "dtype": "fp32",
                      "output": str(root / f"out-{kind}.safetensors"), "layout": {"ulysses_degree": 2}, "call": CALL,
                      "report_storage": True})
    run_engine_cases(2, specs, root)
    out = {}
    for spec in specs:
        errors = case_errors(spec["output"])
        assert not errors, errors[-3000:]
        out[spec["name"]] = (load_file(spec["output"]), json.loads(open(spec["output"] + ".storage.json").read()))
    return out


@pytest.fixture(scope="module")
def references(files, tmp_path_factory):
    inputs = load_file(files["inputs"])
    return {kind: diffusers_result(weights, inputs, tmp_path_factory.mktemp(kind))
            for kind, weights in files["meant"].items()}


@pytest.mark.parametrize("kind", list(STORAGE))
def test_a_quantized_ltx2_checkpoint_on_ulysses_2_equals_diffusers_on_the_weights_it_means(files, runs, references,
                                                                                           kind):
    output, storage = runs[kind]
    want_video, want_audio = references[kind]
    errors = [(output["latents"] - want_video).abs().max().item(), (output["audio"] - want_audio).abs().max().item()]
    plain_video, plain_audio = references["plain"]  # negative control: the unquantized weights' result
    misses = [(output["latents"] - plain_video).abs().max().item(), (output["audio"] - plain_audio).abs().max().item()]
    fp32 = sum(v.numel() * 4 for k, v in files["meant"]["plain"].items()
               if k.startswith(PREFIX) and "embeddings_connector" not in k)
    ratios = [sum(rank.values()) / fp32 for rank in storage]
    print(f"{kind}: errors {errors}, control misses {misses}, per-rank bytes / fp32 {ratios}")
    assert max(errors) <= TOLERANCE, errors
    assert min(misses) > 10 * TOLERANCE, misses
    assert len(storage) == 2 and all(STORAGE[kind] in rank for rank in storage), storage
    assert all(ratio <= 0.55 for ratio in ratios), ratios


def test_the_marker_is_diffusers_own_and_a_diffusion_model_files_pool_refuses_pipeline_jobs_in_one_line(files):
    """ComfyUI's diffusion-model file (the transformer and connectors alone; ComfyUI's text encoder holds the text
    projections) loads for model calls, its projections absent (None, nothing random in their place); a pipeline job,
    whose Gemma states would need them, is refused at submit in one line naming the missing projection and the fix."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    from parallel.families.ltx2.file import MARKER
    from parallel.layout.config import ParallelConfig
    from parallel.loading.pipelines import load_pipeline
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper
    from xdit_test_helpers import one_rank

    assert PREFIX + MARKER == CHECKPOINT_KEY_NAMES["ltx2"][0]
    pipeline = load_pipeline(files["root"] / "dit.safetensors", dtype="fp32")
    connectors = pipeline.connectors
    assert connectors.video_text_proj_in is None and connectors.audio_text_proj_in is None
    assert pipeline.vae is None and pipeline.audio_vae is None
    inputs = load_file(files["inputs"])
    with one_rank(ParallelConfig()):
        wrapper = xFuserPipelineBaseWrapper.wrap(pipeline)
        with pytest.raises(ValueError) as error:
            wrapper.prepare({**CALL, **inputs})
        wrapper.unwrap()
    message = str(error.value)
    print(message)
    assert "\n" not in message and "no text projection" in message and "whole checkpoint" in message, message
    assert "ComfyUI's own text encoder" in message, message


def test_a_decode_job_on_the_checkpoints_statistics_only_vae_is_refused_in_one_line(files):
    """A file holding the VAEs' statistics alone (the pipeline normalises latents with them): rank 0 refuses a video or
    audio decode at submit, naming ComfyUI's VAE Decode, instead of failing on the ranks without weights."""
    from types import SimpleNamespace

    from parallel.layout.config import ParallelConfig
    from parallel.loading.pipelines import load_pipeline
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper
    from workers.rank.validation import Validator
    from xdit_test_helpers import one_rank

    pipeline = load_pipeline(files["paths"]["fp8"], dtype="fp32")
    assert pipeline.vae.latents_mean.abs().sum() > 0 and not list(pipeline.vae.parameters())
    rank = SimpleNamespace(state="idle", pipeline=SimpleNamespace(module=pipeline))
    decode = SimpleNamespace(type="decode", tensors={"latents": torch.randn(1, 128, 3, 3, 5)})
    with pytest.raises(ValueError) as error:
        Validator(rank)(decode)
    assert "\n" not in str(error.value) and "ComfyUI's VAE Decode" in str(error.value), error.value
    with one_rank(ParallelConfig()):  # its sound likewise: no audio VAE weights, no vocoder
        wrapper = xFuserPipelineBaseWrapper.wrap(pipeline)
        with pytest.raises(ValueError) as error:
            Validator(SimpleNamespace(state="idle", pipeline=wrapper))(
                SimpleNamespace(type="decode", tensors={"audio": torch.randn(1, 8, 17, 16)}))
        wrapper.unwrap()
    assert "\n" not in str(error.value) and "ComfyUI's VAE Decode (Audio)" in str(error.value), error.value


@pytest.fixture(scope="module")
def with_vae(files):
    """The whole checkpoint with ComfyUI's VideoVAE, CausalAudioAutoencoder and VocoderWithBWE under `vae.`,
    `audio_vae.` and `vocoder.`, beside the VAEs' statistics."""
    root = files["root"]
    subprocess.run([str(files["python"]), "-c", WRITE_VAE, str(root / "vae.safetensors"), json.dumps(VIDEO_VAE),
                    json.dumps(AUDIO_VAE), json.dumps({"vocoder": VOCODER, "bwe": BWE})],
                   cwd=files["comfyui"], check=True, capture_output=True)
    path = root / "ltx-2.3-tiny-with-vae.safetensors"  # with its VAE's config, as Lightricks' checkpoints carry it
    save_file({**files["meant"]["plain"], **load_file(root / "vae.safetensors")}, path,
              metadata={"config": json.dumps({"vae": VIDEO_VAE})})
    return path


def _diffusers_vaes(path):
    """diffusers' AutoencoderKLLTX2Video and AutoencoderKLLTX2Audio at the test's widths, their weights by diffusers'
    own converters."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers, convert_ltx2_vae_to_diffusers

    configs, weights = "parallel/loading/checkpoints/configs/ltx-2.3", load_file(path)
    vae = AutoencoderKLLTX2Video.from_config({  # VIDEO_VAE's decoder in diffusers' terms (stages listed last first)
        **AutoencoderKLLTX2Video.load_config(configs, subfolder="vae"), "layers_per_block": (0, 0, 0, 0, 0),
        "decoder_block_out_channels": (16, 16, 32, 64), "decoder_layers_per_block": (1, 2, 1, 1, 1),
        "upsample_type": ("spatiotemporal", "spatiotemporal", "temporal", "spatial"), "upsample_factor": (2, 1, 2, 2),
        "upsample_residual": (False, False, True, False), "decoder_spatio_temporal_scaling": (True,) * 4,
        "decoder_inject_noise": (False,) * 5, "decoder_spatial_padding_mode": "zeros", "decoder_causal": False})
    audio = AutoencoderKLLTX2Audio.from_config({**AutoencoderKLLTX2Audio.load_config(configs, subfolder="audio_vae"),
                                                "ch_mult": (1, 1, 1), "num_res_blocks": 1})
    for model, prefix, convert in ((vae, "vae.", convert_ltx2_vae_to_diffusers),
                                   (audio, "audio_vae.", convert_ltx2_audio_vae_to_diffusers)):
        converted = convert({k: v for k, v in weights.items() if k.startswith(prefix)})
        # the fourth decoder stage, which diffusers 0.42.1's converter leaves unnamed, as its LTX-2.3 conversion names it
        converted = {k.replace("decoder.up_blocks.7.", "decoder.up_blocks.3.upsamplers.0.")
                      .replace("decoder.up_blocks.8.", "decoder.up_blocks.3."): v for k, v in converted.items()}
        model.load_state_dict(converted, strict=True)
    return vae.eval(), audio.eval()


def test_a_whole_checkpoints_pool_decodes_video_on_2_ranks_and_sound_as_diffusers_and_comfyui(files, with_vae, tmp_path):
    from parallel.model_executor import vae_decode
    from pool_helpers import serving

    generator = torch.Generator().manual_seed(6)
    latents, audio = torch.randn(1, 128, 2, 9, 16, generator=generator), torch.randn(1, 8, 17, 16, generator=generator)
    with serving(with_vae, tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--dtype", "fp32") as client:
        frames, info = client.decode(latents)
        waveform = client.decode_audio(audio)
    vae, audio_vae = _diffusers_vaes(with_vae)
    tiles = vae_decode.fit_tiles(vae, latents, 2)
    with torch.no_grad():
        want = vae.decode(latents, return_dict=False)[0]  # diffusers' tiled_decode, the pool's tiles
        dropped = vae_decode._Dispatch(vae.decoder, lambda tile: tile % 2 == 0, None)  # rank 1's tiles never arrive
        with vae_decode._decoder(vae, dropped):
            control = vae.decode(latents, return_dict=False)[0]
        mel = audio_vae.decode(audio, return_dict=False)[0]
    error, miss = ((frames - t).abs().max().item() for t in (want, control))
    print(f"video decode on 2 ranks, {tiles} tiles {tuple(frames.shape)}: max |pool - diffusers| {error:.3g}, "
          f"rank 1's tiles dropped misses by {miss:.3g}")
    assert frames.shape == want.shape and error <= TOLERANCE, error
    assert miss > 100 * TOLERANCE, miss
    assert tiles >= 2 and sum(r["tiles"] for r in info["ranks"]) == info["tiles"] == tiles

    save_file({"latents": audio, "mel": mel, "video": latents}, tmp_path / "mel.safetensors")
    subprocess.run([str(files["python"]), "-c", RUN_AUDIO, str(with_vae), json.dumps(VIDEO_VAE), json.dumps(AUDIO_VAE),
                    json.dumps({"vocoder": VOCODER, "bwe": BWE}), str(tmp_path / "mel.safetensors"),
                    str(tmp_path / "comfy.safetensors")], cwd=files["comfyui"], check=True, capture_output=True)
    comfy = load_file(tmp_path / "comfy.safetensors")
    vae.use_tiling = False
    with torch.no_grad():
        plain = vae.decode(latents, return_dict=False)[0]
    mapped = (plain - comfy["frames"]).abs().max().item()  # the converted names against ComfyUI's own decoder
    print(f"untiled video decode: max |diffusers - ComfyUI's VideoVAE decoder| {mapped:.3g}")
    assert plain.shape == comfy["frames"].shape and mapped <= TOLERANCE, mapped
    error, whole, miss = ((waveform - comfy[k]).abs().max().item() for k in ("waveform", "whole", "without_bwe"))
    clipped = (comfy["waveform"].abs() >= 1).float().mean().item()
    print(f"audio decode {tuple(waveform.shape)}: max |pool - ComfyUI's vocoder on diffusers' mel| {error:.3g}, "
          f"|pool - ComfyUI's own VAE and vocoder| {whole:.3g}, without its bandwidth extension misses by {miss:.3g}; "
          f"{clipped:.0%} of samples at ±1")
    assert waveform.shape == comfy["waveform"].shape and max(error, whole) <= TOLERANCE, (error, whole)
    assert miss > 100 * TOLERANCE and clipped < 0.5 and waveform.abs().max() > 100 * TOLERANCE, (miss, clipped)


def test_a_video_vae_the_loader_cannot_read_leaves_sampling_and_refuses_decode_in_one_line(
        files, with_vae, tmp_path):
    """A four-stage decoder without the file's config (which says how its stages upsample, as the shipped LTX-2 config
    cannot): the pool still loads (sampling needs the statistics alone), and a decode is refused at submit with the
    reason and ComfyUI's VAE Decode."""
    from types import SimpleNamespace

    from parallel.loading.pipelines import load_pipeline
    from workers.rank.validation import Validator

    save_file(load_file(with_vae), tmp_path / "ltx-2.3-tiny-other-vae.safetensors")  # its config left out
    pipeline = load_pipeline(tmp_path / "ltx-2.3-tiny-other-vae.safetensors", dtype="fp32")
    assert not list(pipeline.vae.parameters()) and list(pipeline.vocoder.parameters())
    rank = SimpleNamespace(state="idle", pipeline=SimpleNamespace(module=pipeline))
    with pytest.raises(ValueError) as error:
        Validator(rank)(SimpleNamespace(type="decode", tensors={"latents": torch.randn(1, 128, 2, 3, 5)}))
    message = str(error.value)
    print(message)
    assert "\n" not in message and "4 stages" in message and "ComfyUI's VAE Decode" in message, message
