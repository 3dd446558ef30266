"""Wan video through real torchrun ranks equals diffusers' single-process pipeline (fp32, 1e-4).

The tiny Wan 2.1 and Wan 2.2 A14B (two experts) pipelines run every layout on 5-frame videos whose
32 tokens split evenly, and the sequence-parallel layouts again on 9-frame videos whose 27 tokens do
not (shards of 14/13 or 7/7/7/6 tokens). Wan 2.2 TI2V 5B (48 channels, per-token timesteps) and
Wan 2.2 I2V A14B (WanImageToVideoPipeline) run a selection. Two torchrun launches (2 and 4 ranks) run
the matrix through tests/engine_cases.py; references are computed here by the unmodified pipeline.
Negative controls: a split without exchange, and an uneven split whose padding keys are attended.
Contract E runs twice and refuses layouts that cannot split the heads or the video's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.model_executor.token_split import UnevenSplit

from test_engine_layouts import LAYOUTS  # the same layouts as the image families
from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases, torchrun

STEPS, GUIDANCE = 4, 5.0
# name: (num_frames, height, width); TI2V 5B's ×16 VAE needs twice the pixels for the same tokens
VIDEOS = {"even": (5, 64, 64), "uneven": (9, 48, 48)}
VIDEOS_5B = {"even": (5, 128, 128), "uneven": (9, 96, 96)}
SEQUENCE_LAYOUTS = ("ulysses2", "ring2", "ulysses4", "ring4", "ulysses2_ring2", "cfg2_ulysses2")
# (nproc, family, layout, video, variant)
MATRIX_FAMILIES = ("wan", "wan22")  # every layout; TI2V 5B and I2V a selection
CASES = [(n, f, l, "even", "default") for n, ls in LAYOUTS.items() for f in MATRIX_FAMILIES for l in ls]
CASES += [(n, "wan", l, "uneven", "default") for n, ls in LAYOUTS.items() for l in ls if l in SEQUENCE_LAYOUTS]
CASES += [(2, f, l, v, "default") for f in ("wan22-5b", "wan22-i2v") for l, v in
          [("ulysses2", "uneven"), ("ring2", "uneven"), ("cfg2", "even"), ("dp2", "even")]]
CASES += [(4, f, l, "uneven", "default") for f in ("wan22-5b", "wan22-i2v") for l in ("ulysses2_ring2", "cfg2_ulysses2")]
CASES += [
    (4, "wan22", "ulysses2_ring2", "uneven", "default"),
    (2, "wan", "ring2", "even", "flow-euler"),  # FlowMatchEulerDiscreteScheduler instead of UniPC
    (2, "wan22", "ulysses2", "uneven", "flow-euler"),
    (2, "wan22", "cfg2", "even", "guidance2"),  # Wan 2.2's own guidance scale for the low-noise expert
]
CONTROLS = [
    *[(2, f, "ulysses2", "even", "no_exchange") for f in MATRIX_FAMILIES],
    (2, "wan", "ring2", "uneven", "padded_keys"),
    (4, "wan", "ulysses4", "uneven", "padded_keys"),
]


def case_name(nproc, family, layout, video, variant) -> str:
    return f"{family}-{layout}-{video}" + ("" if variant == "default" else f"-{variant}")


def video_of(family: str, video: str) -> tuple[int, int, int]:
    return (VIDEOS_5B if family == "wan22-5b" else VIDEOS)[video]


def call_kwargs(family: str, video: str, variant: str) -> dict:
    """No num_frames: the engine takes the frames from the latents (image-to-video needs them)."""
    _, height, width = video_of(family, video)
    kwargs = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": height, "width": width}
    if variant == "guidance2":
        kwargs["guidance_scale_2"] = 2.0
    return kwargs


def reference(model_dir: Path, inputs: Path, family: str, video: str, variant: str) -> torch.Tensor:
    scheduler = variant if variant.startswith("flow-") else None
    return diffusers_latents(model_dir, scheduler=scheduler, **load_file(inputs), **call_kwargs(family, video, variant),
                             num_frames=video_of(family, video)[0])


@pytest.fixture(scope="module")
def image_to_video_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("i2v_models")
    return {f: tiny_models.save_tiny_pipeline(f, root / f) for f in tiny_models.IMAGE_TO_VIDEO_FAMILIES}


@pytest.fixture(scope="module")
def matrix(video_model_dirs, image_to_video_dirs, tmp_path_factory):
    """Run both launches once; return {case: (output file, inputs file)}."""
    work = tmp_path_factory.mktemp("video_matrix")
    results = {}
    for nproc in LAYOUTS:
        specs = []
        for case in [c for c in CASES + CONTROLS if c[0] == nproc]:
            _, family, layout, video, variant = case
            frames, height, width = video_of(family, video)
            batch = 2 if layout.startswith("dp") else 1
            inputs = work / f"{family}-{video}-b{batch}.safetensors"
            if not inputs.exists():
                save_file(tiny_models.make_inputs(family, batch=batch, height=height, width=width, num_frames=frames), inputs)
            name = case_name(*case)
            specs.append({
                "name": name,
                "model": str({**video_model_dirs, **image_to_video_dirs}[family]),
                "inputs": str(inputs),
                "output": str(work / f"{name}.safetensors"),
                "layout": LAYOUTS[nproc][layout],
                "call": call_kwargs(family, video, variant),
                "scheduler": "flow-euler" if variant == "flow-euler" else "default",
                "fault": variant if variant in ("no_exchange", "padded_keys") else None,
            })
            results[case] = (Path(specs[-1]["output"]), inputs)
        run_engine_cases(nproc, specs, work)
    return results, {**video_model_dirs, **image_to_video_dirs}


def _result(matrix, case):
    results, dirs = matrix
    output, inputs = results[case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    _, family, _, video, variant = case
    return load_file(output)["latents"], reference(dirs[family], inputs, family, video, variant)


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_video_layout_matches_single_process_diffusers(matrix, case):
    parallel, expected = _result(matrix, case)
    assert parallel.shape == expected.shape and parallel.ndim == 5
    assert torch.isfinite(parallel).all()
    error = (parallel - expected).abs().max().item()
    assert error <= TOLERANCE, f"{case_name(*case)}: max |parallel - diffusers| = {error:.3g}"


@pytest.mark.parametrize("case", CONTROLS, ids=[case_name(*c) for c in CONTROLS])
def test_negative_controls_fail_the_check(matrix, case):
    """A split whose attention misses the other shards, or sees the padding, must fail the 1e-4 check."""
    parallel, expected = _result(matrix, case)
    assert (parallel - expected).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("tokens, ring, ulysses", [(27, 1, 2), (27, 2, 2), (25, 4, 1), (9, 1, 4), (32, 2, 2)])
def test_uneven_split_pads_shards_and_keeps_only_real_keys(tokens, ring, ulysses):
    """Every rank's shard is padded to one length; unpad inverts the gather; `keep` finds the real keys."""
    split = UnevenSplit.of(tokens, ring * ulysses, ulysses)
    x = torch.arange(tokens).float().view(1, tokens, 1)
    shards = [split.shard(x, 1, r) for r in range(ring * ulysses)]
    assert {s.shape[1] for s in shards} == {split.length}
    assert torch.equal(split.unpad(torch.cat(shards, dim=1), 1), x)
    # After the Ulysses all-to-all, ring member r holds its Ulysses group's shards back to back.
    blocks = [torch.cat(shards[r * ulysses : (r + 1) * ulysses], dim=1)[0, :, 0] for r in range(ring)]
    assert torch.equal(torch.cat([block[keep] for block, keep in zip(blocks, split.keep)]), x[0, :, 0])


def test_wan22_uses_both_experts(video_model_dirs):
    """The reference would not test transformer_2 if the boundary fell outside the 4-step schedule."""
    pipeline = DiffusionPipeline.from_pretrained(video_model_dirs["wan22"])
    pipeline.scheduler.set_timesteps(STEPS)
    boundary = pipeline.config.boundary_ratio * pipeline.scheduler.config.num_train_timesteps
    high = (pipeline.scheduler.timesteps >= boundary).sum().item()
    assert 0 < high < STEPS


# -- contract E ----------------------------------------------------------------------------------
def run_engine(nproc, model_dir, inputs, output, *flags):
    return torchrun(
        nproc, "-m", "parallel.run", "--model", str(model_dir), "--inputs", str(inputs), "--output", str(output),
        "--steps", str(STEPS), "--guidance-scale", str(GUIDANCE), *flags,
    )


@pytest.mark.parametrize("family, flags, described", [
    ("wan22", ["--ulysses-degree", "2"], "WanPipeline 48x48 4 steps on 2 rank(s) [ulysses=2]"),
    ("wan22-i2v", ["--ring-degree", "2"], "WanImageToVideoPipeline 48x48 4 steps on 2 rank(s) [ring=2]"),
])
def test_contract_e_uneven_video_equals_diffusers(video_model_dirs, image_to_video_dirs, tmp_path, family, flags,
                                                   described):
    model = {**video_model_dirs, **image_to_video_dirs}[family]
    frames, height, width = VIDEOS["uneven"]
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs(family, height=height, width=width, num_frames=frames), inputs)
    run = run_engine(2, model, inputs, output, "--height", str(height), "--width", str(width),
                     "--num-frames", str(frames), *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    assert described in run.stdout
    expected = reference(model, inputs, family, "uneven", "default")
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


def test_contract_e_takes_a_family_call_parameter(video_model_dirs, tmp_path):
    """`--call guidance_scale_2=...` (Wan 2.2's low-noise expert) reaches the pipeline: equal to diffusers with it."""
    model = video_model_dirs["wan22"]
    frames, height, width = VIDEOS["even"]
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs("wan22", height=height, width=width, num_frames=frames), inputs)
    run = run_engine(2, model, inputs, output, "--height", str(height), "--width", str(width), "--cfg-parallel",
                     "--call", "guidance_scale_2=2.0")
    assert run.returncode == 0, run.stderr[-3000:]
    latents = load_file(output)["latents"]
    assert (latents - reference(model, inputs, "wan22", "even", "guidance2")).abs().max().item() <= TOLERANCE
    assert (latents - reference(model, inputs, "wan22", "even", "default")).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize(
    "nproc, video, flags, message",
    [
        (3, (5, 64, 64), ["--ulysses-degree", "3"], "4 attention heads, which do not split over ulysses degree 3"),
        (2, (1, 16, 16), ["--ring-degree", "2"], "1 latent frames at 16x16 give 1 video tokens, fewer than the sequence-parallel degree 2"),
        (2, (5, 64, 64), ["--ulysses-degree", "2", "--num-frames", "9"], "latents have 2 latent frames but num_frames 9 needs 3"),
        (2, (5, 64, 64), ["--ulysses-degree", "2", "--height", "72"], "height 72 is not a multiple of 16"),
        (2, (5, 64, 64), ["--ulysses-degree", "2", "--true-cfg-scale", "2"],
         "WanPipeline does not take true_cfg_scale; it takes guidance_scale_2, num_frames"),
    ],
    ids=["heads", "tokens", "frames", "size", "call"],
)
def test_bad_video_layout_fails_early_with_one_line(video_model_dirs, tmp_path, nproc, video, flags, message):
    frames, height, width = video
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs("wan", height=height, width=width, num_frames=frames), inputs)
    size = ["--height", str(height), "--width", str(width)] if "--height" not in flags else ["--width", str(width)]
    run = run_engine(nproc, video_model_dirs["wan"], inputs, output, *size, *flags)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert message in errors[0]
    assert not output.exists()
