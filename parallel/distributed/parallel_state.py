"""Process-wide parallel state: the world, the mesh and one GroupCoordinator per dimension.

The mesh is laid out once in `RankLayout` (dp outermost, then cfg, pp, ring, ulysses innermost) so
ranks that talk most (Ulysses all-to-all) are neighbours. `initialize_model_parallel` and
`destroy_model_parallel` may be called again and again in one process: the pool re-initialises when
it switches layout or recovers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout.config import ParallelConfig
from . import devices
from .group_coordinator import GroupCoordinator

AXES = ("dp", "cfg", "pp", "ring", "ulysses")
GROUPS = {"dp": ("dp",), "cfg": ("cfg",), "pp": ("pp",), "sp": ("ring", "ulysses"), "ring": ("ring",), "ulysses": ("ulysses",)}


@dataclass(frozen=True)
class RankLayout:
    """Where every rank sits in the dp × cfg × pp × ring × ulysses mesh."""

    config: ParallelConfig

    @property
    def shape(self) -> tuple[int, ...]:
        c = self.config
        return (c.dp_degree, c.cfg_degree, c.pipefusion_degree, c.ring_degree, c.ulysses_degree)

    def coordinates(self, rank: int) -> dict[str, int]:
        mesh = torch.arange(self.config.world_size).reshape(self.shape)
        index = (mesh == rank).nonzero()[0].tolist()
        return dict(zip(AXES, index))

    def groups(self, name: str) -> list[list[int]]:
        """All rank lists of the group `name`: ranks that differ only along that group's axes."""
        axes = [AXES.index(a) for a in GROUPS[name]]
        rest = [i for i in range(len(AXES)) if i not in axes]
        mesh = torch.arange(self.config.world_size).reshape(self.shape).permute(*rest, *axes)
        size = 1
        for a in axes:
            size *= self.shape[a]
        return mesh.reshape(-1, size).tolist()


_WORLD: GroupCoordinator | None = None
_GROUPS: dict[str, GroupCoordinator] = {}
_LAYOUT: RankLayout | None = None


def init_distributed_environment(backend: str | None = None, share_gpus: bool = False,
                                 store: dist.Store | None = None) -> GroupCoordinator:
    """Join the world: torchrun's (env://), or through `store`, one its launcher hosts (the pool's supervisor binds
    it to one address, which torchrun cannot), this rank's RANK and WORLD_SIZE from the environment either way.
    NCCL when CUDA is present, gloo otherwise. Before NCCL starts, this machine's cards are checked and each rank
    placed (devices.py: peer access, mixed cards, more ranks than cards, which `share_gpus` allows over gloo); a
    DeviceError is one line naming the fix."""
    global _WORLD
    if not dist.is_initialized():
        if backend is None:
            plan = devices.apply(devices.plan_devices(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), share_gpus=share_gpus))
            backend = plan.backend
        elif backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if store is None:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
    if _WORLD is None:
        _WORLD = GroupCoordinator("world", list(range(dist.get_world_size())), dist.group.WORLD)
    return _WORLD


def initialize_model_parallel(config: ParallelConfig) -> RankLayout:
    """Carve the world into the groups of `config`; every rank must call this with the same config."""
    global _LAYOUT
    world = init_distributed_environment()
    config.check(world.world_size)
    config = config.for_world(world.world_size)
    if _LAYOUT is not None:
        destroy_model_parallel()
    layout = RankLayout(config)
    for name in GROUPS:
        for ranks in layout.groups(name):
            # new_group is collective over the world: every rank creates every group, keeps its own.
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if world.rank in ranks:
                _GROUPS[name] = GroupCoordinator(name, ranks, group)
    _LAYOUT = layout
    return layout


def model_parallel_is_initialized() -> bool:
    return _LAYOUT is not None


def destroy_model_parallel() -> None:
    global _LAYOUT
    for coordinator in _GROUPS.values():
        if coordinator.group is not None:
            dist.destroy_process_group(coordinator.group)
    _GROUPS.clear()
    _LAYOUT = None


def destroy_distributed_environment() -> None:
    global _WORLD
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None


def _group(name: str) -> GroupCoordinator:
    if name not in _GROUPS:
        raise RuntimeError("parallel state is not initialised: call initialize_model_parallel(config) first")
    return _GROUPS[name]


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError("torch.distributed is not initialised: call init_distributed_environment() first")
    return _WORLD


def get_layout() -> RankLayout:
    if _LAYOUT is None:
        raise RuntimeError("parallel state is not initialised: call initialize_model_parallel(config) first")
    return _LAYOUT


def get_dp_group() -> GroupCoordinator:
    return _group("dp")


def get_cfg_group() -> GroupCoordinator:
    return _group("cfg")


def get_pp_group() -> GroupCoordinator:
    return _group("pp")


def get_sp_group() -> GroupCoordinator:
    return _group("sp")


def get_ulysses_group() -> GroupCoordinator:
    return _group("ulysses")


def get_ring_group() -> GroupCoordinator:
    return _group("ring")


def all_coordinators() -> dict[str, GroupCoordinator]:
    return dict(_GROUPS)
