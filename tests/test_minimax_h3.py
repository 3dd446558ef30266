"""MiniMax-H3 (video with sound, one packed sequence) through real torchrun ranks equals diffusers' own modular
pipeline in one process (fp32, 1e-4), its video latents and its audio latents each.

The tiny model (the released layout: 24 video and 32 audio latent channels, 2 blocks) samples the shortest video its
blocks take, 124 frames (5 s at 24 fps) at 64×64: 148 video rows, 414 audio rows (207 latents × 2 stereo channels)
and 23 text rows, one packed sequence of 585 rows that no degree divides (shards of 293/292 and 147/146/146/146).
4 steps are 3 transformer calls (its scheduler counts the final step). One torchrun launch per world size runs the
layouts through tests/engine_cases.py; data parallel takes a batch of 2, one video per rank. Negative control:
sequence-parallel rank 1 holding the audio rows rolled by half (rank 0's audio rows under rank 1's tags and
positions). CFG parallel (the model is guidance-distilled: no unconditional branch) and PipeFusion are refused in one
line each with the reason; contract E takes audio_latents and text_token_tags in IN and writes `audio` beside `latents`.

Keyframes (fl2va) in the same 2-rank launch, on Ulysses 2 and Ring 2: a first and a last keyframe sent encoded
(condition_latents [1, 24, 2·16] with condition_sizes and keyframe_anchors; 16 more rows, 601 in all) with a seed,
against diffusers' own `MiniMaxH3FL2VACoreDenoiseStep` in one process drawing from that seed. Controls: the same
output misses diffusers' fl2va with the anchors swapped and its t2va, and it is the seed's draw, not the next seed's.

References (ref2va) in the same launch, on Ulysses 2 and Ring 2: an image at its own size (1×6×4 latents), a video
with its soundtrack (2×4×4 latents, 20 audio rows) and an audio clip (12 rows), sent encoded with their kinds (46 more
rows, 631 in all), against diffusers' own `MiniMaxH3Ref2VACoreDenoiseStep` (its `transformer_ref`, its own reference
dataclasses) in one process. Controls: the same output misses diffusers' ref2va with the image and the video read in
the other order, with the t2va weights in place of `transformer_ref`, and its t2va without references; and Ulysses 2
with each rank's attention on its own shard misses it (the split reaches `transformer_ref`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from test_engine_layouts import LAYOUTS
from xdit_test_helpers import TOLERANCE, case_errors, modular_latents, run_engine_cases, torchrun

FAMILY, STEPS, SIZE, FRAMES = "minimax-h3", 4, 64, 124
CALL = {"num_inference_steps": STEPS, "height": SIZE, "width": SIZE}
CASES = [(2, "ulysses2", 1), (2, "ring2", 1), (2, "dp2", 2), (4, "ulysses4", 1), (4, "ulysses2_ring2", 1)]
CONTROLS = [(2, "ulysses2", "swapped_audio")]
# fl2va: a first and a last keyframe (one latent frame each, 16 more rows), their conditioning noise from SEED
FL2VA = [(2, "ulysses2", "fl2va"), (2, "ring2", "fl2va")]
SEED, ANCHORS = 3, ("first", "last")
# ref2va: an image, a video with its soundtrack and an audio clip (reference_kinds 0, 2, 3), their noise from SEED
REF2VA = [(2, "ulysses2", "ref2va"), (2, "ring2", "ref2va")]
REF2VA_CONTROL = (2, "ulysses2", "ref2va no_exchange")  # each rank's attention on its own shard: transformer_ref split
KINDS, VISUALS, SOUNDS = (0, 2, 3), ((1, 6, 4), (2, 4, 4)), (20, 12)
REFUSED = {(2, "cfg2"): "MiniMax-H3 is guidance-distilled: one transformer call per step, no unconditional branch",
           (4, "cfg2_ulysses2"): "MiniMax-H3 is guidance-distilled",
           (2, "pp2"): "MiniMaxH3Transformer3DModel has no PipeFusion plan (its blocks take per-row modulation indices"}


def loaded(model):
    from diffusers import ModularPipeline

    if isinstance(model, ModularPipeline):
        return model
    model = ModularPipeline.from_pretrained(str(model))
    model.load_components(names=["transformer", "transformer_ref", "scheduler", "audio_scheduler"])
    return model


def keyframe_inputs(inputs: dict) -> dict:
    """The batch-1 inputs with two encoded keyframes as a job sends them: condition_latents [1, 24, 2·16] (the
    flattened-and-joined list), condition_sizes [1, 2, 3] (each one latent frame, 4×4) and keyframe_anchors [1, 2]."""
    gen = torch.Generator().manual_seed(11)
    frame = (1, SIZE // 16, SIZE // 16)
    return {**inputs, "condition_latents": torch.randn(1, 24, 2 * frame[0] * frame[1] * frame[2], generator=gen),
            "condition_sizes": torch.tensor([[frame, frame]]), "keyframe_anchors": torch.tensor([[0, 1]])}


def fl2va_reference(model, inputs: dict, anchors: tuple[str, ...], seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' own fl2va blocks (`MiniMaxH3FL2VACoreDenoiseStep`) in one process, their conditioning noise drawn
    from torch.Generator().manual_seed(seed): (video, audio [1, 2, 32, L])."""
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3FL2VACoreDenoiseStep

    model = loaded(model)
    pipeline = MiniMaxH3FL2VACoreDenoiseStep().init_pipeline()
    pipeline.update_components(**{name: model.components[name]
                                  for name in ("transformer", "scheduler", "audio_scheduler")})
    pipeline.set_progress_bar_config(disable=True)
    keyframes = list(inputs["condition_latents"].reshape(1, 24, 2, 1, SIZE // 16, SIZE // 16).unbind(2))
    with torch.no_grad():
        state = pipeline(num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=inputs["latents"],
                         audio_latents=inputs["audio_latents"][0], prompt_embeds=inputs["prompt_embeds"],
                         text_token_tags=inputs["text_token_tags"], condition_latents=keyframes,
                         keyframe_anchors=anchors, generator=torch.Generator().manual_seed(seed),
                         output=["latents", "audio_latents"])
    return state["latents"], state["audio_latents"][None]


def reference_inputs(inputs: dict) -> dict:
    """The batch-1 inputs with three encoded references as a job sends them: reference_kinds [1, 3], the image's and
    the video's latents joined (condition_latents [1, 24, 1·6·4 + 2·4·4], condition_sizes [1, 2, 3]) and the
    soundtrack's and the clip's rows joined (audio_condition_latents [1, 32, 20 + 12], audio_condition_sizes
    [1, 2, 1])."""
    gen = torch.Generator().manual_seed(13)
    return {**inputs, "reference_kinds": torch.tensor([KINDS]),
            "condition_latents": torch.randn(1, 24, sum(t * h * w for t, h, w in VISUALS), generator=gen),
            "condition_sizes": torch.tensor([VISUALS]),
            "audio_condition_latents": torch.randn(1, 32, sum(SOUNDS), generator=gen),
            "audio_condition_sizes": torch.tensor([[[rows] for rows in SOUNDS]])}


def ref2va_reference(model, inputs: dict, order: tuple[int, ...] = (0, 1, 2), partition: str = "transformer_ref"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' own ref2va blocks (`MiniMaxH3Ref2VACoreDenoiseStep`) in one process on the references as its own
    dataclasses (their media unread by these blocks), read in `order`, with `partition` as its `transformer_ref`."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference, \
        MiniMaxH3VideoReference
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Ref2VACoreDenoiseStep

    model = loaded(model)
    pipeline = MiniMaxH3Ref2VACoreDenoiseStep().init_pipeline()
    pipeline.update_components(transformer_ref=model.components[partition], scheduler=model.components["scheduler"],
                               audio_scheduler=model.components["audio_scheduler"])
    pipeline.set_progress_bar_config(disable=True)
    visuals = [part.unflatten(2, size) for part, size in zip(
        inputs["condition_latents"].split([t * h * w for t, h, w in VISUALS], dim=2), VISUALS)]
    sounds = list(inputs["audio_condition_latents"][0].T.split(SOUNDS))
    image, video = MiniMaxH3ImageReference(image=None), MiniMaxH3VideoReference(frames=None, audio=sounds[0])
    clip = MiniMaxH3AudioReference(audio=sounds[1])
    given = [(image, visuals[0], None), (video, visuals[1], sounds[0]), (clip, None, sounds[1])]
    given = [given[i] for i in order]
    with torch.no_grad():
        state = pipeline(num_inference_steps=STEPS, height=SIZE, width=SIZE, num_frames=FRAMES,
                         latents=inputs["latents"], audio_latents=inputs["audio_latents"][0],
                         prompt_embeds=inputs["prompt_embeds"], text_token_tags=inputs["text_token_tags"],
                         normalized_references=[r for r, _, _ in given],
                         condition_latents=[v for _, v, _ in given if v is not None],
                         audio_condition_latents=[s for _, _, s in given if s is not None],
                         generator=torch.Generator().manual_seed(SEED), output=["latents", "audio_latents"])
    return state["latents"], state["audio_latents"][None]


def reference(model, inputs: dict, call: dict = CALL) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' MiniMaxH3ModularPipeline (its denoise blocks), one call per sample: (video, audio [B, 2, 32, L])."""
    model = loaded(model)
    videos, audios = [], []
    for b in range(inputs["latents"].shape[0]):
        video, audio = modular_latents(
            model, outputs=("latents", "audio_latents"), **call, latents=inputs["latents"][b : b + 1],
            audio_latents=inputs["audio_latents"][b], prompt_embeds=inputs["prompt_embeds"][b : b + 1],
            text_token_tags=inputs["text_token_tags"])
        videos.append(video)
        audios.append(audio[None])
    return torch.cat(videos), torch.cat(audios)


@pytest.fixture(scope="module")
def matrix(video_model_dirs, tmp_path_factory):
    """Both launches once: {(nproc, layout, variant): output file}, and the inputs by batch."""
    work = tmp_path_factory.mktemp("minimax_h3")
    model = video_model_dirs[FAMILY]
    inputs = {}
    for batch in (1, 2):
        inputs[batch] = work / f"in-b{batch}.safetensors"
        save_file(tiny_models.make_inputs(FAMILY, batch=batch, height=SIZE, width=SIZE, num_frames=FRAMES),
                  inputs[batch])
    inputs["fl2va"], inputs["ref2va"] = work / "in-fl2va.safetensors", work / "in-ref2va.safetensors"
    save_file(keyframe_inputs(load_file(inputs[1])), inputs["fl2va"])
    save_file(reference_inputs(load_file(inputs[1])), inputs["ref2va"])
    layouts = {n: {**LAYOUTS[n], "pp2": {"pipefusion_degree": 2, "warmup_steps": STEPS}} for n in (2, 4)}
    outputs = {}
    for nproc in (2, 4):
        specs = []
        cases = [c for c in CASES + CONTROLS + FL2VA + REF2VA + [REF2VA_CONTROL] if c[0] == nproc]
        cases += [(n, l, 1) for n, l in REFUSED if n == nproc]
        for case in cases:
            _, layout, variant = case
            workflow, _, fault = variant.partition(" ") if isinstance(variant, str) else ("", "", None)
            fl2va = workflow in ("fl2va", "ref2va")
            batch = workflow if fl2va else variant if isinstance(variant, int) else 1
            output = work / f"{nproc}-{layout}-{variant}.safetensors"
            specs.append({"name": f"{layout}-{variant}", "model": str(model), "inputs": str(inputs[batch]),
                          "output": str(output), "layout": layouts[nproc][layout],
                          "call": {**CALL, "seed": SEED} if fl2va else CALL,
                          "fault": (fault or None) if fl2va else variant if isinstance(variant, str) else None})
            outputs[case] = output
        run_engine_cases(nproc, specs, work)
    return outputs, {batch: load_file(path) for batch, path in inputs.items()}, model


@pytest.fixture(scope="module")
def references(matrix):
    _, inputs, model = matrix
    expected = {batch: fl2va_reference(model, tensors, ANCHORS) if batch == "fl2va" else
                ref2va_reference(model, tensors) if batch == "ref2va" else reference(model, tensors)
                for batch, tensors in inputs.items()}
    return {**expected, "fl2va swapped": fl2va_reference(model, inputs["fl2va"], ANCHORS[::-1]),
            "fl2va other seed": fl2va_reference(model, inputs["fl2va"], ANCHORS, SEED + 1),
            "ref2va reordered": ref2va_reference(model, inputs["ref2va"], (1, 0, 2)),
            "ref2va t2va weights": ref2va_reference(model, inputs["ref2va"], partition="transformer")}


def _result(matrix, case) -> tuple[torch.Tensor, torch.Tensor]:
    output = matrix[0][case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    saved = load_file(output)
    return saved["latents"], saved["audio"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_layout_matches_single_process_diffusers(matrix, references, case):
    video, audio = _result(matrix, case)
    expected_video, expected_audio = references[case[2]]
    assert video.shape == expected_video.shape and audio.shape == expected_audio.shape
    errors = (video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()
    assert max(errors) <= TOLERANCE, f"{case}: max |parallel - diffusers| video {errors[0]:.3g}, audio {errors[1]:.3g}"


def test_audio_rows_on_the_wrong_rank_fail_the_check(matrix, references):
    video, audio = _result(matrix, CONTROLS[0])
    expected_video, expected_audio = references[1]
    assert (audio - expected_audio).abs().max().item() > 100 * TOLERANCE
    assert (video - expected_video).abs().max().item() > 100 * TOLERANCE  # the video attends to the audio


@pytest.mark.parametrize("case", FL2VA, ids=[f"{c[0]}-{c[1]}-fl2va" for c in FL2VA])
def test_keyframes_match_diffusers_fl2va_blocks(matrix, references, case):
    """Encoded keyframes (first and last) through the pool equal diffusers' fl2va blocks; the keyframes matter: the
    same pool output misses diffusers' fl2va with the anchors swapped, and its t2va on the same noise (both by
    ~4e-2). The keyframes' noise weighs 0.001 (they are held at t = 0.999), so another seed's draw moves the output
    by only ~1e-4, near the tolerance: the pool's draw must be the seed's, 50× closer to it than to the next seed's."""
    video, audio = _result(matrix, case)
    expected_video, expected_audio = references["fl2va"]
    errors = (video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()
    assert max(errors) <= TOLERANCE, f"{case}: max |parallel - diffusers| video {errors[0]:.3g}, audio {errors[1]:.3g}"
    for other in (references["fl2va swapped"], references[1]):
        assert (video - other[0]).abs().max().item() > 100 * TOLERANCE
        assert (audio - other[1]).abs().max().item() > 100 * TOLERANCE
    reseeded = references["fl2va other seed"]
    assert (video - reseeded[0]).abs().max().item() > 50 * errors[0] + 1e-6
    assert (audio - reseeded[1]).abs().max().item() > 50 * errors[1] + 1e-6


@pytest.mark.parametrize("case", REF2VA, ids=[f"{c[0]}-{c[1]}-ref2va" for c in REF2VA])
def test_references_match_diffusers_ref2va_blocks(matrix, references, case):
    """Encoded references (an image, a video with its soundtrack, an audio clip) through the pool equal diffusers'
    ref2va blocks on its `transformer_ref`; the references and their partition matter: the same pool output misses
    diffusers' ref2va with the image and the video read in the other order, with the t2va weights, and its t2va."""
    video, audio = _result(matrix, case)
    expected_video, expected_audio = references["ref2va"]
    errors = (video - expected_video).abs().max().item(), (audio - expected_audio).abs().max().item()
    assert max(errors) <= TOLERANCE, f"{case}: max |parallel - diffusers| video {errors[0]:.3g}, audio {errors[1]:.3g}"
    for other in (references["ref2va reordered"], references["ref2va t2va weights"], references[1]):
        assert (video - other[0]).abs().max().item() > 100 * TOLERANCE
        assert (audio - other[1]).abs().max().item() > 100 * TOLERANCE


def test_references_run_on_a_split_transformer_ref(matrix, references):
    """The ref2va calls run under the plan, not on a whole unwrapped `transformer_ref` per rank (which would match
    too): with each rank attending to its own shard only, the output misses diffusers'."""
    video, audio = _result(matrix, REF2VA_CONTROL)
    expected_video, expected_audio = references["ref2va"]
    assert (video - expected_video).abs().max().item() > 100 * TOLERANCE
    assert (audio - expected_audio).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("case", list(REFUSED), ids=[f"{n}-{l}" for n, l in REFUSED])
def test_refused_layouts_say_why_in_one_line(matrix, case):
    output = matrix[0][(*case, 1)]
    assert not output.exists()
    assert REFUSED[case] in case_errors(output)


def test_contract_e_takes_audio_and_tags_in_and_writes_audio_out(video_model_dirs, tmp_path):
    """IN holds audio_latents and text_token_tags; OUT holds `latents` and `audio`, both equal to diffusers'."""
    model = video_model_dirs[FAMILY]
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    tensors = tiny_models.make_inputs(FAMILY, height=SIZE, width=SIZE, num_frames=FRAMES, text_tokens=18)
    save_file(tensors, inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                   "--steps", str(STEPS), "--height", str(SIZE), "--width", str(SIZE), "--ring-degree", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    saved = load_file(output)
    assert set(saved) == {"latents", "audio"}
    for name, tensor in zip(("latents", "audio"), reference(model, tensors)):
        assert (saved[name] - tensor).abs().max().item() <= TOLERANCE, name


def test_preview_latents_are_diffusers_patch_rows_unfolded():
    """Previews: the loop's patch rows back as the video, the inverse of diffusers' own patchify (a swapped patch
    order is caught)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    from parallel.families.minimax_h3.pipelines import unpatchify_video_rows

    video = torch.randn(1, 24, 7, 4, 6)
    rows = patchify_video_latents(video, (1, 2, 2))
    assert torch.equal(unpatchify_video_rows(rows, video.shape, (1, 2, 2)), video)
    assert not torch.equal(unpatchify_video_rows(rows, (1, 24, 7, 6, 4), (1, 2, 2)).transpose(-1, -2), video)


def test_a_model_call_with_references_runs_on_transformer_ref(tmp_path):
    """xDiT Model's reference calls (MiniMaxH3ReferenceToVideo's, nodes/av_calls.py) on a pool holding both partitions
    run on `transformer_ref`, as diffusers' ref2va loop does (a single file's pool holds one transformer, which
    ComfyUI's own model runs them on: test_comfyui_loader_minimax_h3); the control: `transformer` on the same call."""
    from parallel.layout.config import ParallelConfig
    from parallel.model_executor.model_call import check_model_call, evaluate
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper
    from xdit_test_helpers import one_rank

    model = loaded(tiny_models.save_tiny_pipeline(FAMILY, tmp_path / FAMILY))
    given = reference_inputs(tiny_models.make_inputs(FAMILY, batch=1, height=SIZE, width=SIZE, num_frames=FRAMES))
    inputs = {"prompt_embeds": given["prompt_embeds"], "text_token_tags": given["text_token_tags"][None],
              "audio_latents": given["audio_latents"], "audio_sigma": torch.tensor([0.4]),
              **{name: given[name].float() for name in ("reference_kinds", "condition_latents", "condition_sizes",
                                                        "audio_condition_latents", "audio_condition_sizes")}}
    latents, sigma = given["latents"], torch.tensor([0.7])
    with one_rank(ParallelConfig()):
        wrapper = xFuserPipelineBaseWrapper.wrap(model)
        check_model_call(wrapper, {"latents": latents, "sigma": sigma, **inputs})
        ours = evaluate(wrapper, {"latents": latents, "sigma": sigma, **inputs})
        arguments = wrapper.model_call_arguments(latents, sigma, inputs)
        wrapper.unwrap()
    with torch.no_grad():
        theirs = {name: wrapper.model_call_outputs(getattr(model, name)(**arguments, return_dict=False), latents, inputs)
                  for name in ("transformer_ref", "transformer")}
    diffs = {name: {k: (ours[k] - v).abs().max().item() for k, v in out.items()} for name, out in theirs.items()}
    assert max(diffs["transformer_ref"].values()) <= TOLERANCE, diffs
    assert min(diffs["transformer"].values()) > 1e-2, diffs
