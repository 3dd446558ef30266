"""LTX-2 (ComfyUI's LTXAV) under Load Diffusion Model (xDiT Pool) in a real ComfyUI 0.33: the template's first stage
with UNETLoader swapped for the loader, on Ulysses 2, equals ComfyUI's own model on the same diffusion-model file (the
transformer and text connectors alone: the pool loads no text projection, ComfyUI's text encoder applied it).

The pool follows Lightricks' reference block order (diffusers' LTX2VideoTransformer3DModel); ComfyUI 0.33 departs from
it in one place, found here on a tiny file in the released layout (ComfyUI's own model class's state dict, random
weights, the widths in the file's `config` metadata as the released files carry them, loaded by ComfyUI's own
UNETLoader code, which detects it as LTXAV): each block's video-to-audio attention (audio queries, video keys) reads
the video after that block's audio-to-video update in ComfyUI 0.33 (`vx` re-normalised after `vx.addcmul_(a2v_out,
…)`), before it in diffusers (`audio_to_video_norm(hidden_states)` once, for both). Everything else of a model call
agrees: with the audio-to-video gate zero (its modulation weights zeroed, so the update is nothing) ComfyUI's
prediction equals diffusers' transformer and text connectors on the same file within 1e-4, video and audio; with the
gate as trained, the audio moves by O(1), and in the first block, on equal inputs, the audio-to-video attention still
agrees while the video-to-audio attention does not.

ComfyUI is the one that moved: its LTXAV read the video before the update (one `vx_norm3` for both attentions, as
Lightricks' own ltx-core's BasicAVTransformerBlock still does) until "Speedup LTX and Wan" (ComfyUI PR 15138,
2026-08-06) re-normalised `vx` after the in-place update. The loader therefore runs such files and logs the departure
once per pool (the README says it too); the sampling test's file has the audio-to-video output projection zero
(ltx2_comfy_files.FILE), where the orders coincide.
"""

from __future__ import annotations

import json
import subprocess

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx2_comfy_files import AUDIO_WIDTH, CONFIG, FILE, RATE, STRENGTH, TEXT_TOKENS, VIDEO_WIDTH, diffusers_parts, \
    files, image_to_video, stock, template
from test_comfyui_loader import _loader
from test_comfyui_loader_minimax_h3 import _max_diffs, _streams
from xdit_test_helpers import TOLERANCE

CROSS = ("audio_to_video_attn", "video_to_audio_attn")  # the first block's cross-modal attentions, compared too
COMFY_ARGS = ("--use-pytorch-cross-attention",)  # ComfyUI's attention as on the GPUs a pool runs on (SDPA)
GATED = "tiny-ltx-2.3-comfy.safetensors"
DEPARTURE_LOG = "the pool follows Lightricks' reference"  # FAMILIES.model_call_departure("LTXAV")'s opening

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


def _diffusers_call(path, x: dict, rate: float = RATE) -> dict:
    """The call LTX2Pipeline's loop makes on the same latents and text: the text padded to the connectors' 1024
    tokens (right, masked: the connectors put their registers there, as ComfyUI's put them after the text), the
    timestep × 1000, the pipeline's own positions for `rate`."""
    transformer, connectors = diffusers_parts(path)
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
    gated, model = _comfyui_call(python, comfyui, tmp_path / GATED, tmp_path, zero_gate=True)
    assert model == "LTXAV"  # UNETLoader's own detection of the file
    same = _diffs(gated, _diffusers_call(tmp_path / GATED, gated))
    print("one call, a2v gate zero:", same)
    assert max(same.values()) <= TOLERANCE, same
    # negative control: the comparison sees a change of the call (the video's frame rate, 25 for 24)
    assert _diffs(gated, _diffusers_call(tmp_path / GATED, gated, rate=25.0))["video"] > 1e-2
    # the trained gate: ComfyUI's video-to-audio attention reads the updated video, diffusers' the one before
    trained, _ = _comfyui_call(python, comfyui, tmp_path / GATED, tmp_path, zero_gate=False)
    differs = _diffs(trained, _diffusers_call(tmp_path / GATED, trained))
    print("one call, a2v gate as trained:", differs)
    assert differs["context"] <= TOLERANCE and differs["audio"] > 1e-2, differs
    # in the first block, on equal inputs: audio-to-video attention agrees, video-to-audio (which reads the video) not
    assert differs["audio_to_video_attn"] <= TOLERANCE and differs["video_to_audio_attn"] > 1e-2, differs


def test_the_swapped_loader_on_ulysses_2_equals_comfyuis_own_ltxav(comfy):
    """video_ltx2_3_t2v's first stage with UNETLoader swapped for the loader: a Ulysses-2 pool of the diffusion-model
    file (no text projection) takes ComfyUI's [video, audio] calls, and says once that it follows the reference."""
    files(comfy)
    theirs = stock(comfy, FILE)
    loader = _loader(ulysses_degree=2)
    swapped = template({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=42)
    ours = _streams(comfy, swapped)
    assert theirs[0].shape == (1, 128, 3, 2, 3) and theirs[1].shape[:2] == (1, 8), [t.shape for t in theirs]
    diffs = _max_diffs(ours, theirs)
    print("loader, a2v output zero (video, audio):", diffs)
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model from another seed's noise is far from the pool's result
    other = _max_diffs(ours, stock(comfy, FILE, seed=43))
    print("another seed (video, audio):", other)
    assert min(other) > 1e-2, other
    logged = [line for line in comfy.log.read_text().splitlines() if DEPARTURE_LOG in line]
    assert len(logged) == 1 and "PR 15138" in logged[0], logged  # one line for the pool, naming ComfyUI's change


def test_image_to_video_on_the_swapped_loader_equals_comfyuis_own_ltxav(comfy):
    """video_ltx2_3_i2v's first stage (LTXVPreprocess, LTXVImgToVideoInplace at 0.7) with the loader on Ulysses 2: the
    noise mask's per-token timesteps go to the pool as `token_sigmas` and answer what UNETLoader's model does. (With a
    trained audio-to-video attention the pool also gates a held token's audio-to-video update by its own timestep where
    ComfyUI's gates it by the audio's: `model_call_departs`; this file's update is zero, so neither departure shows.)"""
    files(comfy)
    unet = {"class_type": "UNETLoader", "inputs": {"unet_name": FILE, "weight_dtype": "default"}}
    theirs = _streams(comfy, image_to_video(unet, seed=42))
    loader = _loader(ulysses_degree=2)
    ours = _streams(comfy, image_to_video({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=42))
    diffs = _max_diffs(ours, theirs)
    print("loader, image to video (video, audio):", diffs)
    assert max(diffs) <= TOLERANCE, diffs
    # negative controls: ComfyUI's own model without the image (text to video), and with the held frame's mask
    # inverted (strength 1 - 0.7: that frame's timesteps 0.7 σ for 0.3 σ), are far from the pool's result
    dropped = _max_diffs(ours, stock(comfy, FILE))
    inverted = _max_diffs(ours, _streams(comfy, image_to_video(unet, seed=42, strength=1.0 - STRENGTH)))
    print("image dropped (video, audio):", dropped, "mask inverted (video, audio):", inverted)
    assert max(dropped) > 1e-2 and max(inverted) > 1e-2, (dropped, inverted)
