"""`--fp8-matmul`: fp8 weights multiplied in fp8 (`torch._scaled_mm`) instead of dequantized to bf16 first.

Dequantizing before a bf16 matmul (fp8.Fp8Linear's default) saves memory but costs time: on an H100 a ComfyUI
fp8 file ran 1.28× slower than bf16 (bench/RESULTS.md). GPUs with fp8 tensor cores (compute capability 8.9 and
up: Ada, Hopper, Blackwell) multiply fp8 directly, as ComfyUI's fast fp8 does (comfy/ops.py, `fp8_linear`):
the weight stays as the file stores it, with its per-tensor scale; each call quantizes its activations to
float8_e4m3fn with a scale of their own, amax / 448, per row (one per token: Hopper and newer) or per tensor
(Ada, whose `_scaled_mm` takes per-tensor scales only), on CUDA in one kernel (`quantizer`), and `_scaled_mm`
multiplies, rescales into the compute dtype and adds the bias. ComfyUI clamps the activations with a scale of 1 where the file gives no input scale; a scale
from the activations' own range keeps small activations' precision, at one reduction per call.

When: `--fp8-matmul` on a card that has fp8 tensor cores; by default (neither `--fp8-matmul` nor
`--no-fp8-matmul`) where ComfyUI would run the file fast: its `scaled_fp8` marker (other than ComfyUI's
2-element "no fast matmul" marker) or per-layer `comfy_quant` metadata without `full_precision_matrix_mult`
(scaled.comfy_fast). Elsewhere, and for e5m2 weights or shapes `_scaled_mm` does not take (a side not a
multiple of 16), the weights dequantize as before. The CPU has `_scaled_mm` for fp8 too (torch ≥ 2.x),
which the tests use to check the path against the dequantized weights; the engine never picks it there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
MODES = ("row", "tensor")  # how the activations are scaled


def hardware_mode(device: torch.device) -> str | None:
    """The activation scaling this device's fp8 matmuls take, or None where it has no fp8 tensor cores."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return None
    return "row" if capability >= (9, 0) else "tensor"


def quantize(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [M, K] as float8_e4m3fn and its fp32 scale ([M, 1] per row, [] per tensor): x ≈ q · scale. Four passes
    over the activations (the max norm, the division into fp32, the clamp in place, the cast): on the first lent
    H200 the separate abs, amax and upcast made quantizing dearer than the fp8 matmul saved (bench/RESULTS.md)."""
    over = {"dim": -1, "keepdim": True} if mode == "row" else {}
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32, **over)
    scale = (amax / E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    divisor = scale if mode == "row" else scale.reshape(1)  # a 0-d fp32 divisor would divide a bf16 x in bf16
    return torch.div(x, divisor).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


_QUANTIZERS: dict[tuple[str, str], Callable] = {}
HOW = ("triton", "compiled", "eager")  # how the activations are quantized on CUDA: one kernel, inductor's, 4 passes


def quantizer(device: torch.device, mode: str, how: str | None = None) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`quantize` for this device. On CUDA by default one kernel: per row fp8_rows' Triton kernel (one read, one
    write, no guards), per tensor torch.compile's fusion of the passes; `how` picks one (bench.fp8_linear compares
    them: the eager four passes made the first lent H200's fp8 matmuls 0.64× bf16's speed). Eager elsewhere, under
    --compile (the transformer's graph fuses it) and if the kernel cannot be built here (said once)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return lambda x: quantize(x, mode)
    how = how or ("triton" if mode == "row" else "compiled")
    if (mode, how) not in _QUANTIZERS:
        _QUANTIZERS[mode, how] = _built(mode, how)
    return _QUANTIZERS[mode, how]


def kernel(mode: str, how: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The quantizer `how` names, as built, without `quantizer`'s eager fallback (tests/gpu checks each on a card)."""
    if how == "eager":
        return lambda x: quantize(x, mode)
    if how == "triton":
        if mode != "row":
            raise ValueError("the Triton quantizer scales per row")
        from .fp8_rows import MAX_WIDTH, quantize_rows

        return lambda x: quantize_rows(x) if x.shape[-1] <= MAX_WIDTH else quantize(x, mode)
    return torch.compile(lambda x: quantize(x, mode), dynamic=None, fullgraph=True)


def _built(mode: str, how: str) -> Callable:
    built = kernel(mode, how)

    def first(x):  # the first call builds the kernel: where that fails, the eager passes from then on
        try:
            result = built(x)
        except Exception as error:
            print(f"xdit: fp8 activations quantized eagerly: the {how} quantizer failed "
                  f"({type(error).__name__}: {str(error)[:400]})", flush=True)
            _QUANTIZERS[mode, how] = lambda x: quantize(x, mode)
            return quantize(x, mode)
        _QUANTIZERS[mode, how] = built
        return result

    return first


def takes(layer) -> bool:
    """Whether `_scaled_mm` takes this Fp8Linear: e4m3 weights whose sides are multiples of 16."""
    return layer.fp8_dtype == E4M3 and layer.in_features % 16 == 0 and layer.out_features % 16 == 0


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    """x @ (weight · scale).T + bias with `weight` [N, K] in float8_e4m3fn, multiplied in fp8; out in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:  # a stream of no tokens (PipeFusion's patches): nothing to scale
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    q, x_scale = quantizer(rows.device, mode)(rows)
    w_scale = scale.float().reshape(1, 1).expand(1, weight.shape[0]).contiguous() if mode == "row" else scale.float()
    out_dtype = torch.bfloat16 if mode == "row" else x.dtype  # CUDA's row-wise scaling writes bf16 only
    # on CUDA the row-wise kernel adds a bf16 bias itself (on the lent H200: +3 µs, not a pass over the output)
    fused_bias = bias.to(out_dtype) if bias is not None and x.is_cuda and mode == "row" else None
    out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=w_scale, bias=fused_bias,
                           out_dtype=out_dtype).to(x.dtype)
    if bias is not None and fused_bias is None:
        out = out + bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
