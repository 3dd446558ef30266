"""The analytic activation models of bench/memory_table.py (and bench/av_memory.py's) against measurements, in one
process, and its weight counts. The full comparison (every layout on torchrun ranks) is `python -m bench.memory_table`;
this checks the single-rank models on the mini FLUX.2, Qwen-Image, LTX-2 and MiniMax-H3 at a second size, so a
diffusers or engine change that moves the peak shows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import av_memory, memory_table, wan_memory
from xdit_test_helpers import one_rank


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


# family: (frames, side) of a second size, not the bench's
AV_SIZES = {"ltx2": (81, 192), "minimax_h3": (124, 96)}


@pytest.mark.parametrize("family", list(av_memory.MINI))
def test_video_with_sound_single_rank_peak_matches_the_analytic_model(family, monkeypatch):
    """Through the engine's wrapper on one rank (MiniMax-H3 runs only as its modular pipeline, which the wrapper
    drives); LTX-2's call carries CFG's two branches. Negative control: counting LTX-2's call as one branch misses."""
    from parallel.layout.config import ParallelConfig
    from parallel.model_executor.pipeline import xFuserPipelineBaseWrapper

    frames, side = AV_SIZES[family]
    if family == "ltx2":
        mini = dataclasses.replace(av_memory.MINI[family], video_tokens=((frames - 1) // 8 + 1) * (side // 32) ** 2,
                                   audio_tokens=av_memory.ltx2_tiny.audio_frames(frames))
    else:
        latent_frames = av_memory.h3_tiny.video_latent_frames(frames)
        mini = dataclasses.replace(av_memory.MINI[family], video_tokens=latent_frames * (side // 32) ** 2)
    monkeypatch.setitem(av_memory.MINI, family, mini)
    monkeypatch.setitem(av_memory.MINI_VIDEO, family, (frames, side))
    with one_rank(ParallelConfig()):
        pipeline = av_memory.mini_pipeline(family)
        wrapped = xFuserPipelineBaseWrapper.wrap(pipeline)
        inputs = av_memory.mini_call(family)
        with torch.no_grad():
            measured = wan_memory.transformer_peak(wrapped, lambda: wrapped(**inputs), ignore=pipeline.transformer)
    model = av_memory.mini_peak(family, 1, 1, 1)
    assert 0.9 <= measured / model["peak"] <= 1.1, (measured, model)
    if family == "ltx2":
        assert measured / av_memory.ltx2_peak(mini, 1, 1, batch=1)["peak"] > 1.5


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
    ltx, h3 = data["real"]["LTX-2.3"], data["real"]["MiniMax-H3"]
    assert {"2:cfg2", "8:cfg2×ulysses4", "8:ulysses8"} <= set(ltx) and "8:ulysses8" in h3
    assert not any("cfg" in key for key in h3)  # guidance-distilled: no second branch to split
    assert 18e9 < ltx["2:ulysses2"]["weights"]["total"] / 2 < 20e9  # the 19 B transformer diffusers lays out
    assert 32e9 < h3["2:ulysses2"]["weights"]["total"] / 2 < 34e9
    # the audio stays whole on every rank, as LTX-2's plan keeps it: splitting it would change the figure
    split = av_memory.ltx2_peak(memory_table.LTX2_3, 8, 1, batch=2, audio_split=True)["peak"]
    assert split < ltx["8:ulysses8"]["activations"]["peak"]


def test_a_pool_holding_both_wan_experts_whole_counts_two_14b_transformers():
    _, cls_name, config, experts, _ = memory_table.RELEASED["Wan 2.2 A14B"]
    whole = memory_table.whole_bytes(cls_name, config, experts)
    assert 2 * 14e9 * 2 < whole["bf16"] < 2 * 14.5e9 * 2  # two experts of 14 B parameters
    assert 0.5 < whole["fp8"] / whole["bf16"] < 0.52  # fp8 blocks; embeddings, norms and head stay bf16
    assert "Wan 2.2 A14B's two loaders on one pool" in memory_table.report(None)[0]
