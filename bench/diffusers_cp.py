"""diffusers' own context parallelism, made to run on CPU ranks over gloo, as the benchmark's peer.

diffusers 0.42 assumes an accelerator in two places, so on a CPU build it cannot run as shipped:

1. `ModelMixin._resolve_parallel_config` puts rank r on device `r % torch.accelerator.device_count()`,
   which is 0 on CPU: ZeroDivisionError. We report one device only while `enable_parallelism` runs;
   the mesh it then builds is a plain CPU/gloo DeviceMesh, which works.
2. Its ring attention asks the backend's forward op for the log-sum-exp to merge blocks, and the
   native (SDPA) op refuses `return_lse`. We give that op a CPU path through
   `aten::_scaled_dot_product_flash_attention_for_cpu`, which returns the lse ([B, H, S], turned into
   diffusers' [B, S, H]). Without `return_lse` (Ulysses, plain runs) the original op runs unchanged.

Both patches live here and only in the benchmark process; nothing in the product changes.
`FunctionalCollectiveBytes` counts what diffusers puts on the wire, the way GroupCoordinator.bytes_sent
does for our engine, so the two columns compare like for like.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.distributed._functional_collectives as funcol
from diffusers import ContextParallelConfig
from diffusers.models import attention_dispatch


@contextlib.contextmanager
def _one_accelerator_device() -> Iterator[None]:
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(1, original())
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def _with_cpu_lse(original):
    @functools.wraps(original)
    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        if not return_lse or query.device.type != "cpu":
            return original(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            return_lse, _save_ctx=_save_ctx, _parallel_config=_parallel_config)
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # diffusers' [B, S, H, D] -> SDPA's [B, H, S, D]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out.transpose(1, 2), lse.transpose(1, 2)

    forward_op._bench_cpu_lse = True
    return forward_op


def install_cpu_support() -> None:
    """Patch 2 above, once per process (inference only: the backward op is left as it is)."""
    current = attention_dispatch._native_attention_forward_op
    if not getattr(current, "_bench_cpu_lse", False):
        attention_dispatch._native_attention_forward_op = _with_cpu_lse(current)


def enable_context_parallel(transformer: torch.nn.Module, *, ulysses_degree: int = 1, ring_degree: int = 1) -> None:
    """diffusers' `enable_parallelism` on a CPU transformer (every rank of the world must call it)."""
    install_cpu_support()
    with _one_accelerator_device():
        config = ContextParallelConfig(ulysses_degree=ulysses_degree, ring_degree=ring_degree)
        transformer.enable_parallelism(config=config)


class FunctionalCollectiveBytes:
    """Counts bytes this rank sends through the functional collectives diffusers' CP uses.

    all_to_all_single with equal splits keeps 1/N of the tensor and sends the rest; all_gather_tensor
    sends the local tensor to N-1 peers. Counting happens only inside `counting()`.
    """

    def __init__(self) -> None:
        self.bytes_sent = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator["FunctionalCollectiveBytes"]:
        originals = {name: getattr(funcol, name) for name in ("all_to_all_single", "all_gather_tensor")}

        def all_to_all_single(x, output_split_sizes, input_split_sizes, group, *args, **kwargs):
            n = _group_size(group)
            self.bytes_sent += x.nbytes * (n - 1) // n
            return originals["all_to_all_single"](x, output_split_sizes, input_split_sizes, group, *args, **kwargs)

        def all_gather_tensor(x, gather_dim, group, *args, **kwargs):
            self.bytes_sent += x.nbytes * (_group_size(group) - 1)
            return originals["all_gather_tensor"](x, gather_dim, group, *args, **kwargs)

        funcol.all_to_all_single, funcol.all_gather_tensor = all_to_all_single, all_gather_tensor
        try:
            yield self
        finally:
            funcol.all_to_all_single = originals["all_to_all_single"]
            funcol.all_gather_tensor = originals["all_gather_tensor"]


def _group_size(group) -> int:
    """diffusers 0.42 passes a ProcessGroup (mesh.get_group()); a DeviceMesh would answer size() too."""
    return group.size()
