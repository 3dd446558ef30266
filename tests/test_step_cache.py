"""Step caching on every sequence/CFG layout takes the single-process decisions of diffusers' own hook.

Two torchrun launches (2 and 4 ranks) run every case with the cache as a job setting; the reference is
diffusers' single-process pipeline with the same hook (`enable_cache`), its decisions recorded here.
Each case must equal it within 1e-4 and skip exactly the same steps on every rank; the negative control
(the metric of one rank's shard, agreed by broadcast) must miss. Qwen-Image 2.1 takes TaylorSeer with its prefix
K/V cache on; its first-block cache and Krea 2's every cache are refused in one line, the one --list-supported prints.
LTX-2 (Ulysses 2, CFG 2) and MiniMax-H3 (Ulysses 2) take TaylorSeer, video and audio each equal to diffusers' run (H3's
modular pipeline in the engine's default cache context); diffusers' first-block cache knows neither's blocks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.cli.launch import ROOT, rank_environment

from pool_helpers import free_endpoint, idle_client, start_serve, stop_serve
from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, load_pipeline_folder, torchrun

STEPS, SIZE, THRESHOLD = 20, 64, 0.42
FIRST_BLOCK = {"method": "first-block", "threshold": THRESHOLD}
TAYLORSEER = {"method": "taylorseer", "interval": 3, "warmup": 2, "order": 2}
QWEN_FIRST_BLOCK = {"method": "first-block", "threshold": 1.0}  # its tiny model's first-block residual moves more
LTX2_VIDEO, LTX2_CALL = (17, 96, 160), {"frame_rate": 25.0, "stg_block": 1}  # tests/test_ltx2.py's; STG on block 1


class Case(NamedTuple):
    ranks: int
    layout: dict
    family: str = "flux"
    true_cfg: bool = False
    cache: dict = FIRST_BLOCK
    fault: str | None = None
    batch: int = 1
    video: tuple[int, int, int] | None = None  # (frames, height, width)
    extra: dict | None = None  # the family's own call parameters
    refused: str | None = None  # the error every rank must raise instead (no reference then)


CASES = {
    "ulysses2": Case(2, {"ulysses_degree": 2}),
    "ring2": Case(2, {"ring_degree": 2}),
    "cfg2": Case(2, {"cfg_degree": 2}, true_cfg=True),
    "dp2": Case(2, {"dp_degree": 2}, batch=2),
    # 27 video tokens over 2 ranks: padded shards, whose padding the metric must leave out
    "wan-uneven-ulysses2": Case(2, {"ulysses_degree": 2}, "wan", cache={"method": "first-block", "threshold": 0.2},
                                video=(9, 48, 48)),
    "wan22-ring2": Case(2, {"ring_degree": 2}, "wan22", cache={"method": "first-block", "threshold": 0.2},
                        video=(5, 64, 64)),
    "control": Case(2, {"ulysses_degree": 2}, fault="one_shard"),
    # FluxKontextPipeline calls its branches unnamed: one cache state in one process, not splittable
    "kontext-cfg2": Case(2, {"cfg_degree": 2}, "flux-kontext", true_cfg=True, refused="without naming them"),
    "taylorseer-ulysses2": Case(2, {"ulysses_degree": 2}, true_cfg=True, cache=TAYLORSEER),
    "ulysses2_ring2": Case(4, {"ulysses_degree": 2, "ring_degree": 2}),
    "cfg2_ulysses2": Case(4, {"cfg_degree": 2, "ulysses_degree": 2}, true_cfg=True),
    "qwen-image-ring2": Case(2, {"ring_degree": 2}, "qwen-image", cache=QWEN_FIRST_BLOCK),  # true CFG by default
    "qwen-image-cfg2_ulysses2": Case(4, {"cfg_degree": 2, "ulysses_degree": 2}, "qwen-image", true_cfg=True,
                                     cache=QWEN_FIRST_BLOCK),
    # Qwen-Image 2.1: TaylorSeer with the prefix K/V cache on (the image's tokens alone after the first step);
    # diffusers' first-block cache has no entry for its blocks, and Krea 2's transformer no cache hooks at all
    "qwen-image-2.1-taylorseer-ulysses2": Case(2, {"ulysses_degree": 2}, "qwen-image-2.1", true_cfg=True,
                                               cache=TAYLORSEER),
    "qwen-image-2.1-taylorseer-ring2": Case(2, {"ring_degree": 2}, "qwen-image-2.1", true_cfg=True, cache=TAYLORSEER),
    "qwen-image-2.1-first-block": Case(2, {"ulysses_degree": 2}, "qwen-image-2.1", true_cfg=True,
                                       refused="has no entry for QwenImage21TransformerBlock in its block registry; "
                                               "use --cache taylorseer or --cache none"),
    # its first step's blocks return the prefix's rows too: no step may be predicted from that one alone
    "qwen-image-2.1-taylorseer-warmup1": Case(2, {"ulysses_degree": 2}, "qwen-image-2.1", true_cfg=True,
                                              cache={**TAYLORSEER, "warmup": 1}, refused="use --cache-warmup 2 or more"),
    "krea2-ulysses2": Case(2, {"ulysses_degree": 2}, "krea2", refused="diffusers has no cache hooks for "
                                                                      "Krea2Transformer2DModel (no CacheMixin)"),
    "qwen-image-2.1-taylorseer-cfg2_ulysses2": Case(4, {"cfg_degree": 2, "ulysses_degree": 2}, "qwen-image-2.1",
                                                    true_cfg=True, cache=TAYLORSEER),
    # video with sound: three calls a step for LTX-2 (CFG batch, STG, modality isolation: a cache context each), one
    # packed sequence for MiniMax-H3 (its modular pipeline names no context); diffusers' first-block cache knows
    # neither's blocks
    "ltx2-taylorseer-ulysses2": Case(2, {"ulysses_degree": 2}, "ltx2", cache=TAYLORSEER, video=LTX2_VIDEO,
                                     extra=LTX2_CALL),
    "ltx2-taylorseer-cfg2": Case(2, {"cfg_degree": 2}, "ltx2", cache=TAYLORSEER, video=LTX2_VIDEO, extra=LTX2_CALL),
    "ltx2-first-block": Case(2, {"ulysses_degree": 2}, "ltx2", video=LTX2_VIDEO, extra=LTX2_CALL,
                             refused="has no entry for LTX2VideoTransformerBlock in its block registry"),
    "minimax-h3-taylorseer-ulysses2": Case(2, {"ulysses_degree": 2}, "minimax-h3", cache=TAYLORSEER,
                                           video=(124, 64, 64)),
    "minimax-h3-first-block": Case(2, {"ulysses_degree": 2}, "minimax-h3", video=(124, 64, 64),
                                   refused="has no entry for MiniMaxH3TransformerBlock and MiniMaxH3TokenRefinerBlock"),
}


def call_kwargs(case: Case) -> dict:
    tiny = tiny_models.MODELS[case.family]
    frames, height, width = case.video or (None, SIZE, SIZE)
    return {"num_inference_steps": STEPS, "guidance_scale": tiny.guidance, "height": height, "width": width,
            **({"num_frames": frames} if frames else {}), **(tiny.true_cfg if case.true_cfg else {}),
            **(case.extra or {})}


def reference(model_dir: Path, family: str, inputs: dict, call: dict, cache: dict):
    """diffusers in this process with the same hook; returns ({"latents", and "audio" for a video with sound},
    decisions per cache context). A modular pipeline (MiniMax-H3) names no context: the engine's default one."""
    from parallel.cache_settings import CacheSettings
    from parallel.model_executor import step_cache
    from test_minimax_h3 import reference as minimax_h3_reference

    pipeline = load_pipeline_folder(model_dir)  # Qwen-Image 2.1's processor for images only without torchvision
    settings = CacheSettings.from_params(cache)
    decisions: dict[str, list[bool]] = {}
    for transformer in filter(None, (pipeline.transformer, getattr(pipeline, "transformer_2", None))):
        transformer.enable_cache(step_cache.diffusers_config(settings))  # Wan 2.2: each expert its own cache
        if settings.method == "first-block":
            _record_decisions(_hook(transformer, "fbc_leader_block_hook"), "_should_compute_remaining_blocks", decisions)
        else:
            _record_decisions(_hook(transformer, "taylorseer_cache"), "_measure_should_compute", decisions)
    if family == "minimax-h3":
        with pipeline.transformer.cache_context(step_cache.DEFAULT_CONTEXT):
            return dict(zip(("latents", "audio"), minimax_h3_reference(pipeline, inputs, call))), decisions
    if "stg_block" in call:  # the engine's call parameter, as the list LTX2Pipeline takes
        call = {**call, "spatio_temporal_guidance_blocks": [call["stg_block"]]}
        del call["stg_block"]
    outputs = diffusers_latents(pipeline, family, **inputs, **call, all_outputs=True)
    return dict(zip(("latents", "audio") if family == "ltx2" else ("latents",), outputs)), decisions


def _hook(transformer, name: str):
    return next(m._diffusers_hook.get_hook(name) for m in transformer.modules()
                if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook(name) is not None)


def _record_decisions(hook, method: str, decisions: dict) -> None:
    """Wrap the hook's decision method to note each decision under its cache context."""
    decide = getattr(hook, method)

    def recorded(*args):
        out = decide(*args)
        full = out[0] if isinstance(out, tuple) else out  # TaylorSeer returns (decision, state)
        decisions.setdefault(hook.state_manager.context.name, []).append(full)
        return out

    setattr(hook, method, recorded)


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, video_model_dirs, tmp_path_factory):
    """Both launches once; {case: (output path, ranks, reference latents, reference decisions)}."""
    work = tmp_path_factory.mktemp("step_cache")
    results = {}
    for nproc in (2, 4):
        specs = []
        for name, case in CASES.items():
            if case.ranks != nproc:
                continue
            call = call_kwargs(case)
            inputs = work / f"{case.family}-b{case.batch}.safetensors"
            if not inputs.exists():
                size = {"height": call["height"], "width": call["width"], **({"num_frames": call["num_frames"]} if case.video else {})}
                save_file(tiny_models.make_inputs(case.family, batch=case.batch, **size), inputs)
            model = {**tiny_model_dirs, **video_model_dirs}[case.family]
            output = work / f"{name}.safetensors"
            specs.append({"model": str(model), "inputs": str(inputs), "output": str(output),
                          "layout": case.layout, "call": call, "cache": case.cache, "fault": case.fault})
            expected = (None, None) if case.refused else reference(model, case.family, load_file(inputs), call, case.cache)
            results[name] = (output, case.ranks, *expected)
        spec_file = work / f"cases{nproc}.json"
        spec_file.write_text(json.dumps(specs))
        run = torchrun(nproc, "tests/step_cache_cases.py", str(spec_file))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return results


def _case(runs, name: str):
    output, ranks, expected, decisions = runs[name]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    per_rank = [json.loads(Path(f"{output}.rank{r}.json").read_text()) for r in range(ranks)]
    return load_file(output), expected, per_rank, decisions


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if n != "control" and not case.refused])
def test_cached_layout_equals_diffusers_with_the_same_hook(runs, name):
    parallel, expected, per_rank, decisions = _case(runs, name)
    assert set(parallel) == set(expected)
    for output, tensor in expected.items():  # the latents, and the audio of a video with sound
        error = (parallel[output] - tensor).abs().max().item()
        assert error <= TOLERANCE, f"{name}: max |parallel - diffusers| {output} = {error:.3g}"
    for rank, report in enumerate(per_rank):  # each rank ran every branch, or (sequential CFG) its own
        assert report["decisions"], f"{name}: rank {rank} recorded no decision"
        for context, mine in report["decisions"].items():
            assert mine == decisions[context], f"{name}: rank {rank} {context}: {mine} != diffusers {decisions[context]}"
    calls = [full for branch in decisions.values() for full in branch]
    assert (per_rank[0]["full"], per_rank[0]["cached"]) == (sum(calls), len(calls) - sum(calls))
    assert len(calls) - sum(calls) >= len(calls) / 3, f"{name}: only {len(calls) - sum(calls)} of {len(calls)} calls cached"


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case.refused])
def test_unsupported_cache_layouts_fail_on_every_rank_with_one_reason(runs, name):
    output = runs[name][0]
    for rank in range(CASES[name].ranks):
        error = Path(f"{output}.error.rank{rank}")
        assert error.exists() and CASES[name].refused in error.read_text().splitlines()[-1], rank


def test_negative_control_metric_of_one_shard_misses(runs):
    parallel, expected, per_rank, decisions = _case(runs, "control")
    error = (parallel["latents"] - expected["latents"]).abs().max().item()
    assert per_rank[0]["decisions"] != decisions and error > 10 * TOLERANCE, (
        f"the one-shard metric took the single-process decisions (max error {error:.3g})")


def test_pool_job_takes_the_cache_and_reports_its_calls(runs, tiny_model_dirs, tmp_path):
    """Contract P: `sample --cache first-block` on a served Ulysses-2 pool equals diffusers with the same hook;
    the CLI prints the job's full and cached calls and `status` keeps them (the panel shows them)."""
    output, _, expected, decisions = runs["ulysses2"]
    call = call_kwargs(CASES["ulysses2"])
    endpoint = free_endpoint()
    serve = start_serve(tiny_model_dirs["flux"], endpoint, "--nproc", "2", "--ulysses-degree", "2",
                        log=tmp_path / "serve.log")
    try:
        client, _ = idle_client(endpoint)
        client.close()

        def sample(*flags: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "workers", "sample", "--endpoint", endpoint, "--inputs",
                 str(output.parent / "flux-b1.safetensors"), "--output", str(tmp_path / "out.safetensors"),
                 "--steps", str(STEPS), "--guidance-scale", str(call["guidance_scale"]), "--height", str(SIZE),
                 "--width", str(SIZE), *flags], cwd=ROOT, env=rank_environment(), capture_output=True, text=True,
                timeout=300)

        def status() -> dict:
            return json.loads(subprocess.run([sys.executable, "-m", "workers", "status", "--endpoint", endpoint, "--json"],
                                             cwd=ROOT, env=rank_environment(), capture_output=True, text=True,
                                             timeout=60, check=True).stdout)

        run = sample("--cache", "first-block", "--cache-threshold", str(THRESHOLD))
        assert run.returncode == 0, run.stderr[-3000:]
        full = sum(decisions["cond"])
        assert f"{full} full model calls, {STEPS - full} from the cache" in run.stdout, run.stdout
        result = load_file(tmp_path / "out.safetensors")["latents"]
        assert (result - expected["latents"]).abs().max().item() <= TOLERANCE
        cache = status()["last_cache"]
        assert (cache["method"], cache["full"], cache["cached"]) == ("first-block", full, STEPS - full)
        assert sample().returncode == 0 and status()["last_cache"] is None  # the next job asks for none
    finally:
        stop_serve(serve)


@pytest.mark.parametrize("settings, message", [
    ({"method": "fbcache"}, "cache method 'fbcache' is not one of"),
    ({"method": "first-block", "threshold": 0}, "cache threshold is 0; use a value above 0"),
    ({"method": "taylorseer", "interval": 0}, "cache interval is 0; use 1 to 1000"),
    ({"method": "taylorseer", "warmup": 0}, "cache warmup is 0; use 1 to 1000"),  # would predict step 0 from nothing
    ({"method": "first-block", "every": 2}, "cache does not take ['every']"),
])
def test_bad_cache_settings_are_one_clear_error(settings, message):
    from parallel.request import SampleRequest

    with pytest.raises(ValueError, match=re.escape(message)):
        SampleRequest.from_params({"steps": 4, "guidance_scale": 1.0, "height": 64, "width": 64, "cache": settings})


def test_cache_round_trips_on_the_wire_and_is_absent_when_off():
    from parallel.request import STEP_CACHE, SampleRequest

    base = {"steps": 4, "guidance_scale": 1.0, "height": 64, "width": 64}
    cached = SampleRequest.from_params({**base, "cache": {"method": "first-block", "threshold": 0.2}})
    assert SampleRequest.from_params(cached.to_params()) == cached
    assert cached.pipeline_kwargs({})[STEP_CACHE].threshold == 0.2
    plain = SampleRequest.from_params(base)
    assert "cache" not in plain.to_params() and STEP_CACHE not in plain.pipeline_kwargs({})


def test_models_without_diffusers_cache_and_pipefusion_are_refused(tiny_model_dirs):
    from diffusers import DiffusionPipeline

    from parallel.cache_settings import CacheSettings
    from parallel.layout.config import LayoutError
    from parallel.model_executor.step_cache import check_cache

    cache = CacheSettings("first-block", 0.2)
    pixart = DiffusionPipeline.from_pretrained(tiny_model_dirs["pixart-alpha"]).transformer
    with pytest.raises(ValueError, match="diffusers has no cache hooks for PixArtTransformer2DModel"):
        check_cache(cache, 1, pixart)
    flux = DiffusionPipeline.from_pretrained(tiny_model_dirs["flux"]).transformer
    with pytest.raises(LayoutError, match="does not combine with PipeFusion"):
        check_cache(cache, 2, flux)
    check_cache(cache, 1, flux)
    check_cache(CacheSettings(), 2, pixart)


@pytest.mark.parametrize("family, pipeline, method", [("krea2", "Krea2Pipeline", "first-block"),
                                                      ("krea2", "Krea2Pipeline", "taylorseer"),
                                                      ("qwen-image-2.1", "QwenImage21Pipeline", "first-block"),
                                                      ("ltx2", "LTX2Pipeline", "first-block"),
                                                      ("minimax-h3", "MiniMaxH3ModularPipeline", "first-block")])
def test_a_refused_cache_is_one_line_that_list_supported_prints(tiny_model_dirs, video_model_dirs, family, pipeline,
                                                                method):
    """The engine's refusal (before any rank computes) and the step cache column of `--list-supported` (README's
    table) give one reason, derived from diffusers' classes; Qwen-Image 2.1, LTX-2 and MiniMax-H3 take TaylorSeer
    (the cases above)."""
    from diffusers import AutoModel

    from parallel.cache_settings import CacheSettings
    from parallel.model_executor import capability_table
    from parallel.model_executor.step_cache import check_cache

    transformer = AutoModel.from_pretrained(str({**tiny_model_dirs, **video_model_dirs}[family] / "transformer"))
    with pytest.raises(ValueError) as refused:
        check_cache(CacheSettings.from_params({"method": method}), 1, transformer)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--cache {method}: ")
    why = message.removeprefix(f"--cache {method}: ").split("; use --cache ")[0]
    row = next(line for line in capability_table().splitlines() if line.startswith(f"| {pipeline} |"))
    assert why in row.split(" | ")[-1], (why, row)


def _contract_e(nproc: int, model: Path, inputs: Path, output: Path, *flags: str):
    call = call_kwargs(CASES["ulysses2"])
    return torchrun(nproc, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                    "--steps", str(STEPS), "--guidance-scale", str(call["guidance_scale"]), "--height", str(SIZE),
                    "--width", str(SIZE), *flags)


def test_contract_e_ring2_takes_the_cache_and_prints_its_calls(runs, tiny_model_dirs, tmp_path):
    output, _, expected, decisions = runs["ring2"]
    result = tmp_path / "out.safetensors"
    run = _contract_e(2, tiny_model_dirs["flux"], output.parent / "flux-b1.safetensors", result, "--ring-degree", "2",
                      "--cache", "first-block", "--cache-threshold", str(THRESHOLD))
    assert run.returncode == 0, run.stderr[-3000:]
    full = sum(decisions["cond"])
    assert f"first-block cache (threshold {THRESHOLD:g}): {full} full model calls, {STEPS - full} from the cache" in run.stdout
    assert (load_file(result)["latents"] - expected["latents"]).abs().max().item() <= TOLERANCE


def test_contract_e_refuses_the_cache_with_pipefusion_in_one_line(runs, tiny_model_dirs, tmp_path):
    output, _, _, _ = runs["ring2"]
    result = tmp_path / "out.safetensors"
    run = _contract_e(2, tiny_model_dirs["flux"], output.parent / "flux-b1.safetensors", result,
                      "--pipefusion-degree", "2", "--cache", "first-block")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, run.stderr[-3000:]
    assert "--cache first-block does not combine with PipeFusion (pipefusion degree 2)" in errors[0]
    assert not result.exists()


def test_step_cache_benchmark_runs_on_the_tiny_model(tmp_path):
    """bench.step_cache end to end (no timing asserted): the cached Ulysses-2 run equals diffusers' cached run."""
    out = tmp_path / "step_cache.json"
    run = subprocess.run([sys.executable, "-m", "bench.step_cache", "--tiny", "--runs", "1", "--steps", str(STEPS),
                          "--threshold", str(THRESHOLD), "--json", str(out)],
                         cwd=ROOT, env=rank_environment(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows["1 rank + cache"]["full_calls"] == rows["ulysses2 + cache"]["full_calls"] < STEPS
    assert report["relative_l2"]["ulysses2 + cache vs 1 rank + cache"] < 1e-5
    assert 0 < report["relative_l2"]["ulysses2 + cache"] < 1
