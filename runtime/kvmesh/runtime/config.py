"""Config dataclasses -> command-line flags, and back.

Each component has one config dataclass; every field has a default and a help text
(`opt(default, "help")`). The CLI is generated from it, so a flag, its default and its
documentation live in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def opt(default: Any, help: str, *, flag: str | None = None, cli: bool = True) -> Any:
    """A config field with a default, its help text, and optionally a custom flag name."""
    meta = {"help": help, "flag": flag, "cli": cli}
    if isinstance(default, (list, dict, set)):
        factory = type(default)(default)
        return dataclasses.field(default_factory=lambda: type(factory)(factory), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("flag") or "--" + f.name.replace("_", "-"))


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for `X | None` annotations."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_args(
    parser: argparse.ArgumentParser, cls: type[Any], *, skip: set[str] | None = None
) -> None:
    """Add one flag per field of dataclass `cls` (fields in `skip` or with cli=False excluded)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or (skip and f.name in skip):
            continue
        tp, _ = _base_type(hints[f.name])
        default = _default(f)
        help_text = f"{f.metadata.get('help', '')} (default: {_show(default)})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if tp is bool:
            group.add_argument(_flag(f), action=argparse.BooleanOptionalAction, **kwargs)
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            group.add_argument(_flag(f), choices=[m.value for m in tp], **kwargs)
        elif typing.get_origin(tp) in (list, tuple):
            (inner, *_) = typing.get_args(tp)
            group.add_argument(_flag(f), nargs="*", type=inner, **kwargs)
        else:
            group.add_argument(_flag(f), type=tp, **kwargs)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    return repr(value)


def from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Build `cls` from parsed flags; unset flags keep the dataclass defaults."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif hasattr(ns, f.name):
            tp, _ = _base_type(hints[f.name])
            raw = getattr(ns, f.name)
            if isinstance(tp, type) and issubclass(tp, enum.Enum) and raw is not None:
                raw = tp(raw)
            elif typing.get_origin(tp) is tuple and raw is not None:
                raw = tuple(raw)
            values[f.name] = raw
    return cls(**values)


def to_argv(config: Any, *, skip: set[str] | None = None) -> list[str]:
    """Flags that reproduce the non-default fields of `config` (for spawning processes)."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        if not f.metadata.get("cli", True) or (skip and f.name in skip):
            continue
        value = getattr(config, f.name)
        if value == _default(f):
            continue
        flag = _flag(f)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, enum.Enum):
            argv += [flag, str(value.value)]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
