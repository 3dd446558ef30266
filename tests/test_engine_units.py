"""Single-process checks of the engine's pieces: mesh layout, layout errors, kernels, registers."""

from __future__ import annotations

import pytest
import torch

from parallel.layout.config import LayoutError, ParallelConfig
from parallel.distributed.parallel_state import RankLayout
from parallel.model_executor import capability_table
from parallel.model_executor.attention import KERNELS
from parallel.families import FAMILIES
from parallel.model_executor.register import xFuserSchedulerWrappersRegister


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
        FAMILIES.for_transformer(torch.nn.Linear(1, 1))
    from diffusers import LCMScheduler

    with pytest.raises(ValueError, match="LCMScheduler is not a supported scheduler"):
        xFuserSchedulerWrappersRegister.get_wrapper(LCMScheduler())


def test_capability_table_lists_every_family():
    table = capability_table()
    for pipeline in ("PixArtAlphaPipeline", "PixArtSigmaPipeline", "StableDiffusion3Pipeline", "FluxPipeline"):
        assert f"| {pipeline} |" in table


def test_pipefusion_degree_above_the_block_count_fails_before_compute():
    from types import SimpleNamespace

    from parallel.model_executor.pipefusion import PipeFusionStage
    from parallel.families.pixart import PIXART
    from parallel.loading import tiny_models

    transformer = tiny_models.build_tiny_pipeline("pixart-alpha").transformer
    five_stages = SimpleNamespace(world_size=5, rank_in_group=0)
    with pytest.raises(LayoutError, match="pipefusion degree 5 is more than the model's 4 blocks"):
        PipeFusionStage(transformer, PIXART.plan.pipefusion, five_stages, 5, 1, lambda: "x")


def test_stages_take_equal_block_counts():
    from parallel.model_executor.pipefusion import even_stages

    assert even_stages(8, 2) == [(0, 4), (4, 8)]  # Flux: 4 double then 4 single blocks, the same work per token
    assert even_stages(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert even_stages(8, 3) == [(0, 2), (2, 5), (5, 8)]


@pytest.mark.parametrize("dtype, share", [("bf16", 0.5), ("fp8", 0.35)])  # fp8: norms stay bf16
def test_weight_dtypes_shrink_the_transformer_and_still_sample(tiny_model_dirs, dtype, share):
    from parallel.loading import tiny_models
    from parallel.loading.pipelines import load_pipeline

    def transformer_bytes(pipeline):
        return sum(p.numel() * p.element_size() for p in pipeline.transformer.parameters())

    full = load_pipeline(tiny_model_dirs["flux"])
    small = load_pipeline(tiny_model_dirs["flux"], dtype=dtype)
    assert transformer_bytes(small) <= share * transformer_bytes(full) * 1.05
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tiny_models.make_inputs("flux", negative=False).items()}
    with torch.no_grad():
        out = small(**inputs, num_inference_steps=2, guidance_scale=3.5, height=64, width=64, output_type="latent",
                    return_dict=False)[0]
    assert torch.isfinite(out.float()).all()
