"""Qwen-Image 2.1: a block-causal [prefix; image] stream whose prefix K/V are cached, on every layout.

test_engine_layouts runs the tiny model through every layout at 64² (K/V cache on: the pipeline's default). Here, in
one engine_cases launch per world size, at 64 × 96 pixels (24 image tokens) with a 16-token prompt and an 11-token
negative (the two branches' prefixes and outputs of different lengths): Ulysses 2 and 4, Ring 2, Ulysses 2 × Ring 2,
CFG 2, CFG 2 × Ulysses 2 and data parallel 2 (a batch whose second prompt is padded) equal diffusers' single-process
QwenImage21Pipeline with its cache on within 1e-4, and Ulysses 2 with the cache off equals it with the cache off.
Under Ulysses 2 each rank stores each branch's prefix K/V once per job (one store per layer and branch, not per
step), holds half of their heads, and holds none after the job; a sequence split without exchange misses; padded
prompts are refused under Ulysses in one line. In one process, a job that fails mid-way drops its caches too, and a
folder loads without its text encoder (its processor for images only).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, run_engine_cases

FAMILY, STEPS, HEIGHT, WIDTH = "qwen-image-2.1", 4, 64, 96
GUIDED = {"num_inference_steps": STEPS, "true_cfg_scale": 4.0, "height": HEIGHT, "width": WIDTH}
UNGUIDED = {**GUIDED, "true_cfg_scale": 1.0}
CASES = {  # name: (ranks, layout, inputs, call)
    "ulysses2": (2, {"ulysses_degree": 2}, "one", GUIDED),
    "ring2": (2, {"ring_degree": 2}, "one", GUIDED),
    "cfg2": (2, {"cfg_degree": 2}, "one", GUIDED),
    "dp2": (2, {"dp_degree": 2}, "batch", GUIDED),
    "ulysses2-no-cache": (2, {"ulysses_degree": 2}, "one", {**GUIDED, "use_kv_cache": 0}),
    "ulysses2-no-exchange": (2, {"ulysses_degree": 2}, "one", GUIDED),
    "ulysses2-batch": (2, {"ulysses_degree": 2}, "batch", UNGUIDED),
    "ulysses4": (4, {"ulysses_degree": 4}, "one", GUIDED),
    "ulysses2_ring2": (4, {"ulysses_degree": 2, "ring_degree": 2}, "one", GUIDED),
    "cfg2_ulysses2": (4, {"cfg_degree": 2, "ulysses_degree": 2}, "one", GUIDED),
}
EXACT = [name for name in CASES if name not in ("ulysses2-no-exchange", "ulysses2-batch")]


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen21")
    save_file(tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH), work / "one.safetensors")
    save_file(tiny_models.make_inputs(FAMILY, batch=2, height=HEIGHT, width=WIDTH), work / "batch.safetensors")
    for nproc in (2, 4):
        specs = [{"name": name, "model": str(tiny_model_dirs[FAMILY]), "inputs": str(work / f"{given}.safetensors"),
                  "output": str(work / f"{name}.safetensors"), "layout": layout, "call": call,
                  "fault": "no_exchange" if name.endswith("no-exchange") else None,
                  "report_prefix_cache": name in ("ulysses2", "ring2")}
                 for name, (n, layout, given, call) in CASES.items() if n == nproc]
        run_engine_cases(nproc, specs, work)
    return work


def _error(runs, tiny_model_dirs, name: str) -> float:
    _, _, given, call = CASES[name]
    errors = case_errors(runs / f"{name}.safetensors")
    assert not errors, errors[-3000:]
    got = load_file(runs / f"{name}.safetensors")["latents"]
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(runs / f"{given}.safetensors"), **call)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("name", EXACT)
def test_layouts_equal_diffusers_with_the_same_cache_setting(runs, tiny_model_dirs, name):
    error = _error(runs, tiny_model_dirs, name)
    assert error <= TOLERANCE, f"{name}: max |parallel - diffusers| = {error:.3g}"


def test_negative_control_sequence_split_without_exchange_misses(runs, tiny_model_dirs):
    assert _error(runs, tiny_model_dirs, "ulysses2-no-exchange") > 100 * TOLERANCE


def test_prefix_kv_is_stored_once_per_job_with_each_ranks_heads_and_dropped(runs, tiny_model_dirs):
    """Two branches × 4 layers stored once each per job (a store per step would be 4× as many); under Ulysses 2
    each rank holds half the heads Ring 2's ranks hold (every ring member keeps them whole); none held after."""
    layers = tiny_models.BLOCKS
    ulysses = json.loads((runs / "ulysses2.safetensors.prefix.json").read_text())
    ring = json.loads((runs / "ring2.safetensors.prefix.json").read_text())
    for report in (ulysses, ring):
        assert [r["stores"] for r in report] == [2 * layers] * 2 and [r["live"] for r in report] == [0, 0]
    assert [2 * r["bytes"] for r in ulysses] == [r["bytes"] for r in ring] and ring[0]["bytes"] > 0


def test_padded_prompts_are_refused_under_ulysses_in_one_line(runs):
    errors = case_errors(runs / "ulysses2-batch.safetensors")
    assert "prompt_embeds_mask pads the shorter prompts of this batch" in errors.splitlines()[-1]


def test_a_failed_job_drops_its_caches_and_a_folder_loads_without_text_encoders(tiny_model_dirs):
    from parallel.families.qwenimage21 import LIVE
    from parallel.layout.config import ParallelConfig
    from parallel.loading.pipelines import load_pipeline
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper

    from xdit_test_helpers import one_rank

    pipeline = load_pipeline(tiny_model_dirs[FAMILY])  # no text encoder: the processor is still there
    assert pipeline.text_encoder is None and pipeline.processor is not None

    def fail(step, latents):
        assert len(LIVE) == 2 * len(pipeline.transformer.transformer_blocks)  # held while the job runs
        raise RuntimeError("cancelled")

    with one_rank(ParallelConfig()):
        wrapper = xFuserPipelineBaseWrapper.wrap(pipeline)
        with pytest.raises(RuntimeError, match="cancelled"):
            wrapper(**tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH), **GUIDED, output_type="latent",
                    step_callback=fail)
        wrapper.unwrap()
    assert len(LIVE) == 0
