"""The analytic activation-memory model of bench/wan_memory.py against a measurement, in one process.

The full comparison (every layout on torchrun ranks) is `python -m bench.wan_memory`; this checks the
single-rank model on the mini Wan in bf16, so a diffusers or engine change that moves the peak shows.
"""

from __future__ import annotations

import torch

from bench import wan_memory
from parallel.loading.pipelines import load_pipeline


def test_single_rank_peak_matches_the_analytic_model(tmp_path):
    wan_memory._save_mini(tmp_path / "mini")
    pipeline = load_pipeline(tmp_path / "mini", dtype="bf16")
    pipeline.set_progress_bar_config(disable=True)
    video = (17, 64, 64)  # 5 latent frames × 4 × 4 = 80 tokens
    with torch.no_grad():
        measured = wan_memory.transformer_peak(pipeline, lambda: pipeline(**wan_memory.mini_inputs(1, video)))
    model = wan_memory.analytic_peak(wan_memory.MINI, wan_memory.video_tokens(*video), 1, 1)
    assert 0.9 <= measured / model["peak"] <= 1.1, (measured, model)


def test_realistic_shape_has_the_documented_token_count():
    assert wan_memory.video_tokens(81, 480, 832) == 21 * 30 * 52
