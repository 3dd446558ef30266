"""Distributed state after xDiT: parallel_state (mesh and groups), group_coordinator, runtime_state."""

from .group_coordinator import GroupCoordinator
from .parallel_state import RankLayout, destroy_distributed_environment, destroy_model_parallel, get_cfg_group, get_dp_group, get_layout, get_pp_group, get_ring_group, get_sp_group, get_ulysses_group, get_world_group, init_distributed_environment, initialize_model_parallel, model_parallel_is_initialized
from .runtime_state import RuntimeState, get_runtime_state, reset_runtime_state

__all__ = [
    "GroupCoordinator",
    "RankLayout",
    "RuntimeState",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_cfg_group",
    "get_dp_group",
    "get_layout",
    "get_pp_group",
    "get_ring_group",
    "get_runtime_state",
    "get_sp_group",
    "get_ulysses_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "reset_runtime_state",
]
