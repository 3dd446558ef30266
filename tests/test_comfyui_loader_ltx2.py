"""LTX-2 (ComfyUI's LTXAV) under Load Diffusion Model (xDiT Pool) in a real ComfyUI 0.33: refused in one line, because
ComfyUI's own model computes LTX-2 otherwise than diffusers' LTX2VideoTransformer3DModel, the pool's.

Where they differ, found on a tiny file in the released layout (ComfyUI's own model class's state dict, random weights,
the widths in the file's `config` metadata as the released files carry them, loaded by ComfyUI's own UNETLoader code,
which detects it as LTXAV): each block's video-to-audio attention (audio queries, video keys) reads the video after
that block's audio-to-video update in ComfyUI 0.33 (`vx` re-normalised after `vx.addcmul_(a2v_out, …)`), before it in
diffusers (`audio_to_video_norm(hidden_states)` once, for both). Everything else of a model call agrees: with the
audio-to-video gate zero (its modulation weights zeroed, so the update is nothing) ComfyUI's prediction equals
diffusers' transformer and text connectors on the same file within 1e-4, video and audio; with the gate as trained,
the audio moves by O(1), and in the first block, on equal inputs, the audio-to-video attention still agrees while the
video-to-audio attention does not. The pool therefore cannot give ComfyUI's result for a real LTX-2 file.

ComfyUI is the one that moved: its LTXAV read the video before the update (one `vx_norm3` for both attentions, as
Lightricks' own ltx-core's BasicAVTransformerBlock still does) until "Speedup LTX and Wan" (ComfyUI PR 15138,
2026-08-06) re-normalised `vx` after the in-place update. The refusal names that.

Widths ComfyUI fixes in code, which the tiny file keeps: the audio latent is 8 channels × 16 mel bins (128 wide), the
text connectors have 128 learnable registers, and the cross-modal rotary tables are made with the audio's head count
(equal to the video's in the released models, 32, and in the tiny one, 4). The rotary and timestep settings are the
released config's (split rotary tables in float64, causal first frame, middle-of-token positions, cross-attention
timesteps × 1000); the features LTX-2.3's (gated attention, cross-attention modulation, per-modality text projection
in ComfyUI's text encoder, so the conditioning is [tokens, video width + audio width] with no padding, as ComfyUI's
Gemma encoder gives it).
"""

from __future__ import annotations

import json
import subprocess

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from xdit_test_helpers import TOLERANCE

CROSS = ("audio_to_video_attn", "video_to_audio_attn")  # the first block's cross-modal attentions, compared too
COMFY_ARGS = ("--use-pytorch-cross-attention",)  # ComfyUI's attention as on the GPUs a pool runs on (SDPA)
FILE = "tiny-ltx-2.3-comfy.safetensors"
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

# Writes the file from ComfyUI's own LTXAVModel, loads it with UNETLoader's own function and evaluates one model call
# (ComfyUI's diffusion model call: the unpacked [video, audio] latents, (video, audio) timesteps, the text after
# preprocess_text_embeds, which runs the file's connectors).
COMFY_SCRIPT = """
import json, sys
path, inputs, result, config, zero_gate = sys.argv[1:6]
sys.argv = sys.argv[:1] + ["--cpu", "--use-pytorch-cross-attention"]
import comfy.options; comfy.options.enable_args_parsing()
import torch, comfy.ops, comfy.sd
from safetensors.torch import load_file, save_file
from comfy.ldm.lightricks.av_model import LTXAVModel
config = json.loads(config)
model = LTXAVModel(**config, operations=comfy.ops.disable_weight_init, device="meta")
generator = torch.Generator().manual_seed(0)
weights = {name: torch.randn(value.shape, generator=generator) * 0.2 for name, value in model.state_dict().items()}
if zero_gate == "1":  # the audio-to-video gate: its timestep modulation and its per-block table rows
    for name in weights:
        if name.startswith("av_ca_a2v_gate_adaln_single.linear."):
            weights[name].zero_()
        if name.endswith("scale_shift_table_a2v_ca_video"):
            weights[name][4:].zero_()
save_file({"model.diffusion_model." + k: v for k, v in weights.items()}, path,
          metadata={"config": json.dumps({"transformer": config})})
patcher = comfy.sd.load_diffusion_model(path)
net = patcher.model.diffusion_model
x = load_file(inputs)
seen = {}
for name in ("audio_to_video_attn", "video_to_audio_attn"):  # the first block's cross-modal attentions
    getattr(net.transformer_blocks[0], name).register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, o.clone()))
with torch.no_grad():
    context = net.preprocess_text_embeds(x["context"], unprocessed=True)
    video, audio = net([x["video"], x["audio"]], (x["sigma"], x["sigma"]), context, frame_rate=x["rate"].item())
save_file({"video": video.contiguous(), "audio": audio.contiguous(), "context": context.contiguous(), **seen}, result,
          metadata={"model": type(patcher.model).__name__})
"""


def _comfyui_call(python, comfyui, path, work, zero_gate: bool) -> tuple[dict, str]:
    """The file written at `path` and evaluated by ComfyUI's own code: its outputs and the model class ComfyUI
    detected (the call's inputs and outputs pass through `work`)."""
    gen = torch.Generator().manual_seed(1)
    inputs = {"video": torch.randn(1, 128, 3, 2, 3, generator=gen), "audio": torch.randn(1, 8, 12, 16, generator=gen),
              "context": torch.randn(1, TEXT_TOKENS, VIDEO_WIDTH + AUDIO_WIDTH, generator=gen),
              "sigma": torch.tensor([0.7]), "rate": torch.tensor(RATE)}
    save_file(inputs, work / "inputs.safetensors")
    subprocess.run([str(python), "-c", COMFY_SCRIPT, str(path), str(work / "inputs.safetensors"),
                    str(work / "result.safetensors"), json.dumps(CONFIG), "1" if zero_gate else "0"],
                   cwd=comfyui, check=True, capture_output=True)
    with safe_open(work / "result.safetensors", "pt") as f:
        model = f.metadata()["model"]
    return {**inputs, **{f"comfy_{k}": v for k, v in load_file(work / "result.safetensors").items()}}, model


def _diffusers(path):
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


def _diffusers_call(path, x: dict, rate: float = RATE) -> dict:
    """The call LTX2Pipeline's loop makes on the same latents and text: the text padded to the connectors' 1024
    tokens (right, masked: the connectors put their registers there, as ComfyUI's put them after the text), the
    timestep × 1000, the pipeline's own positions for `rate`."""
    transformer, connectors = _diffusers(path)
    video, audio, text = x["video"], x["audio"], x["context"]
    batch, _, frames, height, width = video.shape
    padded = torch.cat([text, text.new_zeros(batch, 1024 - text.shape[1], text.shape[2])], dim=1)
    valid = (torch.arange(1024) < text.shape[1]).float().expand(batch, -1)
    additive = ((valid - 1) * torch.finfo(torch.float32).max).reshape(batch, 1, 1, 1024)
    seen = {}
    for name in CROSS:
        getattr(transformer.transformer_blocks[0], name).register_forward_hook(
            lambda m, a, o, n=name: seen.__setitem__(n, o.clone()))
    with torch.no_grad():
        video_text = connectors.video_connector(padded[..., :VIDEO_WIDTH], additive)[0]
        audio_text = connectors.audio_connector(padded[..., VIDEO_WIDTH:], additive)[0]
        timestep = x["sigma"] * 1000
        out_video, out_audio = transformer(
            hidden_states=video.flatten(2).transpose(1, 2), audio_hidden_states=audio.transpose(1, 2).flatten(2),
            encoder_hidden_states=video_text, audio_encoder_hidden_states=audio_text, timestep=timestep,
            sigma=timestep, num_frames=frames, height=height, width=width, fps=rate, audio_num_frames=audio.shape[2],
            video_coords=transformer.rope.prepare_video_coords(batch, frames, height, width, video.device, fps=rate),
            audio_coords=transformer.audio_rope.prepare_audio_coords(batch, audio.shape[2], video.device),
            use_cross_timestep=True, return_dict=False)
    return {"video": out_video.transpose(1, 2).reshape(video.shape),
            "audio": out_audio.reshape(batch, audio.shape[2], *audio.shape[1::2]).transpose(1, 2),
            "context": torch.cat([video_text, audio_text], dim=-1), **seen}


def _diffs(x: dict, ours: dict) -> dict[str, float]:
    return {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio", "context", *CROSS)}


def test_comfyuis_ltxav_differs_from_diffusers_only_where_video_to_audio_attention_reads_the_video(
        comfyui_install, tmp_path):
    comfyui, python = comfyui_install
    gated, model = _comfyui_call(python, comfyui, tmp_path / FILE, tmp_path, zero_gate=True)
    assert model == "LTXAV"  # UNETLoader's own detection of the file
    same = _diffs(gated, _diffusers_call(tmp_path / FILE, gated))
    assert max(same.values()) <= TOLERANCE, same
    # negative control: the comparison sees a change of the call (the video's frame rate, 25 for 24)
    assert _diffs(gated, _diffusers_call(tmp_path / FILE, gated, rate=25.0))["video"] > 1e-2
    # the trained gate: ComfyUI's video-to-audio attention reads the updated video, diffusers' the one before
    trained, _ = _comfyui_call(python, comfyui, tmp_path / FILE, tmp_path, zero_gate=False)
    differs = _diffs(trained, _diffusers_call(tmp_path / FILE, trained))
    assert differs["context"] <= TOLERANCE and differs["audio"] > 1e-2, differs
    # in the first block, on equal inputs: audio-to-video attention agrees, video-to-audio (which reads the video) not
    assert differs["audio_to_video_attn"] <= TOLERANCE and differs["video_to_audio_attn"] > 1e-2, differs


def test_the_loader_refuses_an_ltxav_file_in_one_line_with_the_reason(comfy, tmp_path):
    """The official video_ltx2_3_t2v template's first sampling stage (CFGGuider 1, ManualSigmas, euler,
    SamplerCustomAdvanced, LTXVConditioning 24) with its loader swapped: one error of the loader, before any pool."""
    _comfyui_call(comfy.python, comfy.comfy, comfy.work / "models" / "diffusion_models" / FILE, tmp_path, zero_gate=False)
    save_file({"cond": torch.randn(1, TEXT_TOKENS, VIDEO_WIDTH + AUDIO_WIDTH)}, comfy.work / "input" / "ltx2-text.safetensors")
    loader = {"unet_name": FILE, "weight_dtype": "default", "nproc": 2, "ulysses_degree": 2, "ring_degree": 1,
              "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1,
              "devices": "", "threads_per_rank": 1, "endpoint": ""}
    prompt = {
        "loader": {"class_type": "XDiTLoadDiffusionModel", "inputs": loader},
        "text": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": "ltx2-text.safetensors"}},
        "rate": {"class_type": "LTXVConditioning", "inputs": {"positive": ["text", 0], "negative": ["text", 0],
                                                              "frame_rate": RATE}},
        "guider": {"class_type": "CFGGuider", "inputs": {"model": ["loader", 0], "positive": ["rate", 0],
                                                         "negative": ["rate", 1], "cfg": 1.0}},
        "sigmas": {"class_type": "ManualSigmas", "inputs": {"sigmas": "1.0, 0.99375, 0.9875, 0.0"}},
        "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}},
        "latent": {"class_type": "EmptyLTXVLatentVideo", "inputs": {"width": 96, "height": 64, "length": 17,
                                                                   "batch_size": 1}},
        "sample": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0],
            "latent_image": ["latent", 0]}},
        "save": {"class_type": "SaveLatent", "inputs": {"samples": ["sample", 0], "filename_prefix": "ltx2"}},
    }
    entry = comfy.wait(comfy.queue(prompt), 300)
    assert entry["status"]["status_str"] == "error"
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_type"] == "XDiTLoadDiffusionModel", errors
    message = errors[0]["exception_message"].strip()
    assert "\n" not in message and "video-to-audio attention" in message and "UNETLoader" in message, message
    assert not [p for p in comfy.get("/xdit/pools")["pools"] if p["key"]["model"].endswith(FILE)]  # no pool started
