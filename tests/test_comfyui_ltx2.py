"""LTX-2 (video with sound) in a real ComfyUI 0.33: ComfyUI's own AV latent through xDiT Sampler.

ComfyUI's EmptyLTXVLatentVideo and LTXVEmptyLatentAudio (its audio VAE a tiny LTX audio VAE of the released layout,
random weights, written by ComfyUI's own code and loaded by its own LTXVAudioVAELoader) joined by LTXVConcatAVLatent
are sampled on a 2-rank Ulysses pool of the tiny LTX-2; LTXVSeparateAVLatent splits the result and SaveLatent writes
each stream. Both equal diffusers' single-process LTX2Pipeline within 1e-4, started from ComfyUI's noise of the seed
(video then audio, as ComfyUI draws it for a nested latent) in ComfyUI's LTXAV space: both VAEs' latents normalised by
their statistics, which diffusers' pipeline applies to what it is given and undoes on what it returns. The frame rate
comes from ComfyUI's LTXVConditioning (24: the audio's length and every token's time position follow it). The text
is the tiny model's Gemma-style hidden states and mask, through the test-only XDiTTestConditioning (Gemma 3 12B is
too big for a CPU test). A plain video latent is refused in one line naming the nodes that make an AV latent.
"""

from __future__ import annotations

import json
import subprocess

import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from loader_examples import LOAD_CONVERT
from test_comfyui import saved_latent
from xdit_test_helpers import ROOT, TOLERANCE, diffusers_latents

SEED, STEPS, CFG = 3, 3, 4.0
FRAMES, HEIGHT, WIDTH, RATE = 17, 96, 160, 24.0
AUDIO_VAE = "xdit_tiny_ltx2_audio_vae.safetensors"

AUDIO_VAE_SCRIPT = """
import json, sys
out = sys.argv[1]; sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import torch
from safetensors.torch import save_file
from comfy.ldm.lightricks.vae.audio_vae import AudioVAE
ddconfig = {"double_z": True, "mel_bins": 16, "z_channels": 4, "resolution": 64, "downsample_time": False,
            "in_channels": 2, "out_ch": 2, "ch": 8, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
            "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}
config = {"audio_vae": {"model": {"params": {"ddconfig": ddconfig, "sampling_rate": 16000}},
                        "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}}},
          "vocoder": {"resblock_kernel_sizes": [3], "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4],
                      "resblock_dilation_sizes": [[1, 3, 5]], "upsample_initial_channel": 16, "stereo": True,
                      "output_sample_rate": 16000}}
torch.manual_seed(0)
vae = AudioVAE(metadata={"config": config})  # the tiny model's audio latent: 4 channels, 16 mel bins, 25 a second
weights = {name.replace("autoencoder.", "audio_vae.", 1): torch.randn(value.shape) * 0.1
           for name, value in vae.state_dict().items()}
save_file(weights, out, metadata={"config": json.dumps(config)})
"""


def workflow(comfy, inputs: dict) -> dict:
    for name in ("positive", "negative"):
        prefix = "" if name == "positive" else "negative_"
        save_file({"cond": inputs[prefix + "prompt_embeds"], "attention_mask": inputs[prefix + "prompt_attention_mask"]},
                  comfy.work / "input" / f"ltx2-{name}.safetensors")
    return {
        "pool": {"class_type": "XDiTPool", "inputs": {
            "model": "xdit-tiny-ltx2 (built-in, no download)", "nproc": 2, "ulysses_degree": 2, "ring_degree": 1,
            "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1,
            "text_encoders": True, "dtype": "auto", "devices": "", "threads_per_rank": 1, "endpoint": ""}},
        "positive": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": "ltx2-positive.safetensors"}},
        "negative": {"class_type": "XDiTTestConditioning", "inputs": {"tensors": "ltx2-negative.safetensors"}},
        "rate": {"class_type": "LTXVConditioning", "inputs": {
            "positive": ["positive", 0], "negative": ["negative", 0], "frame_rate": RATE}},
        "video": {"class_type": "EmptyLTXVLatentVideo", "inputs": {
            "width": WIDTH, "height": HEIGHT, "length": FRAMES, "batch_size": 1}},
        "audio_vae": {"class_type": "LTXVAudioVAELoader", "inputs": {"ckpt_name": AUDIO_VAE}},
        "audio": {"class_type": "LTXVEmptyLatentAudio", "inputs": {
            "frames_number": FRAMES, "frame_rate": RATE, "batch_size": 1, "audio_vae": ["audio_vae", 0]}},
        "av": {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["video", 0], "audio_latent": ["audio", 0]}},
        "sample": {"class_type": "XDiTSampler", "inputs": {
            "pool": ["pool", 0], "positive": ["rate", 0], "negative": ["rate", 1], "latent_image": ["av", 0],
            "seed": SEED, "steps": STEPS, "cfg": CFG, "sampler": "default", "denoise": 1.0, "preview": True}},
        "split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["sample", 0]}},
        "save_video": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 0], "filename_prefix": "ltx2_video"}},
        "save_audio": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 1], "filename_prefix": "ltx2_audio"}},
        "decode": {"class_type": "XDiTVAEDecode", "inputs": {"pool": ["pool", 0], "samples": ["sample", 0], "tile_size": 0}},
        "sound": {"class_type": "XDiTTestSaveAudio", "inputs": {"audio": ["decode", 1], "name": "ltx2-sound.safetensors"}},
        "clip": {"class_type": "CreateVideo", "inputs": {"images": ["decode", 0], "fps": RATE, "audio": ["decode", 1]}},
        "save_clip": {"class_type": "SaveVideo", "inputs": {"video": ["clip", 0], "filename_prefix": "ltx2_clip",
                                                            "format": "auto", "codec": "auto"}},
    }


def reference(model_dir, inputs: dict, video_shape, audio_shape, *, seed: int = SEED, steps: int = STEPS,
              cfg: float = CFG) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' LTX2Pipeline from ComfyUI's noise of `seed`, in and out of ComfyUI's (normalised) space, and the
    waveform its own call decodes (output_type="pt"); the size is the latents'."""
    from xdit_test_helpers import load_pipeline_folder

    pipeline = load_pipeline_folder(model_dir)
    vae, audio_vae = pipeline.vae, pipeline.audio_vae
    generator = torch.manual_seed(seed)
    video_noise, audio_noise = torch.randn(video_shape, generator=generator), torch.randn(audio_shape, generator=generator)

    def audio_space(latents, change):
        packed = change(pipeline._pack_audio_latents(latents), audio_vae.latents_mean, audio_vae.latents_std)
        return pipeline._unpack_audio_latents(packed, latents.shape[2], latents.shape[3])

    call = dict(num_inference_steps=steps, guidance_scale=cfg, height=video_shape[3] * 32, width=video_shape[4] * 32,
                num_frames=(video_shape[2] - 1) * 8 + 1, frame_rate=RATE, latents=pipeline._denormalize_latents(video_noise, vae.latents_mean, vae.latents_std),
                audio_latents=audio_space(audio_noise, pipeline._denormalize_audio_latents))
    video, audio = diffusers_latents(pipeline, **inputs, **call, all_outputs=True)
    with torch.no_grad():
        _, waveform = pipeline(**inputs, **call, output_type="pt", return_dict=False)
    return (pipeline._normalize_latents(video, vae.latents_mean, vae.latents_std),
            audio_space(audio, pipeline._normalize_audio_latents), waveform)


def _audio_vae(comfy, name: str) -> None:
    """The tiny audio VAE, written by ComfyUI's own code, as checkpoint `name` (once per server)."""
    vae_file = comfy.work / "models" / "checkpoints" / name
    if not vae_file.exists():
        subprocess.run([str(comfy.python), "-c", AUDIO_VAE_SCRIPT, str(vae_file)], cwd=comfy.comfy, check=True,
                       capture_output=True)


def test_xdit_sampler_takes_and_returns_comfyuis_av_latent(comfy, video_model_dirs):
    _audio_vae(comfy, AUDIO_VAE)
    inputs = tiny_models.make_inputs("ltx2", height=HEIGHT, width=WIDTH, num_frames=FRAMES)
    text = {k: v for k, v in inputs.items() if "prompt" in k}
    graph = workflow(comfy, text)
    prompt_id, _, previews, _ = comfy.run_watching(graph)
    entry = comfy.wait(prompt_id)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    assert previews >= 1
    video, audio = saved_latent(comfy, entry, "save_video"), saved_latent(comfy, entry, "save_audio")
    audio_frames = round(FRAMES / RATE * 25)  # 16 kHz, hop 160, ×4: 25 latent frames a second
    assert video.shape == (1, 128, 3, HEIGHT // 32, WIDTH // 32) and audio.shape == (1, 4, audio_frames, 4)
    expected_video, expected_audio, expected_sound = reference(video_model_dirs["ltx2"], text, video.shape, audio.shape)
    errors = (video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()
    assert max(errors) <= TOLERANCE, errors
    # xDiT VAE Decode: the AV latent's sound through the pool's audio VAE and vocoder equals the pipeline's own decode
    sound = load_file(comfy.work / "output" / "ltx2-sound.safetensors")
    assert int(sound["sample_rate"]) == 16000 and sound["waveform"].shape == expected_sound.shape
    assert (sound["waveform"] - expected_sound).abs().max().item() <= TOLERANCE
    assert expected_sound.abs().max().item() > 100 * TOLERANCE  # a waveform, not silence
    clip = entry["outputs"]["save_clip"]  # CreateVideo joined the frames and the sound; SaveVideo wrote them
    assert any(item["filename"].startswith("ltx2_clip") for item in next(iter(clip.values())))
    # not a result that any start would give: the pool's result moved well away from ComfyUI's noise
    assert (video - torch.randn(video.shape, generator=torch.manual_seed(SEED))).abs().max().item() > 0.1

    plain = {**graph, "sample": {**graph["sample"], "inputs": {**graph["sample"]["inputs"], "latent_image": ["video", 0]}}}
    plain = {k: v for k, v in plain.items() if k in ("pool", "positive", "negative", "rate", "video", "sample")}
    plain["save"] = {"class_type": "SaveLatent", "inputs": {"samples": ["sample", 0], "filename_prefix": "ltx2_plain"}}
    failed = comfy.wait(comfy.queue(plain))
    assert failed["status"]["status_str"] == "error"
    message = json.dumps(failed["status"])
    assert "samples video with sound from one latent holding both: use EmptyLTXVLatentVideo and LTXVEmptyLatentAudio " \
           "into LTXVConcatAVLatent" in message, message[-2000:]


def test_the_example_workflow_runs_in_the_frontend_and_equals_diffusers(comfy, page, video_model_dirs):
    """example_workflows/xdit_ltx2.json as the 0.33 frontend converts it, run whole (the pool's Gemma encodes both
    prompts; xDiT VAE Decode gives frames and sound; CreateVideo → SaveVideo), with SaveLatent / XDiTTestSaveAudio
    added on the sampler's and decoder's outputs: the AV latent and the sound equal diffusers' LTX2Pipeline called
    with the prompt texts, from ComfyUI's noise of the example's seed."""
    workflow = json.loads((ROOT / "example_workflows" / "xdit_ltx2.json").read_text())
    prompt = page.eval(LOAD_CONVERT, workflow)
    nodes = {value["class_type"]: node for node, value in prompt.items()}
    _audio_vae(comfy, prompt[nodes["LTXVAudioVAELoader"]]["inputs"]["ckpt_name"])  # the LTX-2.3 checkpoint's name
    sampler = prompt[nodes["XDiTSampler"]]["inputs"]
    texts = [prompt[prompt[sampler[name][0]]["inputs"][name][0]]["inputs"]["text"] for name in ("positive", "negative")]
    prompt |= {"split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": [nodes["XDiTSampler"], 0]}},
               "save_video": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 0], "filename_prefix": "ex_video"}},
               "save_audio": {"class_type": "SaveLatent", "inputs": {"samples": ["split", 1], "filename_prefix": "ex_audio"}},
               "sound": {"class_type": "XDiTTestSaveAudio", "inputs": {"audio": [nodes["XDiTVAEDecode"], 1],
                                                                       "name": "ltx2-example-sound.safetensors"}}}
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    assert any(item["filename"].startswith("xdit_ltx2") for item in next(iter(entry["outputs"][nodes["SaveVideo"]].values())))
    video, audio = saved_latent(comfy, entry, "save_video"), saved_latent(comfy, entry, "save_audio")
    expected_video, expected_audio, expected_sound = reference(
        video_model_dirs["ltx2"], {"prompt": texts[0], "negative_prompt": texts[1]}, video.shape, audio.shape,
        seed=sampler["seed"], steps=sampler["steps"], cfg=sampler["cfg"])
    errors = (video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()
    assert max(errors) <= TOLERANCE, errors
    sound = load_file(comfy.work / "output" / "ltx2-example-sound.safetensors")["waveform"]
    assert (sound - expected_sound).abs().max().item() <= TOLERANCE
    # negative control: the prompts swapped give another video
    swapped, _, _ = reference(video_model_dirs["ltx2"], {"prompt": texts[1], "negative_prompt": texts[0]}, video.shape,
                              audio.shape, seed=sampler["seed"], steps=sampler["steps"], cfg=sampler["cfg"])
    assert (video - swapped).abs().max().item() > 100 * TOLERANCE
