"""Contract E (`torchrun -m parallel.run`): a real run, and layouts that must fail before compute."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun


@pytest.fixture(scope="module")
def pixart_inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "in.safetensors"
    save_file(tiny_models.make_inputs("pixart-alpha"), path)
    return path


def run_engine(nproc, model_dir, inputs, output, *flags):
    return torchrun(
        nproc, "-m", "parallel.run", "--model", str(model_dir), "--inputs", str(inputs), "--output", str(output),
        "--steps", "4", "--height", "64", "--width", "64", *flags,
    )


def test_contract_e_ulysses2_equals_diffusers(tiny_model_dirs, pixart_inputs, tmp_path):
    output = tmp_path / "out.safetensors"
    run = run_engine(2, tiny_model_dirs["pixart-alpha"], pixart_inputs, output, "--guidance-scale", "4.5", "--ulysses-degree", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 rank(s) [ulysses=2]" in run.stdout
    expected = diffusers_latents(tiny_model_dirs["pixart-alpha"], "pixart-alpha", **load_file(pixart_inputs),
                                 num_inference_steps=4, guidance_scale=4.5, height=64, width=64)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize(
    "nproc, flags, message",
    [
        (2, ["--ulysses-degree", "2", "--ring-degree", "2"], "ring 2 × ulysses 2 = 4, but there are 2 ranks"),
        (3, ["--ulysses-degree", "3"], "4 attention heads, which do not split over ulysses degree 3"),
        (3, ["--ring-degree", "3"], "gives 16 image tokens, which do not split over sequence-parallel degree 3"),
        (2, ["--cfg-parallel", "--guidance-scale", "1.0"], "CFG parallel needs classifier-free guidance"),
        (2, ["--pipefusion-degree", "2", "--num-patches", "3"], "has 4 token rows, which do not split into 3 PipeFusion"),
        (2, ["--pipefusion-degree", "2", "--warmup-steps", "0"], "PipeFusion needs at least 1 synchronous step"),
    ],
    ids=["product", "heads", "tokens", "cfg-without-guidance", "patches", "no-warmup"],
)
def test_bad_layout_fails_early_with_one_line(tiny_model_dirs, pixart_inputs, tmp_path, nproc, flags, message):
    output = tmp_path / "out.safetensors"
    run = run_engine(nproc, tiny_model_dirs["pixart-alpha"], pixart_inputs, output, *flags)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert message in errors[0]
    assert not output.exists()
