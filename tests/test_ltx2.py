"""LTX-2 (video with sound) through real torchrun ranks equals diffusers' single-process pipeline (fp32, 1e-4), its
video latents and its audio latents each.

The tiny model (LTX-2.3's layout: 128 video channels at ×32 / ×8, audio of 4 channels × 4 mel bins, 2 blocks)
samples 17 frames at 96×160 and 25 fps: 45 video tokens (shards of 23/22 and 12/11/11/11), 17 audio tokens and 13
text tokens left-padded by a different amount for the negative prompt. Every call guides with all of LTX-2's terms:
classifier-free guidance (video and audio scales), spatio-temporal guidance on block 1 (`stg_block`, as the 28 of
the real model's default is past a tiny model) and modality isolation, i.e. three transformer calls per step.
Image-to-video (LTX2ImageToVideoPipeline: the first latent frame kept clean, per-token video timesteps split with
the tokens) runs a selection of layouts. One torchrun launch per world size runs the layouts through
tests/engine_cases.py. Negative controls: rank 1 holding
the replicated audio's rows swapped; video-to-audio attention without merging the other ranks' keys. PipeFusion is
refused in one line with its reason; contract E takes audio_latents in IN and writes `audio` beside `latents`. A
2-rank pool samples both, decodes the video across its ranks and the audio through its audio VAE and vocoder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from test_engine_layouts import LAYOUTS
from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases, torchrun

FAMILY, I2V, STEPS, GUIDANCE = "ltx2", "ltx2-i2v", 3, 4.0
FRAMES, HEIGHT, WIDTH, RATE = 17, 96, 160, 25.0
CALL = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH,
        "frame_rate": RATE, "stg_block": 1}
# (nproc, layout, variant)
CASES = [(n, layout, "default") for n, layouts in LAYOUTS.items() for layout in layouts if layout != "ring4"]
CASES = [(n, l, "batch2" if l == "dp2" else v) for n, l, v in CASES] + [(2, "cfg2", "batch2")]
CASES += [(2, layout, "i2v") for layout in ("ulysses2", "ring2", "cfg2")]
CASES += [(4, layout, "i2v") for layout in ("ulysses2_ring2", "cfg2_ulysses2")]
CONTROLS = [(2, "ulysses2", "swapped_audio"), (2, "ring2", "own_keys_only")]
REFUSED = [(2, "pp2", "default")]


def case_name(nproc, layout, variant) -> str:
    return layout + ("" if variant == "default" else f"-{variant}")


def reference(model_dir: Path, inputs: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' own LTX2Pipeline (LTX2ImageToVideoPipeline): (video latents, audio latents)."""
    call = {**CALL, "spatio_temporal_guidance_blocks": [CALL["stg_block"]]}
    del call["stg_block"]
    return diffusers_latents(model_dir, **load_file(inputs), **call, all_outputs=True)


@pytest.fixture(scope="module")
def matrix(video_model_dirs, tmp_path_factory):
    """Both launches once: {case: (output file, inputs file)}."""
    work = tmp_path_factory.mktemp("ltx2")
    results = {}
    for nproc in (2, 4):
        specs = []
        for case in [c for c in CASES + CONTROLS + REFUSED if c[0] == nproc]:
            _, layout, variant = case
            batch = 2 if variant == "batch2" else 1
            inputs = work / f"in-b{batch}.safetensors"
            if not inputs.exists():
                save_file(tiny_models.make_inputs(FAMILY, batch=batch, height=HEIGHT, width=WIDTH, num_frames=FRAMES),
                          inputs)
            model = video_model_dirs[I2V if variant == "i2v" else FAMILY]
            layouts = {**LAYOUTS[nproc], "pp2": {"pipefusion_degree": 2, "warmup_steps": STEPS}}
            output = work / f"{nproc}-{case_name(*case)}.safetensors"
            specs.append({"name": case_name(*case), "model": str(model), "inputs": str(inputs), "output": str(output),
                          "layout": layouts[layout], "call": CALL,
                          "fault": variant if case in CONTROLS else None})
            results[case] = (output, inputs, model)
        run_engine_cases(nproc, specs, work)
    return results


def _result(matrix, case):
    output, inputs, model = matrix[case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    saved = load_file(output)
    return (saved["latents"], saved["audio"]), reference(model, inputs)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{case_name(*c)}" for c in CASES])
def test_layout_matches_single_process_diffusers(matrix, case):
    (video, audio), (expected_video, expected_audio) = _result(matrix, case)
    assert video.shape == expected_video.shape and audio.shape == expected_audio.shape
    errors = (video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()
    assert max(errors) <= TOLERANCE, f"{case_name(*case)}: max |parallel - diffusers| video {errors[0]:.3g}, audio {errors[1]:.3g}"


@pytest.mark.parametrize("case", CONTROLS, ids=[case_name(*c) for c in CONTROLS])
def test_a_misplaced_audio_stream_fails_the_check(matrix, case):
    """Each control misses on the audio (and swapped rows on the video too, which cross-attends to them)."""
    (video, audio), (expected_video, expected_audio) = _result(matrix, case)
    assert (audio - expected_audio).abs().max().item() > 100 * TOLERANCE
    if case[2] == "swapped_audio":
        assert (video - expected_video).abs().max().item() > 100 * TOLERANCE


def test_pipefusion_is_refused_with_its_reason(matrix):
    output, _, _ = matrix[REFUSED[0]]
    assert not output.exists()
    assert "LTX2VideoTransformer3DModel has no PipeFusion plan (video and audio cross-attend in every block" in case_errors(output)


def test_the_guidance_terms_all_count(video_model_dirs, tmp_path):
    """The reference guides with CFG, STG and modality isolation: each term changes the result, so each pass (the
    batched one, and the two one-branch ones every CFG rank runs whole) is tested."""
    from xdit_test_helpers import load_pipeline_folder

    inputs = tmp_path / "in.safetensors"
    save_file(tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH, num_frames=FRAMES), inputs)
    pipeline = load_pipeline_folder(video_model_dirs[FAMILY])
    base = reference(pipeline, inputs)
    call = {**CALL, "spatio_temporal_guidance_blocks": [1]}
    del call["stg_block"]
    for change in ({"stg_scale": 0.0}, {"modality_scale": 1.0}, {"audio_guidance_scale": 2.0}):
        other = diffusers_latents(pipeline, **load_file(inputs), **{**call, **change}, all_outputs=True)
        assert min((a - b).abs().max().item() for a, b in zip(base, other)) > 100 * TOLERANCE, change


def test_contract_e_takes_audio_in_and_writes_it_out(video_model_dirs, tmp_path):
    """IN holds audio_latents; OUT holds `latents` and `audio` (LTX2PipelineOutput's name), both equal to diffusers;
    the guidance scalars come through --call."""
    model = video_model_dirs[FAMILY]
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH, num_frames=FRAMES), inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                   "--steps", str(STEPS), "--guidance-scale", str(GUIDANCE), "--height", str(HEIGHT), "--width",
                   str(WIDTH), "--ulysses-degree", "2", "--call", f"frame_rate={RATE}", "--call", "stg_block=1",
                   "--call", "audio_stg_scale=2.5", "--call", "stg_scale=0.5")
    assert run.returncode == 0, run.stderr[-3000:]
    saved = load_file(output)
    assert set(saved) == {"latents", "audio"}
    call = {**CALL, "spatio_temporal_guidance_blocks": [1], "audio_stg_scale": 2.5, "stg_scale": 0.5}
    del call["stg_block"]
    expected = diffusers_latents(model, **load_file(inputs), **call, all_outputs=True)
    for name, tensor in zip(("latents", "audio"), expected):
        assert (saved[name] - tensor).abs().max().item() <= TOLERANCE, name


def test_a_pool_samples_video_with_sound_and_decodes_both(video_model_dirs, tmp_path):
    """A 2-rank Ulysses pool: the job's latents and audio equal diffusers; the video decodes across both ranks equal
    to the one-process tiled decode with the same tiles, and the audio through the pool's audio VAE and vocoder
    equals the waveform the pipeline's own call decodes from the same latents (output_type="pt")."""
    from parallel.model_executor import vae_decode
    from pool_helpers import serving
    from xdit_test_helpers import load_pipeline_folder

    model = video_model_dirs[FAMILY]
    inputs = tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH, num_frames=FRAMES)
    job = {"steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH,
           "call": {"frame_rate": RATE, "stg_block": 1}}
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2") as client:
        outputs = client.sample_outputs(inputs, job)
        frames, info = client.decode(outputs["latents"])
        waveform = client.decode_audio(outputs["audio"])
    call = {**CALL, "spatio_temporal_guidance_blocks": [1]}
    del call["stg_block"]
    pipeline = load_pipeline_folder(model)
    expected = diffusers_latents(pipeline, **inputs, **call, all_outputs=True)
    for name, tensor in zip(("latents", "audio"), expected):
        assert (outputs[name] - tensor).abs().max().item() <= TOLERANCE, name
    with torch.no_grad():
        _, own_waveform = pipeline(**inputs, **call, output_type="pt", return_dict=False)
    assert waveform.shape == own_waveform.shape and waveform.ndim == 3
    assert (waveform - own_waveform).abs().max().item() <= TOLERANCE
    assert own_waveform.abs().max().item() > 100 * TOLERANCE  # a waveform, not silence
    vae = pipeline.vae
    vae_decode.fit_tiles(vae, outputs["latents"], 2)
    with torch.no_grad():
        tiled = vae_decode._tiled_decode(vae, outputs["latents"])
    assert frames.shape == tiled.shape and (frames - tiled).abs().max().item() <= TOLERANCE
    assert sum(r["tiles"] for r in info["ranks"]) == info["tiles"]
