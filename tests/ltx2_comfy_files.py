"""The tiny LTX-2.3 in ComfyUI's LTXAV layout that the LTX-2 tests share (test_comfyui_loader_ltx2,
test_comfyui_model_ltx2, test_ltx2_files): its widths, the file as ComfyUI's own LTXAVModel writes it, the same
weights as diffusers' transformer and connectors, and video_ltx2_3_t2v's first stage at a tiny size.

Widths ComfyUI fixes in code, which the tiny file keeps: the audio latent is 8 channels × 16 mel bins (128 wide), the
text connectors have 128 learnable registers, and the cross-modal rotary tables are made with the audio's head count
(equal to the video's in the released models, 32, and in the tiny one, 4). The rotary and timestep settings are the
released config's (split rotary tables in float64, causal first frame, middle-of-token positions, cross-attention
timesteps × 1000); the features LTX-2.3's (gated attention, cross-attention modulation, per-modality text projection
in ComfyUI's text encoder, so the conditioning is [tokens, video width + audio width] with no padding, as ComfyUI's
Gemma encoder gives it). Every weight is random and non-zero, the audio-to-video attention's too, so the block order
ComfyUI >= 0.31 takes (PR 15138: each block's video-to-audio attention reads the video after the audio-to-video update)
shows: the pool must take it too.
"""

from __future__ import annotations

import json
import subprocess

import torch
from safetensors.torch import load_file, save_file

from test_comfyui_loader_minimax_h3 import _streams
from test_comfyui_ltx2 import AUDIO_VAE_SCRIPT

HEADS, HEAD, AUDIO_HEAD, TEXT_TOKENS, RATE = 4, 16, 8, 7, 24.0
VIDEO_WIDTH, AUDIO_WIDTH = HEADS * HEAD, HEADS * AUDIO_HEAD
# ComfyUI's LTXAVModel keywords, as a released file's metadata carries them ({"transformer": …})
CONFIG = dict(
    in_channels=128, audio_in_channels=128, num_layers=2, num_attention_heads=HEADS, attention_head_dim=HEAD,
    audio_num_attention_heads=HEADS, audio_attention_head_dim=AUDIO_HEAD, cross_attention_dim=VIDEO_WIDTH,
    audio_cross_attention_dim=AUDIO_WIDTH, caption_channels=32, rope_type="split", frequencies_precision="float64",
    causal_temporal_positioning=True, use_middle_indices_grid=True, av_ca_timestep_scale_multiplier=1000.0,
    apply_gated_attention=True, cross_attention_adaln=True, caption_proj_before_connector=True,
    caption_projection_first_linear=False, connector_apply_gated_attention=True, connector_num_layers=1,
    connector_num_attention_heads=HEADS, connector_attention_head_dim=HEAD,
    audio_connector_num_attention_heads=HEADS, audio_connector_attention_head_dim=AUDIO_HEAD)
FILE = "tiny-ltx-2.3-a2v.safetensors"
# LTX-2.5's LTXAVModel keywords (ComfyUI 0.33, upstream 57ce8e1a): feed-forwards without biases, the learned keyframe
# marker (`keyframes_abs_pos_embedding`, which ComfyUI adds to every first-latent-frame token), connector_ff_bias off
# (ComfyUI 0.33's LTXAVModel keeps the connectors' biases regardless)
CONFIG_25 = {**CONFIG, "ff_bias": False, "audio_ff_bias": False, "connector_ff_bias": False,
             "use_prompt_adaln_single": True, "use_keyframes_abs_pos_embedding": True}
FILE_25 = "tiny-ltx-2.5-distilled.safetensors"
AUDIO_VAE, VIDEO_VAE = "tiny-ltx-2.3-audio-vae.safetensors", "tiny-ltx-2.3-video-vae.safetensors"
NEGATIVE, SHORT = "ltx2-negative", "ltx2-short"  # negative prompts: as long as ltx2-text, and 3 tokens
START, STRENGTH = "ltx2-start.png", 0.7  # video_ltx2_3_i2v's first stage: LTXVImgToVideoInplace at strength 0.7
SIGMAS = "1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"  # the template's first stage

# Writes the file from ComfyUI's own LTXAVModel and,
# given inputs, loads it with UNETLoader's own function and evaluates ComfyUI's diffusion model call on it: the text
# through preprocess_text_embeds (its connectors, as its model's extra_conds runs them for unprocessed LTX-2.3 text),
# [video, audio] at (sigma, sigma); it keeps the text, the first block's cross-modal attentions and the detected class.
COMFY_SCRIPT = """
import json, sys
path, inputs, result, config = sys.argv[1:5]
sys.argv = sys.argv[:1] + ["--cpu", "--use-pytorch-cross-attention"]
import comfy.options; comfy.options.enable_args_parsing()
import torch, comfy.ops, comfy.sd
from safetensors.torch import load_file, save_file
from comfy.ldm.lightricks.av_model import LTXAVModel
config = json.loads(config)
model = LTXAVModel(**config, operations=comfy.ops.disable_weight_init, device="meta")
generator = torch.Generator().manual_seed(0)
weights = {name: torch.randn(value.shape, generator=generator) * 0.2 for name, value in model.state_dict().items()}
save_file({"model.diffusion_model." + k: v for k, v in weights.items()}, path,
          metadata={"config": json.dumps({"transformer": config})})
if inputs:
    patcher = comfy.sd.load_diffusion_model(path)
    net = patcher.model.diffusion_model
    x = load_file(inputs)
    seen = {}
    for name in ("audio_to_video_attn", "video_to_audio_attn"):  # the first block's cross-modal attentions
        getattr(net.transformer_blocks[0], name).register_forward_hook(
            lambda m, a, o, n=name: seen.__setitem__(n, o.clone()))
    with torch.no_grad():
        context = net.preprocess_text_embeds(x["context"], unprocessed=True)
        mask = x.get("mask")  # a noise mask's per-token timesteps, as ComfyUI's LTXAV.process_timestep makes them
        timestep = x["sigma"] if mask is None else net.patchifier.patchify(mask * x["sigma"])[0]
        video, audio = net([x["video"], x["audio"]], (timestep, x["sigma"]), context, frame_rate=x["rate"].item(),
                           denoise_mask=mask)
    save_file({"video": video.contiguous(), "audio": audio.contiguous(), "context": context.contiguous(), **seen},
              result, metadata={"model": type(patcher.model).__name__})
"""

# A tiny LTX video VAE as ComfyUI's VAELoader reads one (its config in the file's metadata, as the released files carry
# it): 32x spatial and 8x temporal compression to 128 channels, 8 channels wide, random weights, unit statistics.
VIDEO_VAE_SCRIPT = """
import json, sys
path = sys.argv[1]
sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import torch
from safetensors.torch import save_file
from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
up = ["compress_all", {"residual": True, "multiplier": 1}]
config = {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
          "encoder_blocks": [["res_x", {"num_layers": 1}]] + [["compress_all", {}]] * 3,
          "decoder_blocks": [up] * 3 + [["res_x", {"num_layers": 1, "inject_noise": False}]],
          "encoder_base_channels": 8, "decoder_base_channels": 8, "norm_layer": "pixel_norm",
          "latent_log_var": "uniform", "use_quant_conv": False, "causal_decoder": False, "scaling_factor": 1.0}
generator = torch.Generator().manual_seed(0)
weights = {name: torch.randn(value.shape, generator=generator) * 0.2
           for name, value in VideoVAE(config=config).state_dict().items()}
for name in weights:
    if name.startswith("per_channel_statistics."):
        weights[name] = torch.ones_like(weights[name]) if "std" in name else torch.zeros_like(weights[name])
save_file(weights, path, metadata={"config": json.dumps({"vae": config})})
"""


def comfyui_file(python, comfyui, path, work=None, mask=None, config=CONFIG) -> dict | None:
    """The file written at `path` by ComfyUI's own code from `config`; with `work`, ComfyUI's model call on it too
    (under a video noise `mask` [1, 1, 3, 2, 3], if given)."""
    args = [str(path), "", "", json.dumps(config)]
    x = None
    if work is not None:
        gen = torch.Generator().manual_seed(1)
        x = {"video": torch.randn(1, 128, 3, 2, 3, generator=gen), "audio": torch.randn(1, 8, 12, 16, generator=gen),
             "context": torch.randn(1, TEXT_TOKENS, VIDEO_WIDTH + AUDIO_WIDTH, generator=gen),
             "sigma": torch.tensor([0.7]), "rate": torch.tensor(RATE), **({} if mask is None else {"mask": mask})}
        save_file(x, work / "inputs.safetensors")
        args[1:3] = [str(work / "inputs.safetensors"), str(work / "result.safetensors")]
    subprocess.run([str(python), "-c", COMFY_SCRIPT, *args], cwd=comfyui, check=True, capture_output=True)
    if work is None:
        return None
    return {**x, **{f"comfy_{k}": v for k, v in load_file(work / "result.safetensors").items()}}


def diffusers_parts(path):
    """The same file as diffusers' LTX2VideoTransformer3DModel (diffusers' own converter; 0.42.1 leaves LTX-2.3's
    prompt modulation under its original name) and the connectors of LTX2TextConnectors (ComfyUI's text encoder holds
    the text projections, so they stay unloaded)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    weights = load_file(path)
    converted = convert_ltx2_transformer_to_diffusers(dict(weights))
    transformer = LTX2VideoTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD, in_channels=128, out_channels=128,
        cross_attention_dim=VIDEO_WIDTH, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=HEADS,
        audio_attention_head_dim=AUDIO_HEAD, audio_cross_attention_dim=AUDIO_WIDTH, num_layers=2, caption_channels=32,
        rope_type="split", gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
        use_prompt_embeddings=False)
    transformer.load_state_dict({k.replace("prompt_adaln_single", "prompt_adaln"): v for k, v in converted.items()})
    connectors = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=1, video_connector_num_attention_heads=HEADS,
        video_connector_attention_head_dim=HEAD, video_connector_num_layers=1, audio_connector_num_attention_heads=HEADS,
        audio_connector_attention_head_dim=AUDIO_HEAD, audio_connector_num_layers=1, rope_type="split",
        per_modality_projections=True, video_hidden_dim=VIDEO_WIDTH, audio_hidden_dim=AUDIO_WIDTH,
        video_gated_attn=True, audio_gated_attn=True)
    renamed = {}
    for name, value in weights.items():
        for side in ("video", "audio"):
            prefix = f"model.diffusion_model.{side}_embeddings_connector."
            if name.startswith(prefix):
                rest = name[len(prefix):].replace("transformer_1d_blocks", "transformer_blocks")
                renamed[f"{side}_connector." + rest.replace("q_norm", "norm_q").replace("k_norm", "norm_k")] = value
    missing, unexpected = connectors.load_state_dict(renamed, strict=False)
    assert sorted(missing) == ["audio_text_proj_in.weight", "video_text_proj_in.weight"] and not unexpected
    return transformer.eval(), connectors.eval()


def pipeline_folder(path, folder) -> None:
    """An LTX2Pipeline folder of the file: diffusers' transformer (its converter) and connectors, nothing else (a
    model call needs no VAE, the text comes from ComfyUI)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    transformer, connectors = diffusers_parts(path)
    LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, audio_vae=None, text_encoder=None, tokenizer=None,
                 connectors=connectors, transformer=transformer, vocoder=None).save_pretrained(folder)


def template(unet: dict, seed: int) -> dict:
    """video_ltx2_3_t2v's first sampling stage at a tiny size (17 frames of 96x64 at 24 fps) on the MODEL of `unet`
    (LTXVConditioning 24, CFGGuider 1, ManualSigmas, euler, RandomNoise `seed`, SamplerCustomAdvanced), its AV latent
    split and saved per stream."""
    return {
        "unet": unet,
        "text": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": "ltx2-text.safetensors"}},
        "rate": {"class_type": "LTXVConditioning", "inputs": {"positive": ["text", 0], "negative": ["text", 0],
                                                              "frame_rate": RATE}},
        "guider": {"class_type": "CFGGuider", "inputs": {"model": ["unet", 0], "positive": ["rate", 0],
                                                         "negative": ["rate", 1], "cfg": 1.0}},
        "sigmas": {"class_type": "ManualSigmas", "inputs": {"sigmas": SIGMAS}},
        "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "video": {"class_type": "EmptyLTXVLatentVideo", "inputs": {"width": 96, "height": 64, "length": 17,
                                                                  "batch_size": 1}},
        "audio_vae": {"class_type": "LTXVAudioVAELoader", "inputs": {"ckpt_name": AUDIO_VAE}},
        "audio": {"class_type": "LTXVEmptyLatentAudio", "inputs": {
            "frames_number": 17, "frame_rate": RATE, "batch_size": 1, "audio_vae": ["audio_vae", 0]}},
        "latent": {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["video", 0],
                                                                  "audio_latent": ["audio", 0]}},
        "sample": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0],
            "latent_image": ["latent", 0]}},
        "split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sample", 0]}},
        "save-video": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 0], "filename_prefix": "ltx2v"}},
        "save-audio": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 1], "filename_prefix": "ltx2a"}},
    }


def ltx25(unet: dict, seed: int) -> dict:
    """video_ltx2_5_t2v's first stage at the same tiny size: `template` guided by LTXVDualCFGGuider at (video_cfg 1,
    audio_cfg 1), which (equal scales) is ComfyUI's CFGGuider at 1: one conditional call a step."""
    prompt = template(unet, seed)
    prompt["guider"] = {"class_type": "LTXVDualCFGGuider", "inputs": {
        "model": ["unet", 0], "positive": ["rate", 0], "negative": ["rate", 1], "video_cfg": 1.0, "audio_cfg": 1.0}}
    return prompt


def image_to_video(unet: dict, seed: int, strength: float = STRENGTH) -> dict:
    """video_ltx2_3_i2v's first stage at the same tiny size: `template` with the start image (LoadImage) through
    LTXVPreprocess (crf 18) and LTXVImgToVideoInplace (the tiny video VAE) into the video latent: its first latent
    frame the image's encoding, its noise mask 1 - `strength` there, 1 elsewhere."""
    prompt = template(unet, seed)
    prompt.update({
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VIDEO_VAE}},
        "image": {"class_type": "LoadImage", "inputs": {"image": START}},
        "preprocess": {"class_type": "LTXVPreprocess", "inputs": {"image": ["image", 0], "img_compression": 18}},
        "i2v": {"class_type": "LTXVImgToVideoInplace", "inputs": {
            "vae": ["vae", 0], "image": ["preprocess", 0], "latent": ["video", 0], "strength": strength,
            "bypass": False}}})
    prompt["latent"]["inputs"]["video_latent"] = ["i2v", 0]
    return prompt


def stock(comfy, file: str, seed: int = 42) -> tuple[torch.Tensor, torch.Tensor]:
    """The template on ComfyUI's own model of the file (UNETLoader)."""
    return _streams(comfy, template({"class_type": "UNETLoader", "inputs": {"unet_name": file,
                                                                           "weight_dtype": "default"}}, seed))


def files(comfy) -> None:
    """The tiny files (LTX-2.3's, LTX-2.5's) in ComfyUI's models with the 2.3 file's pipeline folder, the audio and
    video VAEs, the start image and the texts (once a server)."""
    models = comfy.work / "models"
    if all((comfy.work / "input" / name).exists() for name in (START, "ltx2-text.safetensors")) and \
            (models / "diffusion_models" / FILE_25).exists():
        return
    subprocess.run([str(comfy.python), "-c", AUDIO_VAE_SCRIPT.replace('"mel_bins": 16, "z_channels": 4',
                                                                      '"mel_bins": 64, "z_channels": 8'),
                    str(models / "checkpoints" / AUDIO_VAE)], cwd=comfy.comfy, check=True, capture_output=True)
    subprocess.run([str(comfy.python), "-c", VIDEO_VAE_SCRIPT, str(models / "vae" / VIDEO_VAE)], cwd=comfy.comfy,
                   check=True, capture_output=True)
    from PIL import Image

    pixels = torch.randint(0, 256, (64, 96, 3), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(comfy.work / "input" / START)
    comfyui_file(comfy.python, comfy.comfy, models / "diffusion_models" / FILE)
    comfyui_file(comfy.python, comfy.comfy, models / "diffusion_models" / FILE_25, config=CONFIG_25)
    pipeline_folder(models / "diffusion_models" / FILE, models / "diffusers" / FILE.removesuffix(".safetensors"))
    gen = torch.Generator().manual_seed(3)  # LTX-2.3's text encoder's output: projected, its connectors still to run
    texts = {"ltx2-text": torch.randn(1, TEXT_TOKENS, VIDEO_WIDTH + AUDIO_WIDTH, generator=gen)}
    for name, tokens in ((NEGATIVE, TEXT_TOKENS), (SHORT, 3)):  # negatives: as long as the prompt, and shorter
        texts[name] = torch.randn(1, tokens, VIDEO_WIDTH + AUDIO_WIDTH, generator=gen)
    for name, cond in sorted(texts.items(), key=lambda item: item[0] == "ltx2-text"):  # ltx2-text last: files() ran
        save_file({"cond": cond, "unprocessed_ltxav_embeds": torch.tensor(True)},
                  comfy.work / "input" / f"{name}.safetensors")
