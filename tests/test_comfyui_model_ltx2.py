"""LTX-2 (ComfyUI's LTXAV) under Model from xDiT Pool in a real ComfyUI 0.33: a pool of a diffusers folder made from a
tiny ComfyUI LTXAV file takes ComfyUI's model calls ([video, audio] latents, each stream's timestep, LTXVConditioning's
frame rate, the text its LTX-2.3 encoder leaves unprocessed) and answers what ComfyUI's own model on that file does.

The file is written by ComfyUI's own LTXAVModel (ltx2_comfy_files' tiny LTX-2.3 layout, random weights); the
folder holds diffusers' LTX2VideoTransformer3DModel from diffusers' own converter and LTX2TextConnectors with the
file's connectors (ltx2_comfy_files.diffusers_parts). ComfyUI's model runs the connectors once per sampling
(preprocess_text_embeds); the pool runs them in each call, as diffusers' pipeline does (nodes/av_calls.py,
xFuserLTX2Pipeline.model_call_arguments).

ComfyUI >= 0.31 departs from diffusers and Lightricks' reference in one place (PR 15138: each block's video-to-audio
attention reads the video after the audio-to-video update); the model calls ask the pool for this ComfyUI's order
(`v2a_reads_updated_video`, which hooks on diffusers' own blocks make: parallel/families/ltx2/comfy_block_order.py),
so on the file with a trained audio-to-video attention the pool equals ComfyUI's own model; the same call in the
reference's order misses. Under a noise mask the call also asks for ComfyUI's audio-to-video gate (the audio's
timestep for every video token: `a2v_gate_reads_audio_timestep`); with diffusers' own gate the video misses.

The sampling is the first stage of the video_ltx2_3_t2v template (EmptyLTXVLatentVideo and LTXVEmptyLatentAudio into
LTXVConcatAVLatent, LTXVConditioning 24, CFGGuider 1, ManualSigmas of its first stage, euler, RandomNoise 42,
SamplerCustomAdvanced) at a tiny size, on Ulysses 2; its audio VAE a tiny one of the released layout written by
ComfyUI's own code (8 latent channels, 16 latent mel bins: LTXAV's audio width 128).
"""

from __future__ import annotations

import torch

from ltx2_comfy_files import FILE, RATE, comfyui_file, files, pipeline_folder, stock, template
from test_comfyui_loader_minimax_h3 import _max_diffs, _streams
from xdit_test_helpers import TOLERANCE, one_rank

COMFY_ARGS = ("--use-pytorch-cross-attention",)  # ComfyUI's attention as on the GPUs a pool runs on (SDPA)


def _pool_call(folder, x: dict, updated_video: float = 1.0, mask=None, gate: float = 1.0) -> dict[str, torch.Tensor]:
    """The engine's model call on the folder as a pool loads it (one rank), ComfyUI's streams and text as sent, in
    ComfyUI >= 0.31's block order (`updated_video` 1, as ComfyUI 0.33 sends it) or the reference's (0); under a video
    noise `mask`, its per-token timesteps and the audio-to-video gate's flag (`gate`) as av_calls sends them."""
    from parallel.layout.config import ParallelConfig
    from parallel.loading.pipelines import load_pipeline
    from parallel.model_executor.model_call import check_model_call, evaluate
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper

    tensors = {"latents": x["video"], "sigma": x["sigma"], "prompt_embeds": x["context"], "audio_latents": x["audio"],
               "audio_sigma": x["sigma"], "frame_rate": torch.tensor([RATE]),
               "v2a_reads_updated_video": torch.tensor([updated_video]),
               **({} if mask is None else {"token_sigmas": (mask * x["sigma"]).reshape(1, -1),
                                           "a2v_gate_reads_audio_timestep": torch.tensor([gate])})}
    with one_rank(ParallelConfig()):
        wrapper = xFuserPipelineBaseWrapper.wrap(load_pipeline(folder))
        check_model_call(wrapper, tensors)
        out = evaluate(wrapper, tensors)
        wrapper.unwrap()
    return {"video": out["prediction"], "audio": out["audio"]}


def test_comfyuis_ltxav_model_call_equals_the_pools_in_comfyuis_block_order(comfyui_install, tmp_path):
    comfyui, python = comfyui_install
    x = comfyui_file(python, comfyui, tmp_path / FILE, work=tmp_path)
    pipeline_folder(tmp_path / FILE, tmp_path / "folder")
    ours = _pool_call(tmp_path / "folder", x)
    diffs = {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    print("one call, ComfyUI's block order:", diffs)
    assert max(diffs.values()) <= TOLERANCE, diffs
    # negative control: the same call in the reference's block order misses
    reference = _pool_call(tmp_path / "folder", x, updated_video=0.0)
    missed = {name: (reference[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    print("one call, the reference's block order:", missed)
    assert missed["audio"] > 1e-2, missed


def test_comfyuis_ltxav_model_call_under_a_noise_mask_equals_the_pools(comfyui_install, tmp_path):
    """A general noise mask (per token, values in [0, 1], its largest 1) on the trained file: ComfyUI's per-token
    timesteps (mask × sigma, process_timestep's) as the pool's `token_sigmas`, with ComfyUI's audio-to-video gate (the
    audio's timestep for every video token: `a2v_gate_reads_audio_timestep`), give ComfyUI's prediction."""
    comfyui, python = comfyui_install
    mask = torch.rand(1, 1, 3, 2, 3, generator=torch.Generator().manual_seed(5))
    mask[0, 0, 2, 1, 2] = 1.0
    x = comfyui_file(python, comfyui, tmp_path / FILE, work=tmp_path, mask=mask)
    pipeline_folder(tmp_path / FILE, tmp_path / "folder")
    ours = _pool_call(tmp_path / "folder", x, mask=mask)
    diffs = {name: (ours[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    print("one call under a noise mask:", diffs)
    assert max(diffs.values()) <= TOLERANCE, diffs
    # negative controls: the mask dropped, or inverted (1 - mask, its largest token kept at 1), moves the video; the
    # gate left as diffusers computes it (each video token's own timestep) misses too
    inverted = 1.0 - mask
    inverted[0, 0, 2, 1, 2] = 1.0
    missed = [(_pool_call(tmp_path / "folder", x, mask=m)["video"] - x["comfy_video"]).abs().max().item()
              for m in (None, inverted)]
    print("one call, mask dropped / inverted (video):", missed)
    assert min(missed) > 1e-2, missed
    own = _pool_call(tmp_path / "folder", x, mask=mask, gate=0.0)
    gated = {name: (own[name] - x[f"comfy_{name}"]).abs().max().item() for name in ("video", "audio")}
    print("one call, diffusers' audio-to-video gate (video, audio):", gated)
    assert gated["video"] > 1e-2, gated


def _pool_prompt(file: str) -> dict:
    """xDiT Pool of the file's folder on Ulysses 2, without text encoders (the text comes from ComfyUI)."""
    return {"class_type": "XDiTPool", "inputs": {
        "model": file.removesuffix(".safetensors"), "nproc": 2, "ulysses_degree": 2, "ring_degree": 1,
        "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1,
        "text_encoders": False, "dtype": "auto", "devices": "", "threads_per_rank": 1, "endpoint": ""}}


def _pool(comfy, file: str, seed: int = 42) -> tuple[torch.Tensor, torch.Tensor]:
    """The template on Model from xDiT Pool of a Ulysses-2 pool of the file's folder."""
    return _streams(comfy, {**template({"class_type": "XDiTModel", "inputs": {"pool": ["pool", 0]}}, seed),
                            "pool": _pool_prompt(file)})


def test_model_from_an_xdit_pool_on_ulysses_2_equals_comfyuis_own_ltxav(comfy):
    files(comfy)
    theirs, ours = stock(comfy, FILE), _pool(comfy, FILE)
    assert theirs[0].shape == (1, 128, 3, 2, 3) and theirs[1].shape[:2] == (1, 8) and theirs[1].shape[3] == 16, \
        [s.shape for s in theirs]
    diffs = _max_diffs(ours, theirs)
    print("template, ComfyUI's block order (video, audio):", diffs)
    assert max(diffs) <= TOLERANCE, diffs
    # negative control: ComfyUI's own model from another seed's noise is far from the pool's result
    other = _max_diffs(ours, stock(comfy, FILE, seed=43))
    print("another seed (video, audio):", other)
    assert min(other) > 1e-2, other


def test_a_noise_mask_it_cannot_match_is_refused_in_one_line(comfy):
    """A video noise mask below 1 everywhere (SetLatentNoiseMask of SolidMask 0.5): ComfyUI's LTXAV gates the
    video-to-audio attention by the video's largest timestep, the pool's transformer call by the audio's sigma; one
    error naming the mask and the fix, not an attribute error."""
    files(comfy)
    pool = _pool_prompt(FILE)
    prompt = {**template({"class_type": "XDiTModel", "inputs": {"pool": ["pool", 0]}}, 42), "pool": pool,
              "mask": {"class_type": "SolidMask", "inputs": {"value": 0.5, "width": 96, "height": 64}},
              "masked": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["video", 0], "mask": ["mask", 0]}}}
    prompt["latent"]["inputs"]["video_latent"] = ["masked", 0]
    entry = comfy.wait(comfy.queue(prompt), 600)
    errors = [m[1]["exception_message"].strip() for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "error" and errors, entry["status"]
    assert "\n" not in errors[0] and "largest video timestep (0.5) is not the audio's (1)" in errors[0], errors
    assert "LTXVImgToVideoInplace" in errors[0], errors
