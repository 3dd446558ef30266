"""Declared fields: a plain typed structure's rules, written once beside its annotation.

The pool's plain structures (a job's request, its step cache, a LoRA, the parallel layout, every message on
the wire) are dataclasses whose fields carry their rules in their metadata (`declared(...)`): a range, the
flag that sets it, the ComfyUI widget that shows it. The annotation gives the type, the default says whether
it may be left out. From that one declaration come
- `from_plain(cls, plain, what)`: the structure from a plain map (msgpack, JSON), checked, one clear error per
  problem (unknown names, missing ones, wrong types, values out of range), nested structures included;
- `to_plain(value)`: the plain map back, defaults left out (what travels);
- `add_flags` / `from_flags` / `to_flags`: the command-line flags of the fields that have one, and the argv
  that gives a value back to another process;
so adding a field is one line, and every hop reads it the same way. No torch here: the pool's light commands
(status, stop) read these structures too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any, Callable

_NONE = type(None)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # a Flag's or Widget's option left unset (dataclasses reserve MISSING for "no default")


@dataclass(frozen=True)
class Flag:
    """How a command line sets a field: `--name VALUE`, or a switch whose presence gives the field `on`."""

    name: str
    help: str = ""
    on: Any = UNSET  # a switch (store_true): the field's value when given (--cfg-parallel: cfg_degree 2)
    choices: tuple = ()
    metavar: str | None = None
    default: Any = UNSET  # the command line's default where the field has none (a request's --steps 20)


@dataclass(frozen=True)
class Widget:
    """How a ComfyUI node shows a field: its input's name (default: the field's), default, bounds and tooltip.
    `on`: a boolean input standing for the field's value `on` (cfg_parallel for cfg_degree 2); `unset`: the
    widget value that means the field's None (num_patches 0); `choices`: a combo of named values (auto / on / off)."""

    tooltip: str
    name: str = ""
    default: Any = UNSET
    minimum: int = 1
    maximum: int | None = None
    on: Any = UNSET
    unset: Any = UNSET
    choices: dict[str, Any] | None = None  # a combo: each choice's field value (the first is the default)


@dataclass(frozen=True)
class Rule:
    minimum: float | None = None
    maximum: float | None = None
    above_minimum: bool = False  # the minimum itself is excluded (denoise > 0)
    check: Callable[[str, Any], None] | None = None  # what the type cannot say (a key's pattern, a text's length)
    flag: Flag | None = None
    widget: Widget | None = None
    wire: bool = True  # False: not read from or written to a plain map (the envelope's own fields)


def declared(default: Any = MISSING, *, factory: Any = MISSING, minimum: float | None = None,
             maximum: float | None = None, above_minimum: bool = False, check: Callable[[str, Any], None] | None = None,
             flag: Flag | None = None, widget: Widget | None = None, wire: bool = True) -> Any:
    """A dataclass field with its rules (see the module's docstring)."""
    rule = Rule(minimum, maximum, above_minimum, check, flag, widget, wire)
    return dataclasses.field(default=default, default_factory=factory, metadata={"rule": rule})


@dataclass(frozen=True)
class Declared:
    """One field of a declared structure: its name, type, rule and default."""

    name: str
    type: Any
    rule: Rule
    default: Any  # MISSING: required

    @property
    def required(self) -> bool:
        return self.default is MISSING


@cache
def fields_of(cls: type) -> tuple[Declared, ...]:
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        found.append(Declared(f.name, hints[f.name], f.metadata.get("rule", Rule()), default))
    return tuple(found)


def wire_fields(cls: type) -> tuple[Declared, ...]:
    return tuple(f for f in fields_of(cls) if f.rule.wire)


# -- plain maps ----------------------------------------------------------------------------------------
def from_plain(cls: type, plain: Any, what: str = "", **envelope: Any):
    """`cls` from a plain map, every field checked; `envelope`: fields that do not travel in the map."""
    prefix = f"{what} " if what else ""
    if not isinstance(plain, dict):
        raise ValueError(f"{prefix}must be dict, not {type(plain).__name__}")
    declared_fields = wire_fields(cls)
    known = {f.name for f in declared_fields}
    unknown = sorted(set(plain) - known, key=str)
    if unknown:
        raise ValueError(f"{prefix}does not take {unknown}; it takes {sorted(known)}")
    values = dict(envelope)
    for f in declared_fields:
        if f.name not in plain:
            if f.required:
                raise ValueError(f"{prefix}needs {f.name!r}")
            continue
        values[f.name] = check_value(f"{prefix}{f.name}", plain[f.name], f.type, f.rule)
    return cls(**values)


def to_plain(value: Any, defaults: bool = False) -> Any:
    """A declared structure (or a value inside one) as plain data, fields at their default left out (or kept)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        plain = {}
        for f in wire_fields(type(value)):
            item = getattr(value, f.name)
            if defaults or item != f.default:
                plain[f.name] = to_plain(item, defaults)
        return plain
    if isinstance(value, (list, tuple)):
        return [to_plain(item, defaults) for item in value]
    if isinstance(value, dict):
        return {key: to_plain(item, defaults) for key, item in value.items()}
    return value


def check_value(name: str, value: Any, kind: Any, rule: Rule = Rule()) -> Any:
    """`value` checked against the annotation `kind` and `rule`; returns it as the field keeps it (floats as
    float, lists of a tuple field as tuples, nested maps as their structure)."""
    typed = _typed(name, value, kind)
    if rule.minimum is not None and rule.maximum is not None and isinstance(typed, (int, float)):
        low, high = rule.minimum, rule.maximum
        if (typed <= low if rule.above_minimum else typed < low) or typed > high:
            span = f"a value above {low:g} and at most {high:g}" if rule.above_minimum else f"{low:g} to {high:g}"
            raise ValueError(f"{name} is {value}; use {span}")
    if rule.check is not None:
        rule.check(name, typed)
    return typed


def _expected(kind: Any) -> str:
    if kind is float:
        return "int or float"
    origin = typing.get_origin(kind) or kind
    if origin in (types.UnionType, typing.Union):
        names = [part for arg in typing.get_args(kind) if arg is not _NONE for part in _expected(arg).split(" or ")]
        return " or ".join(dict.fromkeys(names))
    if origin is tuple:
        return "list"
    if dataclasses.is_dataclass(origin):
        return "dict"
    return getattr(origin, "__name__", str(origin))


def _matches(value: Any, kind: Any) -> bool:
    """Whether `value` has the plain type `kind` travels as (not yet whether its contents are right)."""
    if kind is Any:
        return True
    if kind is _NONE:
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(kind) or kind
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in typing.get_args(kind))
    if dataclasses.is_dataclass(origin):
        return isinstance(value, dict)
    plain = list if origin is tuple else origin
    return isinstance(value, plain) and (kind is bool or not isinstance(value, bool))


def _typed(name: str, value: Any, kind: Any) -> Any:
    if not _matches(value, kind):
        raise ValueError(f"{name} must be {_expected(kind)}, not {type(value).__name__}")
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):  # the first member the value's type matches
        return _typed(name, value, next(arg for arg in args if _matches(value, arg)))
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite")
        return float(value)
    if dataclasses.is_dataclass(kind):
        return from_plain(kind, value, name)
    if origin is dict and args:
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{name} parameter names must be strings, not {type(key).__name__}")
        return {key: _typed(f"{name} {key}", item, args[1]) for key, item in value.items()}
    if origin in (list, tuple) and args:
        items = [_typed(f"{name}[{i}]", item, args[0]) for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    return value


# -- command lines ---------------------------------------------------------------------------------------
def _dest(flag: Flag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def _scalar(kind: Any) -> type:
    args = [a for a in typing.get_args(kind) if a is not _NONE]
    return args[0] if args else kind


def _tristate(f: Declared) -> bool:
    """A `bool | None` field: `--name` / `--no-name`, neither leaving it None (decided elsewhere)."""
    return _scalar(f.type) is bool and f.rule.flag.on is UNSET


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """The flags of `cls`'s fields that declare one, defaults as declared."""
    for f in fields_of(cls):
        flag = f.rule.flag
        if flag is None:
            continue
        if flag.on is not UNSET:
            parser.add_argument(flag.name, action="store_true", help=flag.help)
        elif _tristate(f):
            parser.add_argument(flag.name, action=argparse.BooleanOptionalAction, default=f.default, help=flag.help)
        else:
            default = flag.default if flag.default is not UNSET else f.default
            parser.add_argument(flag.name, type=_scalar(f.type), default=None if default is MISSING else default,
                                help=flag.help, choices=flag.choices or None, metavar=flag.metavar)


def from_flags(cls: type, args: argparse.Namespace, what: str = "", **others: Any):
    """`cls` from parsed flags, checked as `from_plain` checks a map (`others`: its fields without a flag)."""
    values = dict(others)
    for f in fields_of(cls):
        flag = f.rule.flag
        if flag is None:
            continue
        given = getattr(args, _dest(flag))
        if flag.on is not UNSET:
            values[f.name] = flag.on if given else f.default
        elif given is not None or not f.required:
            values[f.name] = given
    return from_plain(cls, to_plain(values), what)


def to_flags(value: Any) -> list[str]:
    """The argv that gives `value`'s flagged fields to another process's `from_flags`, defaults left out."""
    argv = []
    for f in fields_of(type(value)):
        flag, current = f.rule.flag, getattr(value, f.name)
        if flag is None or current == f.default:
            continue
        if flag.on is not UNSET or _tristate(f):
            argv.append(flag.name if current or flag.on is not UNSET else "--no-" + flag.name.removeprefix("--"))
        else:
            argv += [flag.name, str(current)]
    return argv
