"""bf16, and fp8 storage with bf16 compute, as users run them: every tiny model through contract E (`--dtype bf16`,
`--dtype fp8`) on 2 ranks (Ulysses 2 or Ring 2), and one model of every family module through a 2-rank pool, against
diffusers' own single-process pipeline.

In bf16 nothing is exact, so the bound is diffusers' own error: the relative L2 distance of our result from
diffusers' fp32 result must be at most FACTOR times that of diffusers' own bf16 run on the same inputs (for fp8:
diffusers' own fp8 storage, `enable_layerwise_casting` with bf16 compute, as the engine loads it). Measured
ratios are 0.90–1.06 (Ulysses computes what one process computes; Ring merges partial results in another order). The negative controls, a rank
whose input shards carry noise of 1/8 of their RMS (tests/contract_e_cases.py's "perturbed_shard", 2.8–4.3 times
diffusers' own error), must miss that bound.

Contract E's cases run in one torchrun launch through contract E's own `main` (tests/contract_e_cases.py); one
more case runs as users type it, `torchrun -m parallel.run --dtype bf16`, to show the launch path is the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import ClassifierFreeGuidance
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from pool_helpers import serving
from xdit_test_helpers import diffusers_latents, is_modular, load_pipeline_folder, torchrun

FACTOR = 1.5  # our relative L2 from fp32 may be at most this many times diffusers' own in the same dtype
STEPS = 4
ULYSSES2, RING2 = ("--ulysses-degree", "2"), ("--ring-degree", "2")
# model: (2-rank layout, frames or None, height = width); every family module in parallel/families/ appears
MODELS = {
    "flux": (ULYSSES2, None, 64), "flux-kontext": (RING2, None, 64), "flux2-klein": (ULYSSES2, None, 64),
    "flux2-dev": (RING2, None, 64), "pixart-alpha": (ULYSSES2, None, 64), "pixart-sigma": (RING2, None, 64),
    "qwen-image": (RING2, None, 64), "qwen-image-edit": (ULYSSES2, None, 64),
    "qwen-image-edit-plus": (RING2, None, 64), "sd3": (ULYSSES2, None, 64), "z-image": (ULYSSES2, None, 64),
    "wan": (ULYSSES2, 5, 64), "wan22": (RING2, 5, 64), "wan22-5b": (ULYSSES2, 5, 128),
    "hunyuanvideo15": (ULYSSES2, 5, 64), "ltx2": (ULYSSES2, 17, 64), "ltx2-i2v": (RING2, 17, 64),
    "ltx2-condition": (ULYSSES2, 17, 64), "ltx2-ic": (RING2, 17, 64),
    "flux3": (ULYSSES2, None, 64), "flux3-distilled": (RING2, None, 64), "krea2": (ULYSSES2, None, 64),
    "qwen-image-2.1": (RING2, None, 64), "minimax-h3": (RING2, 124, 64),
}
assert set(MODELS) == set(tiny_models.FAMILIES + tiny_models.VIDEO_FAMILIES), "a family without a bf16 case"
DTYPES = ("bf16", "fp8")
CASES = [(model, dtype) for model in MODELS for dtype in DTYPES]
CONTROLS = [("flux", "bf16"), ("qwen-image", "bf16"), ("wan", "fp8")]  # (Ulysses 2, Ring 2, video in fp8)
# One pool per family module (a pool serves one model and starts in ~10 s), bf16 and fp8 alternating
POOLS = [("flux", "bf16"), ("flux2-klein", "fp8"), ("pixart-sigma", "bf16"), ("qwen-image-edit", "bf16"), ("sd3", "fp8"),
         ("z-image", "bf16"), ("wan22", "fp8"), ("hunyuanvideo15", "bf16"), ("flux3", "bf16"),
         ("krea2", "fp8"), ("qwen-image-2.1", "bf16"), ("ltx2", "fp8"), ("minimax-h3", "bf16")]


def call_of(model: str) -> dict:
    _, frames, size = MODELS[model]
    tiny = tiny_models.MODELS[model]
    return {"num_inference_steps": STEPS, "guidance_scale": tiny.guidance, "height": size, "width": size,
            **({"num_frames": frames} if frames else {})}


def argv_of(model: str, dtype: str, model_dir: Path, inputs: Path, output: Path) -> list[str]:
    call = call_of(model)
    frames = ["--num-frames", str(call["num_frames"])] if "num_frames" in call else []
    return ["--model", str(model_dir), "--inputs", str(inputs), "--output", str(output), "--dtype", dtype,
            "--steps", str(STEPS), "--guidance-scale", str(call["guidance_scale"]), "--height", str(call["height"]),
            "--width", str(call["width"]), *frames, *MODELS[model][0]]


def diffusers_run(model_dir: Path, model: str, inputs: dict, dtype: str | None) -> torch.Tensor:
    """diffusers' own pipeline in one process: fp32 (dtype None), bf16, or fp8 storage with bf16 compute (its own
    layerwise casting of every transformer); HunyuanVideo 1.5 guides through its guider."""
    pipeline = load_pipeline_folder(model_dir) if dtype is None else _folder_in_bf16(model_dir)
    if dtype == "fp8":
        for name in ("transformer", "transformer_2"):
            if getattr(pipeline, name, None) is not None:
                getattr(pipeline, name).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
                                                                 compute_dtype=torch.bfloat16)
    call = call_of(model)
    cast = {k: v.to(torch.bfloat16) if dtype and v.is_floating_point() else v for k, v in inputs.items()}
    if model == "minimax-h3":  # one video per call, its audio as the pipeline's two stereo batch items
        from test_minimax_h3 import reference

        return reference(pipeline, cast)[0].float()
    if model.startswith("hunyuanvideo15"):
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=call.pop("guidance_scale"))
    return diffusers_latents(pipeline, model, **cast, **call).float()


def _folder_in_bf16(model_dir: Path):
    from diffusers import DiffusionPipeline

    from parallel.loading import vl_processors

    if is_modular(model_dir):
        return load_pipeline_folder(model_dir, torch_dtype=torch.bfloat16)
    index = json.loads((model_dir / "model_index.json").read_text())
    return DiffusionPipeline.from_pretrained(model_dir, torch_dtype=torch.bfloat16, **vl_processors.stand_ins(model_dir, index),
                                             **{name: None for name, entry in index.items() if entry == [None, None]})


def relative_l2(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.float() - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, video_model_dirs):
    return {**tiny_model_dirs, **video_model_dirs}


@pytest.fixture(scope="module")
def inputs(model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("bf16_inputs")
    paths = {}
    for model, (_, frames, size) in MODELS.items():
        paths[model] = work / f"{model}.safetensors"
        save_file(tiny_models.make_inputs(model, height=size, width=size, **({"num_frames": frames} if frames else {})),
                  paths[model])
    return paths


@pytest.fixture(scope="module")
def references(model_dirs, inputs):
    """{model: {None: fp32, "bf16": ..., "fp8": ...}}, diffusers' own runs."""
    return {model: {dtype: diffusers_run(model_dirs[model], model, load_file(inputs[model]), dtype)
                    for dtype in (None, *DTYPES)} for model in MODELS}


@pytest.fixture(scope="module")
def matrix(model_dirs, inputs, tmp_path_factory):
    """Every case and control through contract E in one 2-rank launch: {(model, dtype, fault): output file}."""
    work = tmp_path_factory.mktemp("bf16_matrix")
    outputs, specs = {}, []
    for model, dtype, fault in [(*c, None) for c in CASES] + [(*c, "perturbed_shard") for c in CONTROLS]:
        output = work / f"{model}-{dtype}{'-' + fault if fault else ''}.safetensors"
        specs.append({"argv": argv_of(model, dtype, model_dirs[model], inputs[model], output), "fault": fault,
                      "output": str(output)})
        outputs[(model, dtype, fault)] = output
    (work / "cases.json").write_text(json.dumps(specs))
    run = torchrun(2, "tests/contract_e_cases.py", str(work / "cases.json"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return outputs


def _ours(matrix, key) -> torch.Tensor:
    output = matrix[key]
    errors = sorted(output.parent.glob(output.name + ".error*"))
    assert not errors, errors[0].read_text()
    return load_file(output)["latents"]


def _bound(references, model: str, dtype: str) -> tuple[float, float]:
    """(diffusers' own relative L2 from fp32 in `dtype`, FACTOR times it)."""
    own = relative_l2(references[model][dtype], references[model][None])
    return own, FACTOR * own


@pytest.mark.parametrize("model, dtype", CASES, ids=[f"{m}-{d}" for m, d in CASES])
def test_contract_e_in_low_precision_is_within_diffusers_own_error(matrix, references, model, dtype):
    ours = _ours(matrix, (model, dtype, None))
    assert ours.shape == references[model][None].shape and torch.isfinite(ours).all()
    own, bound = _bound(references, model, dtype)
    error = relative_l2(ours, references[model][None])
    assert error <= bound, f"{model} {dtype}: relative L2 from fp32 {error:.3g} > {FACTOR} × diffusers' own {own:.3g}"


@pytest.mark.parametrize("model, dtype", CONTROLS, ids=[f"{m}-{d}" for m, d in CONTROLS])
def test_negative_control_a_perturbed_shard_misses_the_bound(matrix, references, model, dtype):
    ours = _ours(matrix, (model, dtype, "perturbed_shard"))
    _, bound = _bound(references, model, dtype)
    assert relative_l2(ours, references[model][None]) > bound


def test_contract_e_as_typed_in_bf16(model_dirs, inputs, references, tmp_path):
    """The launch users type, once: torchrun's own start-up, the output file written by rank 0."""
    output = tmp_path / "out.safetensors"
    run = torchrun(2, "-m", "parallel.run", *argv_of("sd3", "bf16", model_dirs["sd3"], inputs["sd3"], output))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[ulysses=2]" in run.stdout
    ours = load_file(output)["latents"]
    assert relative_l2(ours, references["sd3"][None]) <= _bound(references, "sd3", "bf16")[1]


@pytest.mark.parametrize("model, dtype", POOLS, ids=[f"{m}-{d}" for m, d in POOLS])
def test_a_pool_in_low_precision_is_within_diffusers_own_error(model_dirs, inputs, references, tmp_path, model, dtype):
    call = call_of(model)
    job = {"steps": STEPS, "guidance_scale": call["guidance_scale"], "height": call["height"], "width": call["width"],
           **({"call": {"num_frames": call["num_frames"]}} if "num_frames" in call else {})}
    with serving(model_dirs[model], tmp_path, "--nproc", "2", *MODELS[model][0], "--dtype", dtype) as client:
        status = client.status()
        assert status["dtype"] == dtype
        assert (status["p2p"], status["cards"], status["mixed_cards"]) == ("n/a", (), False)  # CPU ranks: parallel/distributed/devices.py
        ours = client.sample(load_file(inputs[model]), job)
    own, bound = _bound(references, model, dtype)
    error = relative_l2(ours, references[model][None])
    assert error <= bound, f"pool {model} {dtype}: relative L2 from fp32 {error:.3g} > {FACTOR} × diffusers' own {own:.3g}"
