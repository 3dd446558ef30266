"""LTX-2 (video with sound) through real torchrun ranks equals diffusers' single-process pipeline (fp32, 1e-4), its
video latents and its audio latents each.

The tiny model (LTX-2.3's layout: 128 video channels at ×32 / ×8, audio of 4 channels × 4 mel bins, 2 blocks)
samples 17 frames at 96×160 and 25 fps: 45 video tokens (shards of 23/22 and 12/11/11/11), 17 audio tokens and 13
text tokens left-padded by a different amount for the negative prompt. Every call guides with all of LTX-2's terms:
classifier-free guidance (video and audio scales), spatio-temporal guidance on block 1 (`stg_block`, as the 28 of
the real model's default is past a tiny model) and modality isolation, i.e. three transformer calls per step.
Image-to-video (LTX2ImageToVideoPipeline: the first latent frame kept clean, per-token video timesteps split with the
tokens) runs a selection of layouts; LTX2ConditionPipeline (two pictures, at latent frames 0 and 2, the second
appended as tokens of its own at strength 0.6) runs Ring 2 and CFG 2 in the matrix and Ulysses 2 through contract E,
its control the second picture at frame 1; LTX2InContextPipeline (IC-LoRA: a 9-frame reference video appended at
strength 0.8) runs Ulysses 2, Ring 2 and CFG 2, its control the clip played backwards; at conditioning_attention_strength
0.5 (the video's self-attention masked per token pair) it runs Ulysses 2 and Ring 2, and a pixel mask Ring 2, in a
launch of their own, their controls strength 1 and rank 1's chunk of the mask masking nothing. One torchrun launch per world
size runs the layouts through tests/engine_cases.py. Negative controls: rank 1 holding the replicated audio's rows
swapped; video-to-audio attention without merging the other ranks' keys. PipeFusion is refused in one line with its
reason; contract E takes audio_latents in IN and writes `audio` beside `latents`. A 2-rank pool samples both, decodes
the video across its ranks and the audio through its audio VAE and vocoder; another serves LTX2ConditionPipeline,
refuses a picture past the last frame in one line and samples the two pictures equal to diffusers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from test_engine_layouts import LAYOUTS
from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases, torchrun

FAMILY, I2V, CONDITION, IC, STEPS, GUIDANCE = "ltx2", "ltx2-i2v", "ltx2-condition", "ltx2-ic", 3, 4.0
FRAMES, HEIGHT, WIDTH, RATE = 17, 96, 160, 25.0
CALL = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH,
        "frame_rate": RATE, "stg_block": 1}
# (nproc, layout, variant)
CASES = [(n, layout, "default") for n, layouts in LAYOUTS.items() for layout in layouts if layout != "ring4"]
CASES = [(n, l, "batch2" if l == "dp2" else v) for n, l, v in CASES] + [(2, "cfg2", "batch2")]
CASES += [(2, layout, "i2v") for layout in ("ulysses2", "ring2", "cfg2")]
CASES += [(4, layout, "i2v") for layout in ("ulysses2_ring2", "cfg2_ulysses2")]
CASES += [(2, layout, "condition") for layout in ("ring2", "cfg2")]
CASES += [(2, layout, "ic") for layout in ("ulysses2", "ring2", "cfg2")]
CONTROLS = [(2, "ulysses2", "swapped_audio"), (2, "ring2", "own_keys_only")]
# The conditions (pictures at latent frames 0 and 2, strengths 1 and 0.6) and the control's: the second picture at
# latent frame 1 (the job's), while the reference keeps it at 2.
CONDITIONS, MISPLACED = ([0, 2], [1.0, 0.6]), ([0, 1], [1.0, 0.6])
CONDITION_CONTROL = (2, "ring2", "condition-misplaced")
# IC-LoRA's reference video (9 frames at strength 0.8) and the control's: the job's clip played backwards.
REFERENCE_STRENGTH, IC_CONTROL = 0.8, (2, "ring2", "ic-reversed")
MODELS = {"i2v": I2V, "condition": CONDITION, "condition-misplaced": CONDITION, "ic": IC, "ic-reversed": IC}
REFUSED = [(2, "pp2", "default")]
# IC-LoRA's attention strength (its [tokens × tokens] mask on the video's self-attention, carried by the plan's
# attention_masks): 0.5 on Ulysses 2, Ring 2, CFG 2 and Ulysses 2 × Ring 2; a pixel mask at strength 1 on Ring 2 (1 on the left half of the
# reference, 0 on the right: key columns that differ). Controls, against the reference at 0.5: strength 1 on Ring 2;
# rank 1's chunk of the mask masking nothing; every Ring block taking the mask's leading key columns.
WEAK = {"ic-weak": {"conditioning_attention_strength": 0.5}, "ic-pixel": {}, "ic": {},
        "ic-weak-dropped": {"conditioning_attention_strength": 0.5},
        "ic-weak-unsliced": {"conditioning_attention_strength": 0.5}}
FAULTS = {"ic-weak-dropped": "mask_dropped_on_rank1", "ic-weak-unsliced": "mask_columns_not_sliced"}
WEAK_CASES = [(2, "ulysses2", "ic-weak"), (2, "ring2", "ic-weak"), (2, "cfg2", "ic-weak"), (2, "ring2", "ic-pixel"),
              (4, "ulysses2_ring2", "ic-weak")]
WEAK_CONTROLS = {(2, "ring2", "ic"): "ic-weak", (2, "ulysses2", "ic-weak-dropped"): "ic-weak",
                 (2, "ring2", "ic-weak-unsliced"): "ic-weak"}
# What a job may send to the condition and in-context pipelines (the pool's submit must accept every name).
CONDITION_INPUTS_SENT = ("condition_images", "condition_indices", "condition_strengths", "reference_videos",
                         "reference_strengths")


def case_name(nproc, layout, variant) -> str:
    return layout + ("" if variant == "default" else f"-{variant}")


def reference(model_dir: Path, inputs: Path, conditions=CONDITIONS, **extra) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' own LTX2Pipeline (LTX2ImageToVideoPipeline; LTX2ConditionPipeline given the conditions as its own
    LTX2VideoConditions, at the frames `conditions` names, whatever the job sent; LTX2InContextPipeline given reference_clip() as its own
    LTX2ReferenceCondition): (video latents, audio latents)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition
    from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition

    call = {**CALL, "spatio_temporal_guidance_blocks": [CALL["stg_block"]], **extra}
    del call["stg_block"]
    tensors = load_file(inputs)
    if "condition_images" in tensors:
        images = tensors.pop("condition_images")
        del tensors["condition_indices"], tensors["condition_strengths"]
        call.update(num_frames=FRAMES, noise_scale=0.0, conditions=[
            LTX2VideoCondition(frames=image[None], index=index, strength=strength, crf=0)
            for image, index, strength in zip(images, *conditions)])
    if tensors.pop("reference_videos", None) is not None:
        del tensors["reference_strengths"]
        call.update(num_frames=FRAMES, noise_scale=0.0, reference_conditions=[
            LTX2ReferenceCondition(frames=reference_clip() / 255, strength=REFERENCE_STRENGTH)])
    return diffusers_latents(model_dir, **tensors, **call, all_outputs=True)


def condition_inputs(indices: list[int], strengths: list[float]) -> dict[str, torch.Tensor]:
    """The tiny inputs with two random pictures [2, 3, H, W] in 0..255 held at latent frames `indices`."""
    gen = torch.Generator().manual_seed(1)
    return {**tiny_models.make_inputs(CONDITION, height=HEIGHT, width=WIDTH, num_frames=FRAMES),
            "condition_images": torch.rand(2, 3, HEIGHT, WIDTH, generator=gen) * 255,
            "condition_indices": torch.tensor(indices, dtype=torch.float32), "condition_strengths": torch.tensor(strengths)}


def reference_clip() -> torch.Tensor:
    """IC-LoRA's reference video: 9 random frames [9, 3, H, W] in 0..255."""
    return torch.rand(9, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(2)) * 255


def variant_inputs(variant: str) -> dict[str, torch.Tensor] | None:
    """The inputs of a condition or in-context case (None: the plain tiny inputs)."""
    if variant.startswith("condition"):
        return condition_inputs(*(MISPLACED if variant.endswith("misplaced") else CONDITIONS))
    if variant.startswith("ic"):
        clip = reference_clip().flip(0) if variant.endswith("reversed") else reference_clip()
        inputs = {**tiny_models.make_inputs(IC, height=HEIGHT, width=WIDTH, num_frames=FRAMES),
                  "reference_videos": clip[None], "reference_strengths": torch.tensor([REFERENCE_STRENGTH])}
        if variant == "ic-pixel":
            inputs["conditioning_attention_mask"] = (torch.arange(WIDTH) < WIDTH // 2).float().expand(
                1, 1, len(clip), HEIGHT, WIDTH).contiguous()
        return inputs
    return None


@pytest.fixture(scope="module")
def matrix(video_model_dirs, tmp_path_factory):
    """Both launches once: {case: (output file, inputs file)}."""
    work = tmp_path_factory.mktemp("ltx2")
    results = {}
    for nproc in (2, 4):
        specs = []
        for case in [c for c in CASES + CONTROLS + [CONDITION_CONTROL, IC_CONTROL] + REFUSED if c[0] == nproc]:
            _, layout, variant = case
            batch = 2 if variant == "batch2" else 1
            own = variant_inputs(variant)
            inputs = work / (f"in-{variant}.safetensors" if own else f"in-b{batch}.safetensors")
            if not inputs.exists():
                save_file(own or tiny_models.make_inputs(FAMILY, batch=batch, height=HEIGHT, width=WIDTH,
                                                         num_frames=FRAMES), inputs)
            model = video_model_dirs[MODELS.get(variant, FAMILY)]
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


@pytest.fixture(scope="module")
def weak_matrix(video_model_dirs, tmp_path_factory):
    """The attention-strength cases and controls, one launch per world size: {case: (output file, inputs file)}."""
    work, results = tmp_path_factory.mktemp("ltx2-weak"), {}
    for nproc in (2, 4):
        specs = []
        for case in [c for c in WEAK_CASES + list(WEAK_CONTROLS) if c[0] == nproc]:
            _, layout, variant = case
            inputs, output = work / f"in-{variant}.safetensors", work / f"{nproc}-{case_name(*case)}.safetensors"
            if not inputs.exists():
                save_file(variant_inputs(variant), inputs)
            specs.append({"name": case_name(*case), "model": str(video_model_dirs[IC]), "inputs": str(inputs),
                          "output": str(output), "layout": LAYOUTS[nproc][layout], "call": {**CALL, **WEAK[variant]},
                          "fault": FAULTS.get(variant)})
            results[case] = (output, inputs, video_model_dirs[IC])
        run_engine_cases(nproc, specs, work)
    return results


def _weak_errors(weak_matrix, case, variant):
    """max |parallel - diffusers at `variant`'s strength| of the video and the audio."""
    output, inputs, model = weak_matrix[case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    saved = load_file(output)
    expected = reference(model, inputs, **WEAK[variant])
    return tuple((saved[name] - tensor).abs().max().item() for name, tensor in zip(("latents", "audio"), expected))


@pytest.mark.parametrize("case", WEAK_CASES, ids=[f"{c[0]}-{case_name(*c)}" for c in WEAK_CASES])
def test_reference_attention_strength_matches_diffusers(weak_matrix, case):
    """LTX2InContextPipeline at conditioning_attention_strength 0.5 (or a pixel mask): the video's self-attention
    masks the references per token pair; the mask's rows split with the tokens and its keys follow the keys."""
    errors = _weak_errors(weak_matrix, case, case[2])
    print(f"{case_name(*case)}: max |parallel - diffusers| video {errors[0]:.3g}, audio {errors[1]:.3g}")
    assert max(errors) <= TOLERANCE, f"{case_name(*case)}: max |parallel - diffusers| video {errors[0]:.3g}, audio {errors[1]:.3g}"


@pytest.mark.parametrize("case", list(WEAK_CONTROLS), ids=["strength-1", "mask-dropped-on-rank1", "columns-not-sliced"])
def test_attention_strength_controls_miss(weak_matrix, case):
    """Strength 1 on Ring 2, rank 1's chunk of the mask masking nothing (Ulysses 2), or every Ring block taking the
    mask's leading key columns (not its own keys'), against diffusers at strength 0.5: both streams miss."""
    errors = _weak_errors(weak_matrix, case, WEAK_CONTROLS[case])
    print(f"{case_name(*case)}: misses video {errors[0]:.3g}, audio {errors[1]:.3g}")
    assert min(errors) > 100 * TOLERANCE, errors


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


@pytest.mark.parametrize("case", [CONDITION_CONTROL, IC_CONTROL], ids=["picture-at-another-frame", "clip-reversed"])
def test_a_condition_elsewhere_fails_the_check(matrix, case):
    """The job holds its second picture at latent frame 1 (the reference at 2), or its IC-LoRA clip played backwards:
    both streams miss."""
    (video, audio), (expected_video, expected_audio) = _result(matrix, case)
    assert (video - expected_video).abs().max().item() > 100 * TOLERANCE
    assert (audio - expected_audio).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("change, message", [
    ({"condition_indices": torch.tensor([0.0, 3.0])}, "condition_indices [0.0, 3.0] are latent frames of a video of 3"),
    ({"condition_strengths": torch.tensor([1.0])}, "2 condition_images need condition_indices and condition_strengths"),
    ({"condition_images": torch.zeros(2, 4, HEIGHT, WIDTH)}, "send RGB pictures [N, 3, H, W]"),
    ({"reference_videos": torch.zeros(1, 8, 3, HEIGHT, WIDTH), "reference_strengths": torch.tensor([1.0])},
     "send RGB clips [R, F, 3, H, W] of 8k + 1 frames"),
    ({"reference_videos": torch.zeros(1, 9, 3, HEIGHT, WIDTH), "reference_strengths": torch.tensor([1.0]),
      "conditioning_attention_mask": torch.ones(1, 1, 8, HEIGHT, WIDTH)},
     f"conditioning_attention_mask has shape [1, 1, 8, {HEIGHT}, {WIDTH}]; send [1, 1, F, H, W]")])
def test_conditions_that_cannot_apply_are_refused_in_one_line(change, message):
    """diffusers would skip a condition past the last frame with a warning; the job is refused, naming the fix (on
    the in-context pipeline, which checks the condition pipeline's pictures and its own reference videos)."""
    from parallel.layout.config import ParallelConfig
    from parallel.model_executor import wrap_pipeline
    from xdit_test_helpers import one_rank

    with one_rank(ParallelConfig()):
        wrapper = wrap_pipeline(tiny_models.build_tiny_pipeline(IC))
        with pytest.raises(ValueError, match=re.escape(message)):
            wrapper.prepare({**condition_inputs(*CONDITIONS), **change, **CALL})
        wrapper.unwrap()


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


def test_contract_e_holds_pictures_at_chosen_frames(video_model_dirs, tmp_path):
    """LTX2ConditionPipeline on Ulysses 2 through contract E: IN carries the pictures, their latent frames and
    strengths as tensors; every rank encodes them with the pipeline's VAE; video and audio equal diffusers'."""
    model = video_model_dirs[CONDITION]
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(condition_inputs(*CONDITIONS), inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                   "--steps", str(STEPS), "--guidance-scale", str(GUIDANCE), "--height", str(HEIGHT), "--width",
                   str(WIDTH), "--ulysses-degree", "2", "--call", f"frame_rate={RATE}", "--call", "stg_block=1")
    assert run.returncode == 0, run.stderr[-3000:]
    saved = load_file(output)
    for name, tensor in zip(("latents", "audio"), reference(model, inputs)):
        error = (saved[name] - tensor).abs().max().item()
        assert error <= TOLERANCE, f"{name}: max |parallel - diffusers| {error:.3g}"


@pytest.mark.parametrize("degree, variant", [("--ulysses-degree", "ic-weak"), ("--ring-degree", "ic-pixel")])
def test_contract_e_weakens_the_references_attention(video_model_dirs, tmp_path, degree, variant):
    """LTX2InContextPipeline through contract E on 2 ranks: conditioning_attention_strength 0.5 through --call, or the
    pixel mask as a tensor of IN; video and audio equal diffusers'."""
    model = video_model_dirs[IC]
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(variant_inputs(variant), inputs)
    strength = [f"conditioning_attention_strength={v}" for v in WEAK[variant].values()]
    run = torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                   "--steps", str(STEPS), "--guidance-scale", str(GUIDANCE), "--height", str(HEIGHT), "--width",
                   str(WIDTH), degree, "2", "--call", f"frame_rate={RATE}", "--call", "stg_block=1",
                   *[arg for s in strength for arg in ("--call", s)])
    assert run.returncode == 0, run.stderr[-3000:]
    saved = load_file(output)
    for name, tensor in zip(("latents", "audio"), reference(model, inputs, **WEAK[variant])):
        error = (saved[name] - tensor).abs().max().item()
        print(f"contract E {degree} 2 {variant} {name}: max |parallel - diffusers| {error:.3g}")
        assert error <= TOLERANCE, f"{name}: max |parallel - diffusers| {error:.3g}"


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


def test_a_pool_holds_pictures_at_chosen_frames(video_model_dirs, tmp_path):
    """A 2-rank Ulysses pool serving LTX2ConditionPipeline: the condition tensors go from the client's submit through
    rank 0's checks and the broadcast to every rank's VAE. A picture past the last latent frame (which diffusers would
    skip with a warning) is refused at submit in one line; the pool answers the next job, whose video and audio equal
    diffusers'. Control: the reference with the second picture at frame 1 misses both streams."""
    from pool_helpers import serving
    from workers.client import JobFailed
    from workers.wire.messages import job_inputs

    assert set(CONDITION_INPUTS_SENT) <= set(job_inputs())
    model, inputs = video_model_dirs[CONDITION], tmp_path / "in.safetensors"
    save_file(condition_inputs(*CONDITIONS), inputs)
    job = {"steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH,
           "call": {"frame_rate": RATE, "stg_block": 1}}
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2") as client:
        with pytest.raises(JobFailed) as refused:
            client.sample_outputs({**load_file(inputs), "condition_indices": torch.tensor([0.0, 3.0])}, job)
        outputs = client.sample_outputs(load_file(inputs), job)
    message = str(refused.value)
    assert refused.value.mistake and "\n" not in message, message
    assert "condition_indices [0.0, 3.0] are latent frames of a video of 3; send whole numbers in [-3, 2]" in message
    for name, tensor, control in zip(("latents", "audio"), reference(model, inputs), reference(model, inputs, MISPLACED)):
        error, miss = ((outputs[name] - t).abs().max().item() for t in (tensor, control))
        assert error <= TOLERANCE, f"{name}: max |pool - diffusers| {error:.3g}"
        assert miss > 100 * TOLERANCE, f"{name}: the control misses by only {miss:.3g}"
