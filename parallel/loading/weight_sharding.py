"""`--shard-weights`: every transformer block's weights split over the ranks with PyTorch's FSDP2.

Models larger than one card fit when each rank keeps 1/N of every block and the block's whole weights
exist only while it runs: `fully_shard` all-gathers a block just before its forward and frees the gathered
copy after it. The blocks are the elements of the transformer's top-level `ModuleList`s (Flux's double and
single stacks, SD3's and PixArt's `transformer_blocks`, Wan's `blocks`, FLUX 3's per-mode lists), which hold
almost all weights; embeddings, norms and the output projection stay replicated. Every rank must run the same blocks in the same
order, so this composes with Ulysses, Ring, CFG parallel and data parallel (all ranks run every block on
their own part of the work), and not with PipeFusion, where each stage runs other blocks. Alone (every degree 1)
the ranks are data-parallel replicas that split a batch where it divides and otherwise each run the whole batch
(config.ParallelConfig.for_world): memory relief for a family without sequence parallelism, at the cost of
docs/shard-weights.md.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from ..pipeline_transformers import TRANSFORMERS


def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The elements of the top-level ModuleLists, and of ModuleLists in a top-level ModuleDict (FLUX 3's per-mode
    blocks, one list per token mode)."""
    lists = []
    for child in transformer.children():
        if isinstance(child, torch.nn.ModuleDict):
            lists += [value for value in child.values() if isinstance(value, torch.nn.ModuleList)]
        elif isinstance(child, torch.nn.ModuleList):
            lists.append(child)
    return [block for blocks in lists for block in blocks]


def shard_weights(pipeline, offload: bool = False) -> None:
    """Shard the blocks of every transformer of the pipeline (Wan 2.2's two experts, MiniMax-H3's `transformer_ref`)
    over the whole world;
    `offload` (--offload): the shards live in (pinned) CPU memory and are copied in for their block's gather."""
    world = torch.distributed.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world,))
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for name in TRANSFORMERS:
        transformer = getattr(pipeline, name, None)
        if transformer is None:
            continue
        for block in transformer_blocks(transformer):
            original = type(block)
            fully_shard(block, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
            _keep_step_cache_metadata(original, type(block))


def _keep_step_cache_metadata(original: type, sharded: type) -> None:
    """diffusers' step caches (FirstBlockCache, TaylorSeer) look a block's metadata up by its exact class, and
    `fully_shard` gives each sharded block a subclass of its own: register the subclass like the original."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    try:
        metadata = TransformerBlockRegistry.get(original)
    except ValueError:  # a block diffusers' caches do not know: nothing to keep
        return
    TransformerBlockRegistry.register(sharded, dataclasses.replace(metadata))


def parameter_shares(pipeline) -> dict[str, list[float]]:
    """Each transformer's parameter bytes on each rank over its unsharded bytes, in rank order, so a transformer left
    whole shows (a collective: every rank calls it)."""
    shares = {}
    for name in TRANSFORMERS:
        transformer = getattr(pipeline, name, None)
        if transformer is None:
            continue
        mine = whole = 0
        for parameter in transformer.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            mine += local.numel() * local.element_size()
            whole += parameter.numel() * parameter.element_size()
        share = torch.tensor([mine / whole], dtype=torch.float64, device=pipeline.transformer.device)
        every = [torch.zeros_like(share) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(every, share)
        shares[name] = [float(s) for s in every]
    return shares
