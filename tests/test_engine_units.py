"""Single-process checks of the engine's pieces: mesh layout, layout errors, kernels, registers."""

from __future__ import annotations

import pytest
import torch

from parallel.config import LayoutError, ParallelConfig
from parallel.distributed.parallel_state import RankLayout
from parallel.model_executor import capability_table
from parallel.model_executor.attention import KERNELS
from parallel.model_executor.register import xFuserSchedulerWrappersRegister, xFuserTransformerWrappersRegister


def test_mesh_puts_ulysses_innermost_and_dp_outermost():
    layout = RankLayout(ParallelConfig(dp_degree=2, ring_degree=2, ulysses_degree=2))
    assert layout.groups("ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("sp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coordinates(5) == {"dp": 1, "cfg": 0, "pp": 0, "ring": 0, "ulysses": 1}


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    layout = RankLayout(ParallelConfig(dp_degree=2, cfg_degree=2, ring_degree=2))
    for name in ("dp", "cfg", "pp", "sp", "ring", "ulysses"):
        members = sorted(rank for group in layout.groups(name) for rank in group)
        assert members == list(range(8)), name


@pytest.mark.parametrize(
    "config, world, message",
    [
        (ParallelConfig(ulysses_degree=2, ring_degree=2), 2, "= 4, but there are 2 ranks"),
        (ParallelConfig(cfg_degree=3), 3, "use 1 or 2"),
        (ParallelConfig(dp_degree=0), 1, "must be an integer >= 1"),
    ],
)
def test_layout_errors_are_one_line_with_numbers(config, world, message):
    with pytest.raises(LayoutError) as error:
        config.check(world)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["cpu_flash"])
def test_kernels_match_math_reference_with_lse(name):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 16, generator=generator) for n in (5, 7, 7))
    out, lse = KERNELS[name](q, k, v, 0.25)
    ref_out, ref_lse = KERNELS["math"](q, k, v, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25), atol=1e-5, rtol=1e-5)


def test_unsupported_class_names_itself_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"Linear is not a supported transformer; supported: .*FluxTransformer2DModel"):
        xFuserTransformerWrappersRegister.get_wrapper(torch.nn.Linear(1, 1))
    from diffusers import LCMScheduler

    with pytest.raises(ValueError, match="LCMScheduler is not a supported scheduler"):
        xFuserSchedulerWrappersRegister.get_wrapper(LCMScheduler())


def test_capability_table_lists_every_family():
    table = capability_table()
    for pipeline in ("PixArtAlphaPipeline", "PixArtSigmaPipeline", "StableDiffusion3Pipeline", "FluxPipeline"):
        assert f"| {pipeline} |" in table
