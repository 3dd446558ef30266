"""`--compile`: torch.compile of every transformer block keeps the engine exact, with its breaks counted.

Contract E on 2 ranks with Ulysses 2 and --compile equals diffusers' single-process pipeline within 1e-4
(inductor on CPU), and reports its compiled graphs and graph breaks: sequence-parallel attention runs
eagerly between compiled regions (torch.compiler.disable at the seam), so nothing recompiles per call.
The 2026 families compiled, in one engine_cases launch: Krea 2 (its joined [text; image] split unevenly) and
Qwen-Image 2.1 (its first step with the prefix, the later ones the image's tokens alone against the cached prefix
K/V: two shapes per block) under Ulysses 2 with guidance equal diffusers too, and in the same launch the two families
with sound, video and audio each: LTX-2 with all its guidance terms (a batched CFG call and two one-branch calls a
step, STG's perturbed block among them) and MiniMax-H3's packed sequence split unevenly.
"""

from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases, torchrun

FAMILY = "flux"
FAMILIES_2026 = {"krea2": {"guidance_scale": 3.0}, "qwen-image-2.1": {"true_cfg_scale": 4.0}}
CALL = {"num_inference_steps": 4, "height": 64, "width": 64}


def test_compiled_ulysses2_equals_diffusers_and_counts_its_graph_breaks(tiny_model_dirs, tmp_path):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs(FAMILY), inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(tiny_model_dirs[FAMILY]), "--inputs", str(inputs),
                   "--output", str(output), "--steps", "4", "--guidance-scale", "3.5", "--height", "64", "--width", "64",
                   "--ulysses-degree", "2", "--compile")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[ulysses=2, compiled]" in run.stdout
    summary = re.search(r"xdit: compiled: (\d+) graphs, (\d+) graph breaks", run.stdout)
    assert summary and int(summary[1]) > 0, run.stdout
    assert "recompile_limit" not in run.stderr  # the seam's group state is never guarded on
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(inputs), num_inference_steps=4,
                                 guidance_scale=3.5, height=64, width=64)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


@pytest.fixture(scope="module")
def compiled_2026(tiny_model_dirs, video_model_dirs, tmp_path_factory):
    """The 2026 families and the two with sound, compiled under Ulysses 2 in one launch."""
    work = tmp_path_factory.mktemp("compile")
    specs = []
    for family, (model, size, call) in {
            **{family: (tiny_model_dirs[family], {}, {**CALL, **call}) for family, call in FAMILIES_2026.items()},
            **{family: (video_model_dirs[family], size, call) for family, (size, call) in _av_cases().items()}}.items():
        save_file(tiny_models.make_inputs(family, **size), work / f"{family}-in.safetensors")
        specs.append({"name": family, "model": str(model), "inputs": str(work / f"{family}-in.safetensors"),
                      "output": str(work / f"{family}.safetensors"), "layout": {"ulysses_degree": 2, "compile": True},
                      "call": call})
    run_engine_cases(2, specs, work)
    return work


def _av_cases() -> dict:
    """LTX-2 with every guidance term (three calls a step, STG's perturbed block) and MiniMax-H3, as their tests run
    them: {family: (input sizes, call)}."""
    import test_ltx2
    import test_minimax_h3

    return {"ltx2": ({"height": test_ltx2.HEIGHT, "width": test_ltx2.WIDTH, "num_frames": test_ltx2.FRAMES},
                     test_ltx2.CALL),
            "minimax-h3": ({"height": test_minimax_h3.SIZE, "width": test_minimax_h3.SIZE,
                            "num_frames": test_minimax_h3.FRAMES}, test_minimax_h3.CALL)}


@pytest.mark.parametrize("family", FAMILIES_2026)
def test_compiled_2026_families_equal_diffusers(compiled_2026, tiny_model_dirs, family):
    output = compiled_2026 / f"{family}.safetensors"
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    expected = diffusers_latents(tiny_model_dirs[family], family, **load_file(compiled_2026 / f"{family}-in.safetensors"),
                                 **CALL, **FAMILIES_2026[family])
    error = (load_file(output)["latents"] - expected).abs().max().item()
    assert error <= TOLERANCE, f"{family}: max |compiled ulysses2 - diffusers| = {error:.3g}"


@pytest.mark.parametrize("family", ["ltx2", "minimax-h3"])
def test_compiled_video_with_sound_equals_diffusers(compiled_2026, video_model_dirs, family):
    """Video and audio each equal diffusers' own pipeline (LTX2Pipeline; MiniMax-H3's modular pipeline)."""
    import test_ltx2
    import test_minimax_h3

    output, inputs = compiled_2026 / f"{family}.safetensors", compiled_2026 / f"{family}-in.safetensors"
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    if family == "ltx2":
        expected = test_ltx2.reference(video_model_dirs[family], inputs)
    else:
        expected = test_minimax_h3.reference(video_model_dirs[family], load_file(inputs))
    saved = load_file(output)
    for name, tensor in zip(("latents", "audio"), expected):
        error = (saved[name] - tensor).abs().max().item()
        assert error <= TOLERANCE, f"{family} {name}: max |compiled ulysses2 - diffusers| = {error:.3g}"
