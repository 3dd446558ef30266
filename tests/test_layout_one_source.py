"""The parallel layout has one source, ParallelConfig's field declarations (parallel/layout/config.py): contract E's
and the pool's flags, the rank command line, the xDiT Pool node's inputs, the status and the panel's check all
come from it. Every test here walks the declared fields, so a field added there is covered without a new line.
"""

from __future__ import annotations

import argparse
import dataclasses
import types

import pytest

from parallel.fields import UNSET, fields_of, to_flags, to_plain
from parallel.layout.config import AutoLayout, LayoutError, ParallelConfig, add_parallel_arguments, config_from_args
from workers.rank.process import parse_args
from workers.supervisor import PoolSpec
from xdit_test_helpers import import_node_module


SET = [f for f in fields_of(ParallelConfig) if f.rule.flag is not None]  # a user's fields (the rest: derived)


def changed(f) -> object:
    """A value of field `f` other than its default, as a user could set it."""
    if f.rule.flag.on is not UNSET:
        return f.rule.flag.on
    if f.default is None and f.rule.widget.choices:  # a tri-state: on
        return True
    return 3 if f.default in (None, 1) else f.default + 2


def one_field_set() -> list[ParallelConfig]:
    return [ParallelConfig(**{f.name: changed(f)}) for f in SET]


def test_every_field_a_user_sets_has_a_flag_and_a_widget():
    assert all(f.rule.widget is not None for f in SET)
    assert [f.name for f in fields_of(ParallelConfig) if f.rule.flag is None] == ["dp_when_divisible"]


@pytest.mark.parametrize("config", one_field_set(), ids=[f.name for f in SET])
def test_every_field_travels_through_the_flags_and_the_rank_command_line(config):
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    assert config_from_args(parser.parse_args(to_flags(config))) == config
    spec = PoolSpec("m", 2, "tcp://127.0.0.1:1", config)
    rank_args = parse_args([*spec.rank_arguments(), "--control", "ipc:///tmp/control", "--store", "127.0.0.1:3"])
    assert config_from_args(rank_args) == config
    status = spec.layout_status()
    assert {f.name for f in fields_of(ParallelConfig)} <= set(status), "the status shows every field"


def test_the_negative_control_a_field_without_its_flag_does_not_travel():
    """What the tests above would catch: a field whose value the flags do not carry comes back at its default."""
    config = ParallelConfig(ulysses_degree=3)
    argv = [a for a in PoolSpec("m", 3, "tcp://127.0.0.1:1", config).rank_arguments() if a not in ("--ulysses-degree", "3")]
    assert config_from_args(parse_args([*argv, "--control", "ipc:///tmp/control", "--store", "127.0.0.1:3"])) != config


@pytest.fixture
def pool_node(monkeypatch):
    folders = types.ModuleType("folder_paths")
    folders.get_folder_paths = folders.get_filename_list = lambda name: []
    latest = types.ModuleType("comfy_api.latest")

    def widget(kind):
        return types.SimpleNamespace(Input=lambda name, **options: (kind, name, options))

    latest.io = types.SimpleNamespace(Custom=lambda name: name, ComfyNode=object, Int=widget("int"),
                                      Boolean=widget("bool"), Combo=widget("combo"), String=widget("str"))
    return import_node_module(monkeypatch, "pool_node", {"folder_paths": folders, "comfy_api": types.ModuleType("comfy_api"),
                                                        "comfy_api.latest": latest})


def node_values(node, config: ParallelConfig) -> dict:
    """The xDiT Pool widgets' values that stand for `config`, read off its inputs as declared."""
    values = {"nproc": config.world_size, "endpoint": ""}
    for f in SET:
        widget, value = f.rule.widget, getattr(config, f.name)
        if widget.choices is not None:
            value = next(name for name, choice in widget.choices.items() if choice == value)
        elif widget.on is not UNSET:
            value = value == widget.on
        elif widget.unset is not UNSET and value is None:
            value = widget.unset
        values[widget.name or f.name] = value
    return values


def test_the_node_offers_every_field_in_the_order_saved_workflows_keep(pool_node):
    names = [name for _, name, _ in pool_node.layout_inputs(pool_node.FIRST_LAYOUT_INPUTS)]
    assert names == ["ulysses_degree", "ring_degree", "pipefusion_degree", "num_patches", "warmup_steps", "cfg_parallel",
                     "dp_degree"]  # the widget positions of every saved workflow
    later = [name for _, name, _ in pool_node.layout_inputs(pool_node.LATER_LAYOUT_INPUTS, optional=True)]
    rest = [name for _, name, _ in pool_node.layout_inputs(optional=True)]
    declared = {f.rule.widget.name or f.name for f in SET}
    assert set(names) | set(later) | set(rest) == declared


@pytest.mark.parametrize("config", one_field_set(), ids=[f.name for f in SET])
def test_every_field_travels_through_the_node(pool_node, config):
    assert dataclasses.asdict(pool_node.layout_of(node_values(pool_node, config))) == dataclasses.asdict(config)  # (the pack's own copy of the class)


def test_the_panels_check_is_the_servers(pool_node):
    """One check, one message: the route the panel asks (nodes/routes.py) answers ParallelConfig.check's own."""
    bad = dataclasses.replace(ParallelConfig(), ulysses_degree=3)
    values = {**node_values(pool_node, bad), "nproc": 2}
    with pytest.raises(LayoutError) as caught:
        bad.check(2, ranks_flag="nproc")
    assert pool_node.layout_error(values) == str(caught.value)
    assert "= 3, but there are 2 ranks (nproc is 2); set ulysses_degree to 2" in pool_node.layout_error(values)
    assert pool_node.layout_error({**values, "ulysses_degree": 2}) == ""
    assert pool_node.layout_error({**values, "layout": "auto"}) == ""  # auto chooses the degrees itself
    assert to_plain(AutoLayout()) == {}
