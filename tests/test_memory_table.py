"""The analytic activation models of bench/memory_table.py against measurements, in one process, and its
weight counts. The full comparison (every layout on torchrun ranks) is `python -m bench.memory_table`;
this checks the single-rank models on the mini FLUX.2 and Qwen-Image at a second size, so a diffusers or
engine change that moves the peak shows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import memory_table, wan_memory


@pytest.mark.parametrize("family", list(memory_table.MINI))
def test_single_rank_peak_matches_the_analytic_model(family, monkeypatch):
    mini = dataclasses.replace(memory_table.MINI[family], image_tokens=144, text_tokens=24)  # not the bench's size
    monkeypatch.setitem(memory_table.MINI, family, mini)
    pipeline = memory_table.mini_pipeline(family)
    with torch.no_grad():
        measured = wan_memory.transformer_peak(pipeline, lambda: pipeline(**memory_table.mini_call(family, False)),
                                               ignore=pipeline.transformer)
    model = (memory_table.flux2_peak if family == "flux2" else memory_table.qwen_peak)(mini, 1, 1)
    assert 0.9 <= measured / model["peak"] <= 1.1, (measured, model)


def test_sharded_weights_count_every_parameter_once():
    one = memory_table.weight_bytes("QwenImageTransformer2DModel", {}, 1, 1)
    four = memory_table.weight_bytes("QwenImageTransformer2DModel", {}, 1, 4)
    assert one["total"] == one["sharded"] + one["replicated"]
    assert abs(four["sharded"] * 4 - one["sharded"]) <= 4
    assert 19e9 < one["total"] / 2 < 21e9  # Qwen-Image's 20 B parameters


def test_layouts_split_one_sample_over_every_rank():
    assert set(memory_table.layouts(4, 24, cfg=True)) == {
        "ring4", "ulysses2×ring2", "ulysses4", "cfg2×ring2", "cfg2×ulysses2"}
    assert all(u * r * c == 8 for u, r, c in memory_table.layouts(8, 48, cfg=False).values())


def test_the_table_covers_every_model_and_rank_count():
    text, data = memory_table.report(None)
    for model in memory_table.RELEASED:
        assert {key.split(":")[0] for key in data["real"][model]} == {"2", "4", "8"}
    assert "| 8 | ulysses8 |" in text and "(not measured)" in text
    qwen = data["real"]["Qwen-Image"]
    assert qwen["4:ulysses4"]["weights"]["per_rank"] < qwen["2:ulysses2"]["weights"]["per_rank"] / 1.8


def test_a_pool_holding_both_wan_experts_whole_counts_two_14b_transformers():
    _, cls_name, config, experts, _ = memory_table.RELEASED["Wan 2.2 A14B"]
    whole = memory_table.whole_bytes(cls_name, config, experts)
    assert 2 * 14e9 * 2 < whole["bf16"] < 2 * 14.5e9 * 2  # two experts of 14 B parameters
    assert 0.5 < whole["fp8"] / whole["bf16"] < 0.52  # fp8 blocks; embeddings, norms and head stay bf16
    assert "Wan 2.2 A14B's two loaders on one pool" in memory_table.report(None)[0]
