"""Local attention kernels that also return the log-sum-exp, chosen by name.

Ring attention needs each block's log-sum-exp to merge partial results exactly. Backends register
themselves in `KERNELS`; `pick_kernel` chooses the best one available for the tensors at hand:
flash-attn on CUDA when installed (an optional extra, imported lazily), PyTorch's own fused kernels
otherwise, and a plain math kernel as the reference every other backend is tested against.
All kernels take and return the SDPA layout [batch, heads, tokens, head_dim]; lse is fp32 [B, H, S].
"""

from __future__ import annotations

import importlib.util
import math
from typing import Callable

import torch

AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
KERNELS: dict[str, AttentionKernel] = {}


def register_kernel(name: str):
    def decorate(fn: AttentionKernel) -> AttentionKernel:
        KERNELS[name] = fn
        return fn

    return decorate


@register_kernel("math")
def math_attention(q, k, v, scale):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype), lse


def biased_attention(q, k, v, scale, bias):
    """The math kernel with an additive bias [B, 1 or H, Q, K] on the scores (a mask a plan carries through USP,
    ParallelPlan.attention_masks): exact, and the reference the fused kernels are; they take no bias with lse here."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return out.to(q.dtype), lse


@register_kernel("cpu_flash")
def cpu_flash_attention(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out, lse.float()


@register_kernel("cuda_flash")
def cuda_flash_attention(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse.float()


@register_kernel("cuda_efficient")
def cuda_efficient_attention(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[:2]
    return out, lse[..., : q.shape[2]].float()


@register_kernel("flash_attn")
def flash_attn_attention(q, k, v, scale):
    from flash_attn import flash_attn_func  # optional extra: only imported when chosen

    out, lse, _ = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, return_attn_probs=True
    )
    return out.transpose(1, 2), lse.float()


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def pick_kernel(q: torch.Tensor, preferred: str | None = None) -> AttentionKernel:
    """The named kernel, or the fastest one that supports `q`'s device and dtype."""
    if preferred is not None:
        if preferred not in KERNELS:
            raise ValueError(f"unknown attention kernel {preferred!r}; choose one of {sorted(KERNELS)}")
        return KERNELS[preferred]
    if q.device.type == "cpu":
        return KERNELS["cpu_flash"]
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half and flash_attn_available():
            return KERNELS["flash_attn"]
        return KERNELS["cuda_flash" if half else "cuda_efficient"]
    return KERNELS["math"]


def default_scale(q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])
