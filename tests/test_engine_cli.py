"""Contract E (`torchrun -m parallel.run`, or `python -m parallel.run --nproc-per-node N`): a real run, layouts that
must fail before compute, and the exit status each launch gives."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest
from safetensors.torch import load_file, save_file

from parallel.cli.launch import ROOT, rank_environment
from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun


@pytest.fixture(scope="module")
def pixart_inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "in.safetensors"
    save_file(tiny_models.make_inputs("pixart-alpha"), path)
    return path


def engine_arguments(model_dir, inputs, output, *flags, steps: int = 4) -> list[str]:
    return ["--model", str(model_dir), "--inputs", str(inputs), "--output", str(output), "--steps", str(steps),
            "--height", "64", "--width", "64", *flags]


def run_engine(nproc, model_dir, inputs, output, *flags, launcher: str = "torchrun"):
    """Contract E under torchrun, or started by itself (`--nproc-per-node`, launcher="own")."""
    arguments = engine_arguments(model_dir, inputs, output, *flags)
    if launcher == "torchrun":
        return torchrun(nproc, "-m", "parallel.run", *arguments)
    return subprocess.run([sys.executable, "-m", "parallel.run", "--nproc-per-node", str(nproc), *arguments], cwd=ROOT,
                          env=rank_environment(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("launcher", ["torchrun", "own"])
def test_contract_e_ulysses2_equals_diffusers(tiny_model_dirs, pixart_inputs, tmp_path, launcher):
    output = tmp_path / "out.safetensors"
    run = run_engine(2, tiny_model_dirs["pixart-alpha"], pixart_inputs, output, "--guidance-scale", "4.5",
                     "--ulysses-degree", "2", launcher=launcher)
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


@pytest.mark.parametrize("nproc, flags, message", [
    (2, ["--ulysses-degree", "2", "--ring-degree", "2"], "ring 2 × ulysses 2 = 4, but there are 2 ranks"),  # the launcher's
    (3, ["--ulysses-degree", "3"], "4 attention heads, which do not split over ulysses degree 3"),  # the ranks'
], ids=["seen-before-ranks-start", "seen-by-the-ranks"])
def test_a_refusal_started_by_itself_exits_2_with_one_line(tiny_model_dirs, pixart_inputs, tmp_path, nproc, flags,
                                                           message):
    """Where torchrun can only say 137 (its agent stopped) or 1 with its traceback, contract E started by itself
    exits 2, the status a mistake has everywhere else, with the one line and no traceback."""
    output = tmp_path / "out.safetensors"
    run = run_engine(nproc, tiny_model_dirs["pixart-alpha"], pixart_inputs, output, *flags, launcher="own")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(errors) == 1 and message in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and not output.exists()


@pytest.mark.parametrize("killed", ["a rank", "the launcher"])
def test_a_signal_ends_the_run_as_that_signal_and_leaves_no_rank(tiny_model_dirs, pixart_inputs, tmp_path, killed):
    """A rank killed by SIGKILL (an out-of-memory kill, say) ends the run with 128 + 9, the other ranks stopped; a
    SIGTERM to the launcher ends every rank and the run with 128 + 15. A signal exit means a signal."""
    arguments = engine_arguments(tiny_model_dirs["pixart-alpha"], pixart_inputs, tmp_path / "out.safetensors",
                                 "--guidance-scale", "4.5", "--ulysses-degree", "2", steps=1000)
    launcher = subprocess.Popen([sys.executable, "-m", "parallel.run", "--nproc-per-node", "2", *arguments], cwd=ROOT,
                                env=rank_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ranks = []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and time.monotonic() < deadline:
        ranks = psutil.Process(launcher.pid).children()
        time.sleep(0.2)
    time.sleep(8)  # both ranks load the model and sample
    if killed == "a rank":
        ranks[1].send_signal(signal.SIGKILL)
    else:
        launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == (128 + 9 if killed == "a rank" else 128 + 15), stderr[-3000:]
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


def test_a_job_that_fails_exits_1(tiny_model_dirs, pixart_inputs, tmp_path):
    """Not a mistake in the command but a failure while the job runs (a weights file cut short on disk): exit 1."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["pixart-alpha"], model)
    weights = next((model / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    run = run_engine(2, model, pixart_inputs, tmp_path / "out.safetensors", "--guidance-scale", "4.5",
                     "--ulysses-degree", "2", launcher="own")
    assert run.returncode == 1, run.stderr[-3000:]
