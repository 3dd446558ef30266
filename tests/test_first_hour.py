"""The first hour of a new user: the CLI, contract E and the demo, as typed from the README.

Every mistake ends in one `error:` line naming the cause and the fix, a non-zero exit and no
traceback; successful runs print no traceback either; a pool that says it started takes the next
job; and the README's walkthrough runs verbatim.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file, save_file

from parallel.loading import builtin_models, tiny_models

from xdit_test_helpers import ROOT, TOLERANCE
from pool_helpers import free_endpoint

TINY = "xdit-tiny-pixart-alpha"
SMALL = ["--steps", "2", "--height", "64", "--width", "64"]


def run(*command: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "XDIT_THREADS_PER_RANK": "1", **(env or {})}
    return subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "parallel.run", *args)


def one_shot(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run("-m", "workers", "sample", "--model", TINY, "--nproc", "2", "--ulysses-degree", "2",
               "--threads-per-rank", "1", *args, env=env)


def assert_no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-4000:]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("first_hour")
    save_file(tiny_models.make_inputs("pixart-alpha"), work / "in.safetensors")
    (work / "not-a-pipeline").mkdir()
    (work / "not-safetensors.safetensors").write_text("hello")
    return work


MISTAKES = {
    # name: (command builder(work) -> argv, words the one error line must hold)
    "cli-missing-model-path": (
        lambda w: ["-m", "workers", "sample", "--model", str(w / "nope"), "--nproc", "2", "--inputs", str(w / "in.safetensors"),
                   "--output", str(w / "o.safetensors")], ["no such file or folder", "built-in tiny model"]),
    "cli-folder-not-a-pipeline": (
        lambda w: ["-m", "workers", "sample", "--model", str(w / "not-a-pipeline"), "--inputs", str(w / "in.safetensors"),
                   "--output", str(w / "o.safetensors")], ["not a diffusers pipeline folder", "model_index.json"]),
    "cli-unknown-builtin-name": (
        lambda w: ["-m", "workers", "sample", "--model", "xdit-tiny-pixart", "--prompt", "x", "--output", str(w / "o.png")],
        ["not a built-in model", TINY]),
    "cli-degree-product": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--nproc", "2", "--ulysses-degree", "4", "--prompt", "x",
                   "--output", str(w / "o.png")], ["= 4, but there are 2 ranks", "--nproc)"]),
    "cli-heads-do-not-split": (  # refused by the pool's own check at submit, not before it starts
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--nproc", "3", "--ulysses-degree", "3", "--threads-per-rank",
                   "1", "--inputs", str(w / "in.safetensors"), "--output", str(w / "o.safetensors"), *SMALL],
        ["4 attention heads, which do not split over ulysses degree 3", "--ring-degree"]),
    "cli-shard-weights-with-fp8": (  # refused by the ranks as they load: the pool stops before any job
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--nproc", "2", "--ulysses-degree", "2", "--shard-weights",
                   "--dtype", "fp8", "--threads-per-rank", "1", "--inputs", str(w / "in.safetensors"), "--output",
                   str(w / "o.safetensors"), *SMALL], ["failed to start", "does not work with --dtype fp8", "bf16"]),
    "cli-vae-beside-a-pipeline": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--vae", str(w / "in.safetensors"), "--prompt", "x",
                   "--output", str(w / "o.png")], ["--vae goes with a single-file checkpoint", "drop --vae"]),
    "engine-missing-vae-file": (
        lambda w: ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "parallel.run", "--model", TINY,
                   "--vae", str(w / "wan_2.1_vae.safetensors"), "--inputs", str(w / "in.safetensors"),
                   "--output", str(w / "o.safetensors"), *SMALL], ["--vae", "no such file", "models/vae"]),
    "cli-missing-inputs-file": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--inputs", str(w / "missing.safetensors"),
                   "--output", str(w / "o.safetensors")], ["no such file", "parallel.make_inputs"]),
    "cli-no-inputs-nor-prompt": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--output", str(w / "o.png")], ["--inputs", "--prompt", "--help"]),
    "cli-image-without-prompt": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--inputs", str(w / "in.safetensors"), "--image",
                   str(w / "in.safetensors"), "--output", str(w / "o.safetensors")], ["--image goes with --prompt", "`image`"]),
    "cli-image-missing": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--prompt", "x", "--image", str(w / "nope.png"),
                   "--output", str(w / "o.safetensors")], ["--image", "nope.png: no such file"]),
    "cli-image-not-a-picture": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--prompt", "x", "--image", str(w / "in.safetensors"),
                   "--output", str(w / "o.safetensors")], ["in.safetensors: not a picture"]),
    "cli-wrong-output-suffix": (
        lambda w: ["-m", "workers", "sample", "--model", TINY, "--prompt", "x", "--output", str(w / "o.jpg")],
        [".safetensors", ".png"]),
    "cli-sample-nothing-listening": (
        lambda w: ["-m", "workers", "sample", "--endpoint", free_endpoint(), "--prompt", "x", "--output", str(w / "o.png")],
        ["nothing is listening", "workers serve"]),
    "cli-stop-nothing-listening": (
        lambda w: ["-m", "workers", "stop", "--endpoint", free_endpoint()], ["nothing is listening", "workers serve"]),
    "cli-status-nothing-listening": (
        lambda w: ["-m", "workers", "status", "--endpoint", free_endpoint()], ["nothing is listening", "workers serve"]),
    "engine-degree-product": (
        lambda w: ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "parallel.run", "--model", TINY,
                   "--inputs", str(w / "in.safetensors"), "--output", str(w / "o.safetensors"), *SMALL, "--ring-degree", "4"],
        ["= 4, but there are 2 ranks", "--nproc-per-node)"]),
    "engine-missing-inputs-file": (
        lambda w: ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "parallel.run", "--model", TINY,
                   "--inputs", str(w / "missing.safetensors"), "--output", str(w / "o.safetensors"), *SMALL],
        ["no such file", "parallel.make_inputs"]),
    "engine-inputs-not-safetensors": (
        lambda w: ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "parallel.run", "--model", TINY,
                   "--inputs", str(w / "not-safetensors.safetensors"), "--output", str(w / "o.safetensors"), *SMALL,
                   "--ulysses-degree", "2"],
        ["not a safetensors file", "parallel.make_inputs"]),
    "engine-missing-model-path": (
        lambda w: ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "parallel.run",
                   "--model", str(w / "nope"), "--inputs", str(w / "in.safetensors"), "--output", str(w / "o.safetensors")],
        ["no such file or folder"]),
    "engine-missing-required-flag": (
        lambda w: ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "parallel.run", "--model", TINY],
        ["--inputs and --output are required", "--help"]),
    "demo-heads-do-not-split": (
        lambda w: ["-m", "parallel.demo", "--nproc", "3", "--size", "64", "--out", str(w / "demo3")],
        ["do not split over ulysses degree 3", "--ring-degree"]),
    "demo-unknown-family": (
        lambda w: ["-m", "parallel.demo", "--family", "sdxl", "--out", str(w / "demo")], ["invalid choice", "--help"]),
    "make-inputs-missing-model": (
        lambda w: ["-m", "parallel.make_inputs", "--model", str(w / "nope"), "--prompt", "x", "--out", str(w / "i.safetensors")],
        ["no such file or folder"]),
}


UNREACHABLE = {"cli-sample-nothing-listening", "cli-stop-nothing-listening", "cli-status-nothing-listening"}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_mistake_ends_in_one_error_line_without_traceback(work, name):
    build, words = MISTAKES[name]
    result = run(*build(work))
    assert result.returncode != 0
    if name.startswith("cli-"):  # the pool CLI: 2 for a mistake, 1 for a pool it cannot reach (contract E: see README)
        assert result.returncode == (1 if name in UNREACHABLE else 2), (result.returncode, result.stderr[-2000:])
    assert_no_traceback(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stdout[-2000:] + result.stderr[-4000:]
    for word in words:
        assert word in errors[0], errors[0]


def test_demo_takes_the_ring_degree_it_suggests_and_times_warm_runs(work):
    result = run("-m", "parallel.demo", "--nproc", "2", "--ring-degree", "2", "--size", "64", "--steps", "2",
                 "--out", str(work / "demo-ring"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert_no_traceback(result)
    assert "[ring=2]" in result.stdout
    assert "warm sampling, 1 thread per process" in result.stdout and "noise, not pictures" in result.stdout
    difference = float(re.search(r"max \|parallel - diffusers\| = (\S+)", result.stdout).group(1))
    assert difference <= TOLERANCE
    assert (work / "demo-ring" / "pixart-alpha.png").is_file()


def test_one_shot_sample_from_a_prompt_equals_diffusers_and_prints_no_traceback(work):
    """--prompt/--seed encode on the pool exactly as the pipeline's own __call__(prompt=…, generator=…) does."""
    output = work / "fox.safetensors"
    result = one_shot("--prompt", "a red fox", "--negative-prompt", "blurry", "--seed", "7", "--output", str(output),
                      "--steps", "2", "--guidance-scale", "4.5", "--height", "64", "--width", "64")
    assert result.returncode == 0, result.stderr[-4000:]
    assert_no_traceback(result)
    pipeline = DiffusionPipeline.from_pretrained(builtin_models.resolve_model(TINY))
    with torch.no_grad():
        expected = pipeline(prompt="a red fox", negative_prompt="blurry", generator=torch.Generator().manual_seed(7),
                            num_inference_steps=2, guidance_scale=4.5, height=64, width=64, use_resolution_binning=False,
                            output_type="latent", return_dict=False)[0]
        other_seed = pipeline(prompt="a red fox", negative_prompt="blurry", generator=torch.Generator().manual_seed(8),
                              num_inference_steps=2, guidance_scale=4.5, height=64, width=64, use_resolution_binning=False,
                              output_type="latent", return_dict=False)[0]
    latents = load_file(output)["latents"]
    assert (latents - expected).abs().max().item() <= TOLERANCE
    assert (latents - other_seed).abs().max().item() > 1e-2  # negative control: the seed matters


def test_make_inputs_then_contract_e_equals_diffusers_from_the_prompt(work):
    inputs, output = work / "sd3-in.safetensors", work / "sd3-out.safetensors"
    made = run("-m", "parallel.make_inputs", "--model", "xdit-tiny-sd3", "--prompt", "a blue car", "--seed", "3",
               "--height", "64", "--width", "64", "--out", str(inputs))
    assert made.returncode == 0, made.stderr[-3000:]
    assert "prompt_embeds [1, " in made.stdout
    result = torchrun(2, "--model", "xdit-tiny-sd3", "--inputs", str(inputs), "--output", str(output), "--steps", "2",
                      "--guidance-scale", "4.5", "--height", "64", "--width", "64", "--ring-degree", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_traceback(result)
    pipeline = DiffusionPipeline.from_pretrained(builtin_models.resolve_model("xdit-tiny-sd3"))
    with torch.no_grad():
        expected = pipeline(prompt="a blue car", generator=torch.Generator().manual_seed(3), num_inference_steps=2,
                            guidance_scale=4.5, height=64, width=64, output_type="latent", return_dict=False)[0]
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", ["flux2-klein", "flux2-dev", "flux-kontext", "qwen-image-edit", "z-image"])
def test_make_inputs_for_the_newer_families_equal_the_pipeline_from_the_prompt(work, family):
    """make_inputs' tensors (the Qwen-Image-Edit prompts encoded with their --image, its latents as `image`) give
    what diffusers' pipeline gives from the prompt strings, the picture and the seed; another seed misses."""
    import numpy as np
    import PIL.Image

    from xdit_test_helpers import diffusers_latents, diffusers_with_reference_latents, load_pipeline_folder

    inputs, picture = work / f"{family}-in.safetensors", None
    # FLUX.2's pipelines take no negative prompt ([klein] always encodes "", [dev] has no CFG)
    negative = "" if family.startswith("flux2") else "blurry"
    command = ["-m", "parallel.make_inputs", "--model", f"xdit-tiny-{family}", "--prompt", "a blue car", "--negative-prompt",
               negative, "--seed", "3", "--height", "64", "--width", "64", "--out", str(inputs)]
    if family == "qwen-image-edit":
        picture = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8))
        picture.save(work / "picture.png")
        command += ["--image", str(work / "picture.png")]
    made = run(*command)
    assert made.returncode == 0, made.stderr[-3000:]
    tensors = load_file(inputs)
    folder = builtin_models.resolve_model(f"xdit-tiny-{family}")
    pipeline = load_pipeline_folder(folder)
    call = {"num_inference_steps": 2, "height": 64, "width": 64}
    strings = {"prompt": "a blue car", **({"negative_prompt": negative} if negative else {}),
               **({"image": picture} if picture else {})}
    if picture:
        from_inputs = diffusers_with_reference_latents(folder, family, tensors.pop("image"), **tensors, **call)
    else:
        from_inputs = diffusers_latents(pipeline, family, **tensors, **call)
    expected = diffusers_latents(pipeline, family, **strings, generator=torch.Generator().manual_seed(3), **call)
    other_seed = diffusers_latents(pipeline, family, **strings, generator=torch.Generator().manual_seed(4), **call)
    assert (from_inputs - expected).abs().max().item() <= TOLERANCE
    assert (from_inputs - other_seed).abs().max().item() > 100 * TOLERANCE


def test_one_shot_edit_from_a_prompt_and_a_picture_equals_diffusers(work):
    """`sample --prompt --image` on a Qwen-Image-Edit pool (Ulysses 2): both prompts encoded with the picture on the
    pool, its latents the reference, the seed's noise: diffusers' pipeline from the strings and the picture."""
    import numpy as np
    import PIL.Image

    from xdit_test_helpers import diffusers_latents, load_pipeline_folder

    picture = PIL.Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    picture.save(work / "edit-me.png")
    output = work / "edited.safetensors"
    result = run("-m", "workers", "sample", "--model", "xdit-tiny-qwen-image-edit", "--nproc", "2", "--ulysses-degree", "2",
                 "--prompt", "a blue car", "--negative-prompt", "blurry", "--image", str(work / "edit-me.png"), "--seed", "3",
                 "--steps", "2", "--height", "64", "--width", "64", "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    pipeline = load_pipeline_folder(builtin_models.resolve_model("xdit-tiny-qwen-image-edit"))
    expected = diffusers_latents(pipeline, "qwen-image-edit", prompt="a blue car", negative_prompt="blurry", image=picture,
                                 generator=torch.Generator().manual_seed(3), num_inference_steps=2, height=64, width=64)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE
    mirrored = diffusers_latents(pipeline, "qwen-image-edit", prompt="a blue car", negative_prompt="blurry",
                                 image=picture.transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT),
                                 generator=torch.Generator().manual_seed(3), num_inference_steps=2, height=64, width=64)
    assert (load_file(output)["latents"] - mirrored).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("family", ["qwen-image", "flux2-klein", "flux2-dev", "z-image", "flux", "sd3"])
def test_png_output_is_the_pipelines_own_decode(work, family):
    """`--output x.png` decodes the latents a job returns as the pipeline itself decodes them (each VAE kind:
    AutoencoderKL's scale and shift, Qwen-Image's per-channel statistics, FLUX.2's batch norm and patches):
    within one 8-bit level of diffusers' own `output_type="np"`; other latents miss by far more."""
    import numpy as np
    import PIL.Image

    from parallel.cli.decode import decode_to_png
    from xdit_test_helpers import at_requested_size, diffusers_latents, load_pipeline_folder

    folder = builtin_models.resolve_model(f"xdit-tiny-{family}")
    pipeline = load_pipeline_folder(folder)
    call = {**tiny_models.make_inputs(family, negative=tiny_models.MODELS[family].cfg), "num_inference_steps": 2,
            "height": 64, "width": 64}
    latents = diffusers_latents(pipeline, family, **call)
    with torch.no_grad():
        expected = pipeline(**tiny_models.PIPELINE_CALL_DEFAULTS.get(family, {}), **at_requested_size(pipeline, call),
                            output_type="np", return_dict=False)[0][0]
    for name, tensor in (("same", latents), ("other", latents.flip(-1))):
        decode_to_png(folder, tensor, 64, 64, work / f"{family}-{name}.png")
    same, other = (np.asarray(PIL.Image.open(work / f"{family}-{name}.png"), dtype=np.int16) for name in ("same", "other"))
    reference = np.round(expected * 255).astype(np.int16)
    assert np.abs(same - reference).max() <= 1
    assert np.abs(other - reference).max() > 10


SLOW_IDLE_HOOK = '''
import os
if os.environ.get("RANK") == "0" and os.environ.get("XDIT_TEST_SLOW_IDLE"):
    import time
    import torch.distributed as dist

    _barrier = dist.barrier

    def barrier(*args, **kwargs):  # rank 0 takes longer after the world barrier than the other ranks
        result = _barrier(*args, **kwargs)
        time.sleep(float(os.environ["XDIT_TEST_SLOW_IDLE"]))
        return result

    dist.barrier = barrier
'''


def test_a_pool_that_says_it_started_takes_the_next_job(work, tmp_path):
    """Rank 0 is slow between the world barrier and taking jobs: Pool.start() must still wait for it.
    (Before the fix, every rank said ready before the barrier and this job got 'still loading'.)"""
    (tmp_path / "sitecustomize.py").write_text(SLOW_IDLE_HOOK)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]), "XDIT_TEST_SLOW_IDLE": "3"}
    result = one_shot("--inputs", str(work / "in.safetensors"), "--output", str(work / "slow.safetensors"), *SMALL, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "still loading" not in result.stderr


def test_25_consecutive_one_shot_samples_all_succeed(work):
    """The cheapest one-shot job (tiny model, 2 ranks, 64×64, two steps): each run's time is torchrun's and
    the ranks' start-up (imports, process group, model load), not sampling."""
    for attempt in range(25):
        result = one_shot("--inputs", str(work / "in.safetensors"), "--output", str(work / "o25.safetensors"), *SMALL)
        assert result.returncode == 0, f"run {attempt}: {result.stderr[-4000:]}"
        assert_no_traceback(result)


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- walkthrough -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no walkthrough block"
    return block.group(1)


def test_the_readme_walkthrough_runs_verbatim(tmp_path):
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    script = "set -euo pipefail\n" + walkthrough()
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    assert_no_traceback(result)
    assert (ROOT / "out" / "fox.png").is_file()
    assert "state: idle" in result.stdout and "cancelled" in result.stderr
    assert "xdit pool stopped" in result.stdout
