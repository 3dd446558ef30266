"""flash-attn's kernel (USP's `flash_attn`, what the engine picks on CUDA in bf16 where the package is installed)
against the plain formula: output and log-sum-exp. scripts/gpu_check.sh runs this file only where `import flash_attn`
works (it is an optional extra, built for the machine's CUDA), so nothing here is ever skipped.
"""

from __future__ import annotations

import torch

from conftest import relative_l2


def test_flash_attn_equals_the_math_kernel_and_is_picked(record):
    from parallel.model_executor.attention.kernels import KERNELS, default_scale, pick_kernel

    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    assert pick_kernel(q) is KERNELS["flash_attn"]
    out, lse = KERNELS["flash_attn"](q, k, v, default_scale(q))
    expected, expected_lse = KERNELS["math"](q, k, v, default_scale(q))
    error = relative_l2(out, expected)
    record("flash_attn", f"installed; its kernel is picked and equals the formula (relative L2 {error:.1e})")
    assert error < 1e-2 and (lse - expected_lse).abs().max().item() < 1e-2
