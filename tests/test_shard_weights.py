"""`--shard-weights` (FSDP2 over the world): every family's tiny model, sharded with data parallel (each
rank its own sample: sharding and no activation split), with Ulysses, Ring, CFG parallel and Ulysses ×
CFG, equals diffusers' single-process pipeline; the pool's status shows each rank holding about 1/N of the weights;
the step cache on sharded blocks (Flux's first-block, Qwen-Image 2.1's TaylorSeer) equals diffusers' cached
pipeline; a wrong shard on one rank is caught
(negative control); contract E and the xDiT Pool node take the flag and refuse it with PipeFusion;
`--offload` (the shards in CPU memory, FSDP2's CPUOffloadPolicy) is exact too and needs --shard-weights.
`--shard-weights` alone (every degree 1) on 2 ranks runs too: each rank holds ≤ 0.55 of the weights (a 16-block tiny
Flux through contract E) and splits a batch where it divides, else computes it whole; equal to diffusers either way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.layout.config import LayoutError, ParallelConfig

from pool_helpers import free_endpoint, idle_client, pool_processes, start_serve, stop_serve, wait_gone
from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, torchrun

STEPS, SIZE = 2, 64
LAYOUTS = {
    2: {"shard2-dp2": {"dp_degree": 2}, "shard2-ulysses2": {"ulysses_degree": 2}, "shard2-cfg2": {"cfg_degree": 2},
        "shard2-ring2": {"ring_degree": 2}, "shard2-ulysses2-offload": {"ulysses_degree": 2, "offload": True},
        "shard2": {}},  # alone: one sample, so every rank computes it whole on the gathered blocks
    4: {"shard4-cfg2-ulysses2": {"cfg_degree": 2, "ulysses_degree": 2}},
}
# Wan 2.2 A14B: both experts sharded. The Qwen-Image-Edit models shard Qwen-Image's transformer, which is here.
FAMILIES = (*(f for f in tiny_models.FAMILIES if not f.startswith("qwen-image-edit")), "wan", "wan22")
FRAMES = {"wan": 5, "wan22": 5}
CASES = [(n, f, l) for n, layouts in LAYOUTS.items() for f in FAMILIES for l in layouts
         if tiny_models.MODELS[f].cfg or "cfg" not in l]  # FLUX.2 [dev] has no CFG to split
FAULT = (2, "sd3", "shard2-ulysses2-stale")
FAULT_ALONE = (2, "flux", "shard2-stale")  # the same wrong shard with --shard-weights alone
# diffusers' cache hooks on sharded blocks: the first-block cache on Flux, TaylorSeer on Qwen-Image 2.1 with its
# prefix K/V cache (a branch per CFG rank), over 4 steps so that some come from the cache (in 2 none did)
CACHED = {(2, "flux", "shard2-ulysses2-cached"): {"method": "first-block", "threshold": 0.5},
          (2, "qwen-image-2.1", "shard2-cfg2-cached"): {"method": "taylorseer", "interval": 2, "warmup": 2, "order": 1}}
CACHED_STEPS = 4


def call_kwargs(family: str, layout: str) -> dict:
    tiny = tiny_models.MODELS[family]
    steps = CACHED_STEPS if layout.endswith("-cached") else STEPS
    kwargs = {"num_inference_steps": steps, "guidance_scale": tiny.guidance, "height": SIZE, "width": SIZE}
    if family in FRAMES:
        kwargs["num_frames"] = FRAMES[family]
    if "cfg" in layout:
        kwargs.update(tiny.true_cfg)
    return kwargs


@pytest.fixture(scope="module")
def matrix(tiny_model_dirs, video_model_dirs, tmp_path_factory):
    """Both launches once: {case: (output file, inputs file)}."""
    work = tmp_path_factory.mktemp("shard")
    results = {}
    for nproc, layouts in LAYOUTS.items():
        specs = []
        for case in [c for c in CASES if c[0] == nproc] + ([FAULT, FAULT_ALONE, *CACHED] if nproc == 2 else []):
            _, family, layout = case
            batch = 2 if "dp2" in layout else 1  # data parallel: each rank its own sample
            inputs = work / f"{family}-b{batch}.safetensors"
            if not inputs.exists():
                frames = {"num_frames": FRAMES[family]} if family in FRAMES else {}
                save_file(tiny_models.make_inputs(family, batch=batch, height=SIZE, width=SIZE, **frames), inputs)
            output = work / f"{nproc}-{family}-{layout}.safetensors"
            specs.append({"model": str({**tiny_model_dirs, **video_model_dirs}[family]), "inputs": str(inputs), "output": str(output),
                          "layout": layouts[layout.rsplit("-", 1)[0] if case in (FAULT, FAULT_ALONE, *CACHED) else layout],
                          "call": call_kwargs(family, layout), "fault": "stale_shard" if case in (FAULT, FAULT_ALONE) else None,
                          "cache": CACHED.get(case)})
            results[case] = (output, inputs)
        spec_file = work / f"cases{nproc}.json"
        spec_file.write_text(json.dumps(specs))
        run = torchrun(nproc, "tests/shard_weights_cases.py", str(spec_file))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return results, {**tiny_model_dirs, **video_model_dirs}


def _result(matrix, case):
    results, dirs = matrix
    output, inputs = results[case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    _, family, layout = case
    return load_file(output)["latents"], diffusers_latents(dirs[family], family, **load_file(inputs), **call_kwargs(family, layout))


@pytest.mark.parametrize("case", CASES, ids=[f"{f}-{l}" for _, f, l in CASES])
def test_sharded_weights_match_single_process_diffusers(matrix, case):
    parallel, expected = _result(matrix, case)
    assert parallel.shape == expected.shape and torch.isfinite(parallel).all()
    error = (parallel - expected).abs().max().item()
    assert error <= TOLERANCE, f"{case}: max |sharded - diffusers| = {error:.3g}"


@pytest.mark.parametrize("fault", [FAULT, FAULT_ALONE], ids=["ulysses2", "alone"])
def test_negative_control_one_wrong_shard_fails(matrix, fault):
    parallel, expected = _result(matrix, fault)
    assert (parallel - expected).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("case", CACHED, ids=[family for _, family, _ in CACHED])
def test_step_cache_on_sharded_weights_matches_diffusers_cached(matrix, case):
    from test_step_cache import reference

    results, dirs = matrix
    output, inputs = results[case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    _, family, layout = case
    expected, decisions = reference(dirs[family], family, load_file(inputs), call_kwargs(family, layout), CACHED[case])
    assert not all(full for calls in decisions.values() for full in calls), decisions  # some steps came from the cache
    assert (load_file(output)["latents"] - expected["latents"]).abs().max().item() <= TOLERANCE


def test_offload_without_shard_weights_is_refused_in_one_line():
    with pytest.raises(LayoutError, match="--offload .* add --shard-weights"):
        ParallelConfig(ulysses_degree=2, offload=True).check(2)


def test_shard_weights_alone_makes_the_ranks_replicas_that_split_a_batch_where_it_divides():
    alone = ParallelConfig(shard_weights=True)
    alone.check(2)  # every degree 1 on 2 ranks: refused without --shard-weights (below)
    ranks = alone.for_world(2)
    assert (ranks.dp_degree, ranks.dp_when_divisible) == (2, True) and ranks.world_size == 2
    assert ranks.describe() == "dp=2 where the batch divides, sharded weights"
    assert [ranks.batch_split(b) for b in (1, 2, 3, 4)] == [None, [1, 1], None, [2, 2]]  # None: each rank runs it whole
    assert ParallelConfig(dp_degree=2).batch_split(3) == [2, 1]  # --dp-degree splits unevenly, as before
    assert ParallelConfig(shard_weights=True, ulysses_degree=2).for_world(2).dp_degree == 1  # a layout: as given
    with pytest.raises(LayoutError, match=r"there are 2 ranks \(.*so the product is 2\.$"):
        ParallelConfig().check(2)
    with pytest.raises(LayoutError, match="or give them all as 1 to shard the weights over every rank"):
        ParallelConfig(dp_degree=3, shard_weights=True).check(2)


def test_shard_weights_with_pipefusion_is_refused_in_one_line():
    with pytest.raises(LayoutError, match="--shard-weights with --pipefusion-degree 2") as error:
        ParallelConfig(pipefusion_degree=2, shard_weights=True).check(2)
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def deep_model(tiny_model_dirs, tmp_path_factory) -> tuple[Path, int]:
    """The tiny SD3 with 16 blocks, so that its blocks are ~98% of its weights (as in the real models);
    returns the folder and an unsharded rank's parameter bytes."""
    from diffusers import DiffusionPipeline, SD3Transformer2DModel

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs["sd3"])
    torch.manual_seed(0)
    pipeline.transformer = SD3Transformer2DModel.from_config({**pipeline.transformer.config, "num_layers": 16})
    folder = tmp_path_factory.mktemp("deep") / "sd3-deep"
    pipeline.save_pretrained(folder)
    return folder, sum(p.numel() * p.element_size() for p in pipeline.transformer.parameters())


@pytest.mark.parametrize("nproc, flags, bound", [
    (2, ["--ulysses-degree", "2"], 0.55),
    (4, ["--ulysses-degree", "2", "--cfg-parallel"], 0.3),
    (2, [], 0.55),  # --shard-weights alone
], ids=["2ranks", "4ranks-ulysses2-cfg2", "2ranks-alone"])
def test_pool_status_shows_each_rank_holding_its_share(deep_model, tmp_path, nproc, flags, bound):
    folder, unsharded = deep_model
    endpoint = free_endpoint()
    process = start_serve(folder, endpoint, "--nproc", str(nproc), *flags, "--shard-weights", log=tmp_path / "serve.log")
    try:
        client, status = idle_client(endpoint)
        pids = pool_processes(status)
        client.close()
    finally:
        stop_serve(process)
    assert not wait_gone(pids)
    assert status["parallel"]["shard_weights"] is True and "sharded weights" in status["parallel"]["description"]
    ratios = [m["parameter_bytes"] / unsharded for m in status["memory"]]
    assert len(ratios) == nproc and all(0 < r <= bound for r in ratios), ratios


def test_pool_node_passes_shard_weights_and_refuses_it_with_pipefusion(monkeypatch):
    import types

    from xdit_test_helpers import import_node_module

    folders = types.ModuleType("folder_paths")
    folders.get_folder_paths = folders.get_filename_list = lambda name: []
    latest = types.ModuleType("comfy_api.latest")
    latest.io = types.SimpleNamespace(Custom=lambda name: name, ComfyNode=object)
    node = import_node_module(monkeypatch, "pool_node", {"folder_paths": folders, "comfy_api": types.ModuleType("comfy_api"),
                                                        "comfy_api.latest": latest})
    kwargs = {"model": "xdit-tiny-sd3", "nproc": 2, "dp_degree": 1, "cfg_parallel": False, "pipefusion_degree": 1,
              "ring_degree": 1, "ulysses_degree": 2, "num_patches": 0, "warmup_steps": 1, "text_encoders": True,
              "dtype": "auto", "devices": "", "threads_per_rank": 0, "endpoint": "", "shard_weights": True}
    assert node.pool_key(kwargs, resolve_model=False).parallel.shard_weights is True
    assert node.XDiTPool.validate_inputs(**kwargs) is True
    refused = node.XDiTPool.validate_inputs(**{**kwargs, "ulysses_degree": 1, "pipefusion_degree": 2})
    assert refused.startswith("--shard-weights with --pipefusion-degree 2")
    assert node.pool_key({**kwargs, "offload": True}, resolve_model=False).parallel.offload is True
    assert node.XDiTPool.validate_inputs(**{**kwargs, "shard_weights": False, "offload": True}).startswith("--offload")


@pytest.fixture(scope="module")
def deep_flux(tiny_model_dirs, tmp_path_factory) -> Path:
    """The tiny Flux with 8 double and 8 single blocks: its 4 blocks are 87% of its weights, these 16 are 96% (FLUX.1
    [dev]'s 57 are 99%); the rest (embedders, output projection) stays whole on every rank."""
    from diffusers import DiffusionPipeline, FluxTransformer2DModel

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs["flux"])
    torch.manual_seed(0)
    pipeline.transformer = FluxTransformer2DModel.from_config({**pipeline.transformer.config, "num_layers": 8,
                                                                "num_single_layers": 8})
    folder = tmp_path_factory.mktemp("deep") / "flux-deep"
    pipeline.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("batch", [1, 2], ids=["one-sample-whole-on-each-rank", "two-samples-split"])
def test_contract_e_shard_weights_alone_on_two_ranks_equals_diffusers_with_half_the_weights(deep_flux, tmp_path, batch):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs("flux", batch=batch), inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(deep_flux), "--inputs", str(inputs), "--output", str(output),
                   "--steps", "2", "--height", "64", "--width", "64", "--guidance-scale", "3.5", "--shard-weights")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[dp=2 where the batch divides, sharded weights]" in run.stdout
    shares = [float(s) for s in run.stdout.split("each rank holds ")[1].split(" of ")[0].split(", ")]
    assert len(shares) == 2 and all(0 < share <= 0.55 for share in shares), shares
    expected = diffusers_latents(deep_flux, "flux", **load_file(inputs), num_inference_steps=2, guidance_scale=3.5,
                                 height=64, width=64)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE


def _engine(model_dir, inputs, output, *flags):
    return torchrun(2, "-m", "parallel.run", "--model", str(model_dir), "--inputs", str(inputs), "--output", str(output),
                    "--steps", "2", "--height", "64", "--width", "64", "--guidance-scale", "4.5", *flags)


def test_contract_e_with_shard_weights_equals_diffusers_and_refuses_what_it_cannot(tiny_model_dirs, tmp_path):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs("pixart-alpha"), inputs)
    run = _engine(tiny_model_dirs["pixart-alpha"], inputs, output, "--ulysses-degree", "2", "--shard-weights", "--offload")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[ulysses=2, sharded weights offloaded to CPU]" in run.stdout
    expected = diffusers_latents(tiny_model_dirs["pixart-alpha"], "pixart-alpha", **load_file(inputs),
                                 num_inference_steps=2, guidance_scale=4.5, height=64, width=64)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE
    output.unlink()
    for flags, message in ((["--pipefusion-degree", "2"], "--shard-weights with --pipefusion-degree 2"),
                           (["--ulysses-degree", "2", "--dtype", "fp8"], "--shard-weights does not work with --dtype fp8")):
        run = _engine(tiny_model_dirs["pixart-alpha"], inputs, output, *flags, "--shard-weights")
        errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
        assert run.returncode != 0 and len(errors) == 1 and message in errors[0], run.stderr[-3000:]
        assert not output.exists()
