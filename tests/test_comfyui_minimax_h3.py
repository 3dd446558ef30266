"""MiniMax-H3 (video with sound) in a real ComfyUI 0.33: ComfyUI's own AV latent through xDiT Sampler.

ComfyUI's EmptyMiniMaxH3LatentAV (a NestedTensor of the video [B, 24, 5n+2, H/16, W/16] and the stereo audio
[B, 32, 2, L], 40 latents a second) is sampled on a 2-rank Ulysses pool of the tiny MiniMax-H3; LTXVSeparateAVLatent
splits the result and SaveLatent writes each stream. Both equal diffusers' single-process MiniMaxH3ModularPipeline
within 1e-4, started from ComfyUI's noise of the seed (video then audio, as ComfyUI draws it for a nested latent).
ComfyUI's space is the model's for both streams (MiniMaxH3AV scales by 1); its audio is the pipeline's [2, 32, L]
with the stereo and channel axes swapped, and its frame count (124 = 5 s at 24 fps: 37 latent frames) is the
pipeline's own count, not (T'−1)·4+1. The text is the tiny model's hidden states with their modality tags under
ComfyUI's key (`minimax_token_tags`, as ComfyUI's MiniMax-H3 text encoder returns them), through the test-only
XDiTTestConditioning (Qwen3-VL 32B is too big for a CPU test). A negative control: the tags given as all text
where the tiny model's tags mark vision rows moves the result far beyond the tolerance.

xDiT VAE Decode on the same pool turns the sampled AV latent into ComfyUI's IMAGE frames and AUDIO (stereo, 32 kHz),
which CreateVideo / SaveVideo take; both equal diffusers' MiniMaxH3VideoDecodeStep (the VAE tiled as the pool tiles
it) and MiniMaxH3AudioDecodeStep of the saved latents. Controls: the audio latent read without its axes swapped, and
the frames with one tile of rank 1 missing. example_workflows/xdit_minimax_h3.json (ComfyUI's text encoder, xDiT
Sampler, xDiT VAE Decode → CreateVideo → SaveVideo) runs whole in the frontend and is checked the same way.
xDiT LoRA's `transformer_ref` target reaches the pool: aimed there, a LoRA leaves text-to-video as diffusers' own.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from loader_examples import LOAD_CONVERT
from test_comfyui import saved_latent
from test_minimax_h3 import FAMILY, FRAMES, SIZE, STEPS, reference
from test_minimax_h3_decode import decode_step, reference_video, vaes
from xdit_test_helpers import ROOT, TOLERANCE

SEED = 5
COMFY_AUDIO = (0, 2, 1, 3)  # ComfyUI's [B, 32, 2, L] ↔ the pipeline's [B, 2, 32, L]


def workflow(conditioning: str) -> dict:
    return {
        "pool": {"class_type": "XDiTPool", "inputs": {
            "model": f"xdit-tiny-{FAMILY} (built-in, no download)", "nproc": 2, "ulysses_degree": 2, "ring_degree": 1,
            "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1,
            "text_encoders": True, "dtype": "auto", "devices": "", "threads_per_rank": 1, "endpoint": ""}},
        "text": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": conditioning}},
        "av": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": SIZE, "height": SIZE, "length": FRAMES}},
        "sample": {"class_type": "XDiTSampler", "inputs": {  # guidance-distilled: cfg 1, the negative unused
            "pool": ["pool", 0], "positive": ["text", 0], "negative": ["text", 0], "latent_image": ["av", 0],
            "seed": SEED, "steps": STEPS, "cfg": 1.0, "sampler": "default", "denoise": 1.0, "preview": True}},
        "split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sample", 0]}},
        "save_video": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 0], "filename_prefix": "h3_video"}},
        "save_audio": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 1], "filename_prefix": "h3_audio"}},
        "decode": {"class_type": "XDiTVAEDecode", "inputs": {"pool": ["pool", 0], "samples": ["sample", 0], "tile_size": 0}},
        "frames": {"class_type": "XDiTTestSaveImage", "inputs": {"images": ["decode", 0], "name": "h3-frames.safetensors"}},
        "sound": {"class_type": "XDiTTestSaveAudio", "inputs": {"audio": ["decode", 1], "name": "h3-sound.safetensors"}},
        "clip": {"class_type": "CreateVideo", "inputs": {"images": ["decode", 0], "fps": 24.0, "audio": ["decode", 1]}},
        "save_clip": {"class_type": "SaveVideo", "inputs": {"video": ["clip", 0], "filename_prefix": "h3_clip",
                                                            "format": "auto", "codec": "auto"}},
    }


def test_xdit_sampler_takes_and_returns_comfyuis_minimax_h3_av_latent(comfy, video_model_dirs):
    inputs = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE, num_frames=FRAMES)
    tags = inputs["text_token_tags"].clone()
    tags[: len(tags) // 3] = 0  # the first third as vision rows (video modality), as a picture's tokens are tagged
    save_file({"cond": inputs["prompt_embeds"], "minimax_token_tags": tags}, comfy.work / "input" / "h3-text.safetensors")
    prompt_id, _, previews, _ = comfy.run_watching(workflow("h3-text.safetensors"))
    entry = comfy.wait(prompt_id)
    errors = [(m[1]["node_type"], m[1]["exception_message"], m[1]["traceback"][-3:])
              for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "success", errors or json.dumps(entry["status"])[-2000:]
    assert previews >= 1
    video, audio = saved_latent(comfy, entry, "save_video"), saved_latent(comfy, entry, "save_audio")
    assert video.shape == (1, 24, 37, SIZE // 16, SIZE // 16) and audio.shape == (1, 32, 2, 207)

    generator = torch.manual_seed(SEED)
    noise = {"latents": torch.randn(video.shape, generator=generator),
             "audio_latents": torch.randn(audio.shape, generator=generator).permute(*COMFY_AUDIO)}
    model = video_model_dirs[FAMILY]
    expected_video, expected_audio = reference(model, {**noise, "prompt_embeds": inputs["prompt_embeds"],
                                                       "text_token_tags": tags})
    errors = ((video - expected_video).abs().max().item(),
              (audio - expected_audio.permute(*COMFY_AUDIO)).abs().max().item())
    assert max(errors) <= TOLERANCE, errors

    # negative control: the same noise with every row tagged text (the tags ignored) gives another result
    untagged_video, _ = reference(model, {**noise, "prompt_embeds": inputs["prompt_embeds"],
                                                       "text_token_tags": torch.ones_like(tags)})
    assert (video - untagged_video).abs().max().item() > 100 * TOLERANCE

    assert_decoded_equals_diffusers(comfy, model, video, audio, "h3-frames.safetensors", "h3-sound.safetensors")
    clip = entry["outputs"]["save_clip"]  # CreateVideo joined the frames and the sound; SaveVideo wrote them
    assert any(item["filename"].startswith("h3_clip") for item in next(iter(clip.values())))


def assert_decoded_equals_diffusers(comfy, model, video, audio, frames_name: str, sound_name: str) -> None:
    """xDiT VAE Decode's IMAGE frames and AUDIO (kept by XDiTTestSaveImage / XDiTTestSaveAudio) equal diffusers'
    MiniMaxH3VideoDecodeStep (tiled as the pool tiles it for 2 ranks) and MiniMaxH3AudioDecodeStep of the saved latents;
    controls: ComfyUI's audio read in the pipeline's shape without swapping its axes, and rank 1's first tile missing
    from the frames."""
    frames = load_file(comfy.work / "output" / frames_name)["images"]
    sound = load_file(comfy.work / "output" / sound_name)
    pipeline = vaes(model)
    expected_frames = reference_video(pipeline.vae, video, 2)[0].movedim(1, -1)  # [T, H, W, 3], as ComfyUI's IMAGE
    expected_sound = decode_step("MiniMaxH3AudioDecodeStep", {"audio_vae": pipeline.audio_vae},
                                 audio_latents=audio.permute(*COMFY_AUDIO)[0])
    frame_count = (video.shape[2] - 2) // 5 * 17 + 5  # 5n+2 latent frames hold 17n+5
    assert frames.shape == expected_frames.shape == (frame_count, *(side * 16 for side in video.shape[-2:]), 3)
    assert int(sound["sample_rate"]) == 32000
    assert sound["waveform"].shape == expected_sound.shape == (1, 2, audio.shape[-1] * 800)
    errors = ((frames - expected_frames).abs().max().item(), (sound["waveform"] - expected_sound).abs().max().item())
    assert max(errors) <= TOLERANCE, errors
    assert expected_frames.std().item() > 0.05 and expected_sound.abs().max().item() > 100 * TOLERANCE
    unswapped = decode_step("MiniMaxH3AudioDecodeStep", {"audio_vae": pipeline.audio_vae},
                            audio_latents=audio.reshape(2, 32, -1))
    assert (sound["waveform"] - unswapped).abs().max().item() > 100 * TOLERANCE
    missing = reference_video(pipeline.vae, video, 2, missing=1)[0].movedim(1, -1)
    assert (frames - missing).abs().max().item() > 100 * TOLERANCE


def test_the_example_workflow_runs_in_the_frontend_and_equals_diffusers(comfy, page, video_model_dirs):
    """example_workflows/xdit_minimax_h3.json as the 0.33 frontend converts it, run whole (xDiT VAE Decode → CreateVideo
    → SaveVideo) with its released-size text encoder stood in (tests/comfyui_probe/xdit_test_nodes.py): CLIPLoader by
    XDiTTestTextEncoder, which gives each prompt text the tiny model's hidden states and tags as ComfyUI's MiniMax-H3
    encoder lays them out. LTXVSeparateAVLatent → SaveLatent on the sampler's output and XDiTTestSaveImage /
    XDiTTestSaveAudio on the decoder's are added: the sampled video and audio equal diffusers' MiniMaxH3ModularPipeline
    from ComfyUI's noise of the example's seed, the frames and sound CreateVideo takes its decode steps'."""
    prompt = page.eval(LOAD_CONVERT, json.loads((ROOT / "example_workflows" / "xdit_minimax_h3.json").read_text()))
    assert sorted(value["class_type"] for value in prompt.values()) == sorted([
        "XDiTPool", "CLIPLoader", "CLIPTextEncode", "CLIPTextEncode", "EmptyMiniMaxH3LatentAV", "XDiTSampler",
        "XDiTVAEDecode", "CreateVideo", "SaveVideo"])
    nodes = {value["class_type"]: node for node, value in prompt.items()}
    clip = prompt[nodes["CreateVideo"]]["inputs"]  # the pool's frames and sound, 24 frames a second
    assert (clip["images"], clip["audio"], clip["fps"]) == ([nodes["XDiTVAEDecode"], 0], [nodes["XDiTVAEDecode"], 1], 24)
    sampler = prompt[nodes["XDiTSampler"]]["inputs"]
    size = prompt[nodes["EmptyMiniMaxH3LatentAV"]]["inputs"]
    inputs = tiny_models.make_inputs(FAMILY, height=size["height"], width=size["width"], num_frames=size["length"])
    call = {"num_inference_steps": sampler["steps"], "height": size["height"], "width": size["width"]}
    texts, tags = {}, inputs["text_token_tags"]
    for node, value in prompt.items():
        if value["class_type"] == "CLIPTextEncode":
            texts[value["inputs"]["text"]] = "h3-example.safetensors"  # guidance-distilled: the negative is unused
    prompt[nodes["CLIPLoader"]] = {"class_type": "XDiTTestTextEncoder", "inputs": {}}
    decode = nodes["XDiTVAEDecode"]
    prompt |= {
        "split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": [nodes["XDiTSampler"], 0]}},
        "save_video": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 0], "filename_prefix": "ex_video"}},
        "save_audio": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 1], "filename_prefix": "ex_audio"}},
        "frames": {"class_type": "XDiTTestSaveImage", "inputs": {"images": [decode, 0], "name": "ex-frames.safetensors"}},
        "sound": {"class_type": "XDiTTestSaveAudio", "inputs": {"audio": [decode, 1], "name": "ex-sound.safetensors"}}}
    save_file({"cond": inputs["prompt_embeds"], "minimax_token_tags": tags}, comfy.work / "input" / "h3-example.safetensors")
    (comfy.work / "input" / "xdit-test-texts.json").write_text(json.dumps(texts))
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    saved = next(iter(entry["outputs"][nodes["SaveVideo"]].values()))
    assert any(item["filename"].startswith("xdit_minimax_h3") for item in saved)
    video, audio = saved_latent(comfy, entry, "save_video"), saved_latent(comfy, entry, "save_audio")
    generator = torch.manual_seed(sampler["seed"])
    noise = {"latents": torch.randn(video.shape, generator=generator),
             "audio_latents": torch.randn(audio.shape, generator=generator).permute(*COMFY_AUDIO)}
    expected_video, expected_audio = reference(video_model_dirs[FAMILY], {
        **noise, "prompt_embeds": inputs["prompt_embeds"], "text_token_tags": tags}, call)
    errors = ((video - expected_video).abs().max().item(),
              (audio - expected_audio.permute(*COMFY_AUDIO)).abs().max().item())
    assert max(errors) <= TOLERANCE, errors
    # negative control: the next seed's noise gives another video
    generator = torch.manual_seed(sampler["seed"] + 1)
    other = {"latents": torch.randn(video.shape, generator=generator),
             "audio_latents": torch.randn(audio.shape, generator=generator).permute(*COMFY_AUDIO)}
    reseeded, _ = reference(video_model_dirs[FAMILY], {**other, "prompt_embeds": inputs["prompt_embeds"],
                                                       "text_token_tags": tags}, call)
    assert (video - reseeded).abs().max().item() > 100 * TOLERANCE
    assert_decoded_equals_diffusers(comfy, video_model_dirs[FAMILY], video, audio, "ex-frames.safetensors",
                                    "ex-sound.safetensors")


def test_xdit_lora_node_targets_transformer_ref(comfy, video_model_dirs):
    """xDiT LoRA offers MiniMax-H3's `transformer_ref` as a target and the pool takes it there: a `transformer.` LoRA
    aimed at it leaves a text-to-video job (which runs `transformer`) equal to diffusers' own without the LoRA;
    control: the same LoRA on every expert moves it far. test_lora.py checks what it does to references."""
    from test_lora import AV_LORAS, peft_lora_on
    from test_minimax_h3 import loaded

    model = video_model_dirs[FAMILY]
    peft_lora_on({"transformer": loaded(model).transformer}, comfy.work / "models" / "loras" / "h3_plain.safetensors",
                 AV_LORAS[FAMILY], seed=6)
    inputs = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE, num_frames=FRAMES)
    save_file({"cond": inputs["prompt_embeds"], "minimax_token_tags": inputs["text_token_tags"]},
              comfy.work / "input" / "h3-lora-text.safetensors")
    results = {}
    for expert in ("transformer_ref (MiniMax-H3 references)", "all experts"):
        prompt = {name: node for name, node in workflow("h3-lora-text.safetensors").items()
                  if name in ("pool", "text", "av", "sample", "split", "save_video", "save_audio")}
        prompt["lora"] = {"class_type": "XDiTLoRA", "inputs": {"pool": ["pool", 0], "lora_name": "h3_plain.safetensors",
                                                               "strength": 0.8, "expert": expert}}
        prompt["sample"]["inputs"]["pool"] = ["lora", 0]
        entry = comfy.wait(comfy.queue(prompt))
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
        results[expert] = saved_latent(comfy, entry, "save_video"), saved_latent(comfy, entry, "save_audio")
    video, audio = results["transformer_ref (MiniMax-H3 references)"]
    generator = torch.manual_seed(SEED)
    noise = {"latents": torch.randn(video.shape, generator=generator),
             "audio_latents": torch.randn(audio.shape, generator=generator).permute(*COMFY_AUDIO)}
    expected_video, expected_audio = reference(model, {**noise, "prompt_embeds": inputs["prompt_embeds"],
                                                       "text_token_tags": inputs["text_token_tags"]})
    errors = ((video - expected_video).abs().max().item(),
              (audio - expected_audio.permute(*COMFY_AUDIO)).abs().max().item())
    assert max(errors) <= TOLERANCE, errors
    assert (results["all experts"][0] - expected_video).abs().max().item() > 100 * TOLERANCE
