"""LTX-2 (ComfyUI's LTXAV) under Load Diffusion Model (xDiT Pool) in a real ComfyUI 0.33: the template's first stage
with UNETLoader swapped for the loader, on Ulysses 2, equals ComfyUI's own model on the same diffusion-model file (the
transformer and text connectors alone: the pool loads no text projection, ComfyUI's text encoder applied it).

ComfyUI >= 0.31 departs from Lightricks' reference block order (diffusers' LTX2VideoTransformer3DModel) in one place
(PR 15138, "Speedup LTX and Wan"): each block's video-to-audio attention (audio queries, video keys) reads the video
after that block's audio-to-video update (`vx` re-normalised after `vx.addcmul_(a2v_out, …)`), where the reference and
ComfyUI <= 0.30 read it before (one `vx_norm3` for both attentions). A drop-in loader gives what ComfyUI gives: its
model calls ask the pool for this ComfyUI's order (ComfyData.model_call_versions, nodes/comfy_compat.py), which hooks
on diffusers' own block make (parallel/families/ltx2/comfy_block_order.py). Checked here on a tiny file in the released
layout with a trained (non-zero) audio-to-video attention (ComfyUI's own model class's state dict, random weights, the
widths in the file's `config` metadata as the released files carry them, loaded by ComfyUI's own UNETLoader code,
which detects it as LTXAV): one call of diffusers' transformer and connectors in ComfyUI's order equals ComfyUI's
(in diffusers' own order the audio misses, and in the first block, on equal inputs, only the video-to-audio attention
differs); the template through the loader equals ComfyUI's own model, and with the order left as the reference's
(XDiTTestReferenceOrder: the calls without the version input) it misses.

Guided at cfg 4, ComfyUI batches cond and uncond into one call where their text has one shape: its LTXAV keeps the
text as CONDRegular (never padded across prompts), so every row of a batch holds only real tokens, the mask the pool's
connectors take; the loader's text is unrefined, so a negative of another length comes as a call of its own.

LTX-2.5 (ComfyUI 0.33: feed-forwards without biases, a learned keyframe marker ComfyUI adds to the first latent
frame's tokens on every call) is LTX-2.3's transformer with diffusers' ff_bias / audio_ff_bias /
use_keyframes_abs_pos_embedding set from the file's keys, the marker's tokens sent as diffusers' video_keyframes_mask.

Image to video (LTXVImgToVideoInplace's noise mask): ComfyUI's per-token timesteps go as `token_sigmas`, and ComfyUI's
audio-to-video gate (the audio's timestep for every video token, where diffusers' reads each token's own) is made by
pre-hooks the calls ask for (`a2v_gate_reads_audio_timestep`); without them (XDiTTestDiffusersGate) the loader misses.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx2_comfy_files import CONFIG, CONFIG_25, FILE, FILE_25, NEGATIVE, RATE, SHORT, STRENGTH, \
    VIDEO_WIDTH, comfyui_file, diffusers_parts, files, image_to_video, ltx25, stock, template
from independent_readers import _read
from quantized_files import int8_tensorwise
from test_comfyui_loader import _loader
from test_comfyui_loader_minimax_h3 import _max_diffs, _streams
from xdit_test_helpers import TOLERANCE

CROSS = ("audio_to_video_attn", "video_to_audio_attn")  # the first block's cross-modal attentions, compared too
COMFY_ARGS = ("--use-pytorch-cross-attention",)  # ComfyUI's attention as on the GPUs a pool runs on (SDPA)
TRAINED = "tiny-ltx-2.3-comfy.safetensors"

def _comfyui_call(python, comfyui, path, work) -> tuple[dict, str]:
    """The file written at `path` and evaluated by ComfyUI's own code: its outputs and the model class ComfyUI
    detected (the call's inputs and outputs pass through `work`)."""
    x = comfyui_file(python, comfyui, path, work)
    with safe_open(work / "result.safetensors", "pt") as f:
        return x, f.metadata()["model"]


def _diffusers_call(path, x: dict, updated_video: bool) -> dict:
    """The call LTX2Pipeline's loop makes on the same latents and text: the text padded to the connectors' 1024
    tokens (right, masked: the connectors put their registers there, as ComfyUI's put them after the text), the
    timestep × 1000, the pipeline's own positions; its blocks in ComfyUI >= 0.31's order where `updated_video`."""
    from parallel.families.ltx2.comfy_block_order import v2a_reads_updated_video

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
    with torch.no_grad(), v2a_reads_updated_video(transformer, updated_video):
        video_text = connectors.video_connector(padded[..., :VIDEO_WIDTH], additive)[0]
        audio_text = connectors.audio_connector(padded[..., VIDEO_WIDTH:], additive)[0]
        timestep = x["sigma"] * 1000
        out_video, out_audio = transformer(
            hidden_states=video.flatten(2).transpose(1, 2), audio_hidden_states=audio.transpose(1, 2).flatten(2),
            encoder_hidden_states=video_text, audio_encoder_hidden_states=audio_text, timestep=timestep,
            sigma=timestep, num_frames=frames, height=height, width=width, fps=RATE, audio_num_frames=audio.shape[2],
            video_coords=transformer.rope.prepare_video_coords(batch, frames, height, width, video.device, fps=RATE),
            audio_coords=transformer.audio_rope.prepare_audio_coords(batch, audio.shape[2], video.device),
            use_cross_timestep=True, return_dict=False)
    return {"video": out_video.transpose(1, 2).reshape(video.shape),
            "audio": out_audio.reshape(batch, audio.shape[2], *audio.shape[1::2]).transpose(1, 2),
            "context": torch.cat([video_text, audio_text], dim=-1), **seen}


def _diffs(x: dict, ours: dict) -> dict[str, float]:
    return {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio", "context", *CROSS)}


def test_comfyuis_ltxav_equals_diffusers_in_comfyuis_block_order(comfyui_install, tmp_path):
    comfyui, python = comfyui_install
    x, model = _comfyui_call(python, comfyui, tmp_path / TRAINED, tmp_path)
    assert model == "LTXAV"  # UNETLoader's own detection of the file
    same = _diffs(x, _diffusers_call(tmp_path / TRAINED, x, updated_video=True))
    print("one call, ComfyUI's block order:", same)
    assert max(same.values()) <= TOLERANCE, same
    # negative control: diffusers' own order (the reference's) moves the audio; in the first block, on equal inputs,
    # the audio-to-video attention agrees and the video-to-audio attention (which reads the video) does not
    reference = _diffs(x, _diffusers_call(tmp_path / TRAINED, x, updated_video=False))
    print("one call, the reference's block order:", reference)
    assert reference["context"] <= TOLERANCE and reference["audio"] > 1e-2, reference
    assert reference["audio_to_video_attn"] <= TOLERANCE and reference["video_to_audio_attn"] > 1e-2, reference


def test_the_swapped_loader_on_ulysses_2_equals_comfyuis_own_ltxav(comfy):
    """video_ltx2_3_t2v's first stage with UNETLoader swapped for the loader: a Ulysses-2 pool of the diffusion-model
    file (no text projection, a trained audio-to-video attention) takes ComfyUI's [video, audio] calls in this
    ComfyUI's block order (each rank's video rows through the hooks)."""
    files(comfy)
    theirs = stock(comfy, FILE)
    loader = _loader(ulysses_degree=2)
    swapped = template({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=42)
    ours = _streams(comfy, swapped)
    assert theirs[0].shape == (1, 128, 3, 2, 3) and theirs[1].shape[:2] == (1, 8), [t.shape for t in theirs]
    diffs = _max_diffs(ours, theirs)
    print("loader, ComfyUI's block order (video, audio):", diffs)
    assert max(diffs) <= TOLERANCE, diffs
    # negative controls: the same pool in the reference's block order (the calls without the version input), and
    # ComfyUI's own model from another seed's noise, are far from the pool's result
    reference = {**swapped, "order": {"class_type": "XDiTTestReferenceOrder", "inputs": {"model": ["unet", 0]}},
                 "guider": {**swapped["guider"], "inputs": {**swapped["guider"]["inputs"], "model": ["order", 0]}}}
    missed = _max_diffs(_streams(comfy, reference), theirs)
    print("loader, the reference's block order (video, audio):", missed)
    assert min(missed) > 1e-2, missed
    other = _max_diffs(ours, stock(comfy, FILE, seed=43))
    print("another seed (video, audio):", other)
    assert min(other) > 1e-2, other


def _guided(unet: dict, negative: str, ksampler: bool = False, swap: bool = False) -> dict:
    """The template's first stage guided at cfg 4 by a `negative` prompt (CFGGuider), or KSampler (euler / simple,
    3 steps) at cfg 4; `swap`: the prompts trade places."""
    prompt = template(unet, seed=42)
    prompt["negative"] = {"class_type": "XDiTTestConditioning", "inputs": {"tensors": f"{negative}.safetensors"}}
    sides = [["text", 0], ["negative", 0]]
    positive, negative = sides[::-1] if swap else sides
    prompt["rate"]["inputs"].update(positive=positive, negative=negative)
    prompt["guider"]["inputs"]["cfg"] = 4.0
    if ksampler:
        prompt["sample"] = {"class_type": "KSampler", "inputs": {
            "model": ["unet", 0], "seed": 42, "steps": 3, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["rate", 0], "negative": ["rate", 1], "latent_image": ["latent", 0], "denoise": 1.0}}
    return prompt


STOCK = {"class_type": "UNETLoader", "inputs": {"unet_name": FILE, "weight_dtype": "default"}}


@pytest.mark.parametrize("layout", [{"ulysses_degree": 2}, {"cfg_parallel": True}], ids=["ulysses2", "cfg2"])
def test_cfg_4_on_the_loader_equals_comfyuis_own_ltxav(comfy, layout):
    """CFGGuider at cfg 4 with a negative as long as the prompt (ComfyUI batches cond and uncond into one call: the
    pool's connectors take each sample's text) and KSampler at cfg 4 with a shorter negative (ComfyUI's own model
    batches them, its connectors having made both 1024 tokens; the loader's text is unrefined, so two calls)."""
    files(comfy)
    loader = _loader(**layout)
    swapped = {**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}
    for negative, ksampler in ((NEGATIVE, False), (SHORT, True)):
        theirs = _streams(comfy, _guided(STOCK, negative, ksampler))
        diffs = _max_diffs(_streams(comfy, _guided(swapped, negative, ksampler)), theirs)
        print(f"cfg 4, {'KSampler' if ksampler else 'CFGGuider'}, negative {negative} (video, audio):", diffs)
        assert max(diffs) <= TOLERANCE, diffs
    if "ulysses_degree" in layout:  # negative control: the prompts swapped (cfg 4 guides the other way)
        other = _max_diffs(_streams(comfy, _guided(swapped, SHORT, ksampler=True, swap=True)), theirs)
        print("positive and negative swapped (video, audio):", other)
        assert min(other) > 1e-2, other


def test_image_to_video_on_the_swapped_loader_equals_comfyuis_own_ltxav(comfy):
    """video_ltx2_3_i2v's first stage (LTXVPreprocess, LTXVImgToVideoInplace at 0.7) with the loader on Ulysses 2, on
    the trained file: the noise mask's per-token timesteps go to the pool as `token_sigmas`, with ComfyUI's
    audio-to-video gate (the audio's timestep for every video token, each rank's own tokens), and answer what
    UNETLoader's model does."""
    files(comfy)
    unet = {"class_type": "UNETLoader", "inputs": {"unet_name": FILE, "weight_dtype": "default"}}
    theirs = _streams(comfy, image_to_video(unet, seed=42))
    loader = _loader(ulysses_degree=2)
    swapped = image_to_video({**loader, "inputs": {**loader["inputs"], "unet_name": FILE}}, seed=42)
    ours = _streams(comfy, swapped)
    diffs = _max_diffs(ours, theirs)
    print("loader, image to video (video, audio):", diffs)
    assert max(diffs) <= TOLERANCE, diffs
    # negative controls: ComfyUI's own model without the image (text to video), and with the held frame's mask
    # inverted (strength 1 - 0.7: that frame's timesteps 0.7 σ for 0.3 σ), are far from the pool's result; so is the
    # pool with diffusers' gate (the calls without a2v_gate_reads_audio_timestep)
    dropped = _max_diffs(ours, stock(comfy, FILE))
    inverted = _max_diffs(ours, _streams(comfy, image_to_video(unet, seed=42, strength=1.0 - STRENGTH)))
    print("image dropped (video, audio):", dropped, "mask inverted (video, audio):", inverted)
    assert max(dropped) > 1e-2 and max(inverted) > 1e-2, (dropped, inverted)
    own = {**swapped, "gate": {"class_type": "XDiTTestDiffusersGate", "inputs": {"model": ["unet", 0]}},
           "guider": {**swapped["guider"], "inputs": {**swapped["guider"]["inputs"], "model": ["gate", 0]}}}
    gated = _max_diffs(_streams(comfy, own), theirs)
    print("loader, diffusers' audio-to-video gate (video, audio):", gated)
    assert max(gated) > 1e-2, gated


def _unet(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


DETECT = """
import sys
path = sys.argv[1]
sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import comfy.sd
patcher = comfy.sd.load_diffusion_model(path)
net = patcher.model.diffusion_model
print(type(patcher.model).__name__, net.keyframes_abs_pos_embedding is not None,
      net.transformer_blocks[0].ff.net[2].bias is None, net.transformer_blocks[0].audio_ff.net[2].bias is None)
"""


def test_ltx_2_5_t2v_on_the_swapped_loader_equals_comfyuis_own_ltxav(comfy):
    """video_ltx2_5_t2v's first stage (LTXVDualCFGGuider 1 / 1) with UNETLoader swapped for the loader on Ulysses 2,
    on a tiny LTX-2.5 diffusion-model file of ComfyUI's own LTXAVModel (its options in the file's `config` metadata,
    which UNETLoader's detection reads): the pool's transformer takes 2.5's flags from the keys and the keyframe
    marker's tokens from each call."""
    files(comfy)
    path = comfy.work / "models" / "diffusion_models" / FILE_25
    detected = subprocess.run([str(comfy.python), "-c", DETECT, str(path)], cwd=comfy.comfy, check=True,
                              capture_output=True, text=True).stdout.split()
    assert detected[-4:] == ["LTXAV", "True", "True", "True"], detected  # LTXAV, marker, no ff biases
    unet = _unet(FILE_25)
    theirs = _streams(comfy, ltx25(unet, seed=42))
    loader = _loader(ulysses_degree=2)
    ours = _streams(comfy, ltx25({**loader, "inputs": {**loader["inputs"], "unet_name": FILE_25}}, seed=42))
    diffs = _max_diffs(ours, theirs)
    print("loader, LTX-2.5 (video, audio):", diffs)
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model from another seed's noise is far from the pool's result
    other = _max_diffs(ours, _streams(comfy, ltx25(unet, seed=43)))
    print("LTX-2.5, another seed (video, audio):", other)
    assert min(other) > 1e-2, other


def test_an_int8_convrot_ltx_2_5_file_on_the_swapped_loader_equals_comfyuis_model_on_the_weights_it_means(comfy):
    """The template's file is int8 ConvRot (comfy_quant int8_tensorwise, a scale a row after a Hadamard turn of every
    16 input columns): the pool dequantizes it at load, transformer and connectors, and answers what ComfyUI's own
    model does on the weights the file means (dequantized by ComfyUI's own layers: tests/independent_readers.py;
    ComfyUI's int8 linears on the file itself also quantize their inputs). Control: the unquantized file's result."""
    files(comfy)
    models = comfy.work / "models" / "diffusion_models"
    metadata = {"config": json.dumps({"transformer": CONFIG_25})}
    quantized, meant = "tiny-ltx-2.5-distilled-int8-convrot.safetensors", "tiny-ltx-2.5-distilled-meant.safetensors"
    save_file(int8_tensorwise(load_file(models / FILE_25), convrot=True), models / quantized, metadata=metadata)
    weights = _read((comfy.comfy, comfy.python), models / quantized, "int8", comfy.work)
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in weights.items()}, models / meant,
              metadata=metadata)
    theirs = _streams(comfy, ltx25(_unet(meant), seed=42))
    loader = _loader(ulysses_degree=2)
    ours = _streams(comfy, ltx25({**loader, "inputs": {**loader["inputs"], "unet_name": quantized}}, seed=42))
    diffs = _max_diffs(ours, theirs)
    print("loader, LTX-2.5 int8 ConvRot (video, audio):", diffs)
    assert max(diffs) <= TOLERANCE, diffs
    unquantized = _max_diffs(ours, _streams(comfy, ltx25(_unet(FILE_25), seed=42)))
    print("LTX-2.5 int8 ConvRot, the unquantized file's (video, audio):", unquantized)
    assert min(unquantized) > 10 * TOLERANCE, unquantized


def test_an_ltx_2_5_file_reads_as_2_5_and_its_whole_checkpoint_is_refused_in_one_line(comfyui_install, tmp_path):
    """The reader names 2.5 from the keys and sets diffusers' flags from them (a 2.3 file keeps diffusers' defaults); a
    whole 2.5 checkpoint (text projections beside the transformer) is refused in one line: its VAEs are unread."""
    from parallel.loading.checkpoints import detect_checkpoint
    from parallel.loading.pipelines import load_pipeline

    comfyui, python = comfyui_install
    path = tmp_path / FILE_25
    comfyui_file(python, comfyui, path, config=CONFIG_25)
    detected = detect_checkpoint(path)
    flags = {k: detected.overrides[k] for k in ("ff_bias", "audio_ff_bias", "use_prompt_adaln_single",
                                                "use_keyframes_abs_pos_embedding")}
    assert detected.variant == "ltx-2.5" and flags == {"ff_bias": False, "audio_ff_bias": False,
                                                       "use_prompt_adaln_single": True,
                                                       "use_keyframes_abs_pos_embedding": True}, (detected, flags)
    comfyui_file(python, comfyui, tmp_path / FILE, config=CONFIG)
    assert detect_checkpoint(tmp_path / FILE).variant == "ltx-2.3"
    weights = load_file(path)
    for side in ("video", "audio"):
        weights[f"text_embedding_projection.{side}_aggregate_embed.weight"] = torch.zeros(VIDEO_WIDTH, 49 * 32)
    save_file(weights, tmp_path / "whole.safetensors")
    with pytest.raises(ValueError) as refused:
        load_pipeline(tmp_path / "whole.safetensors")
    text = str(refused.value)
    assert len(text.splitlines()) == 1 and "LTX-2.5's whole checkpoint" in text, text
