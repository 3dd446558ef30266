"""`--compile`: torch.compile of every transformer block keeps the engine exact, with its breaks counted.

Contract E on 2 ranks with Ulysses 2 and --compile equals diffusers' single-process pipeline within 1e-4
(inductor on CPU), and reports its compiled graphs and graph breaks: sequence-parallel attention runs
eagerly between compiled regions (torch.compiler.disable at the seam), so nothing recompiles per call.
"""

from __future__ import annotations

import re

from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun

FAMILY = "flux"


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
