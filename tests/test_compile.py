"""`--compile`: torch.compile of every transformer block keeps the engine exact, with its breaks counted.

Contract E on 2 ranks with Ulysses 2 and --compile equals diffusers' single-process pipeline within 1e-4
(inductor on CPU), and reports its compiled graphs and graph breaks: sequence-parallel attention runs
eagerly between compiled regions (torch.compiler.disable at the seam), so nothing recompiles per call.
The 2026 families compiled, in one engine_cases launch: Krea 2 (its joined [text; image] split unevenly) and
Qwen-Image 2.1 (its first step with the prefix, the later ones the image's tokens alone against the cached prefix
K/V: two shapes per block) under Ulysses 2 with guidance equal diffusers too.
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
def compiled_2026(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("compile")
    for family in FAMILIES_2026:
        save_file(tiny_models.make_inputs(family), work / f"{family}-in.safetensors")
    run_engine_cases(2, [{"name": family, "model": str(tiny_model_dirs[family]), "inputs": str(work / f"{family}-in.safetensors"),
                          "output": str(work / f"{family}.safetensors"), "layout": {"ulysses_degree": 2, "compile": True},
                          "call": {**CALL, **call}} for family, call in FAMILIES_2026.items()], work)
    return work


@pytest.mark.parametrize("family", FAMILIES_2026)
def test_compiled_2026_families_equal_diffusers(compiled_2026, tiny_model_dirs, family):
    output = compiled_2026 / f"{family}.safetensors"
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    expected = diffusers_latents(tiny_model_dirs[family], family, **load_file(compiled_2026 / f"{family}-in.safetensors"),
                                 **CALL, **FAMILIES_2026[family])
    error = (load_file(output)["latents"] - expected).abs().max().item()
    assert error <= TOLERANCE, f"{family}: max |compiled ulysses2 - diffusers| = {error:.3g}"
