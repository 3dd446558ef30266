"""Row-wise fp8 quantization of activations in one Triton kernel: one read of the bf16 rows, one write of their
float8_e4m3fn codes and fp32 scales (amax / 448 per row), launched without torch.compile's guards.

`fp8_matmul.quantize` does the same in four eager passes, which cost more than the fp8 matmul saved on the first
lent H200 (bench/RESULTS.md); a compiled version of it still paid its guards on every call. Imported only on
CUDA, where Triton comes with PyTorch; elsewhere fp8_matmul never asks for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 32768  # a row is one program's block: wider rows take the eager passes
# a kernel reads only constexpr globals (the first lent H200 refused plain floats here)
E4M3_MAX = tl.constexpr(448.0)
TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: an all-zero row's scale, as quantize's clamp


@triton.jit
def _quantize_rows(x_ptr, q_ptr, scale_ptr, width, x_stride, q_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    inside = columns < width
    x = tl.load(x_ptr + row * x_stride + columns, mask=inside, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / E4M3_MAX, TINY)
    codes = tl.minimum(tl.maximum(x / scale, -E4M3_MAX), E4M3_MAX)
    tl.store(q_ptr + row * q_stride + columns, codes.to(tl.float8e4nv), mask=inside)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [M, K] (rows contiguous, K ≤ MAX_WIDTH) as float8_e4m3fn codes and their fp32 scales [M, 1]."""
    rows, width = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty(rows, width, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(width)
    _quantize_rows[(rows,)](x, codes, scales, width, x.stride(0), codes.stride(0), BLOCK=block,
                            num_warps=min(max(block // 512, 4), 16))
    return codes, scales
