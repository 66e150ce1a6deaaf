"""Config dataclasses -> command-line flags, and back.

Each component has one config dataclass; every field has a default and a help text
(`opt(default, "help")`). The CLI is generated from it, so a flag, its default and its
documentation live in one place. A process's flags are the fields of the few dataclasses its
entry point declares (`Flags`); `kvmesh up` composes the declarations of the processes it starts
and hands each its values back with `to_argv`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Flag values a config dataclass rejects (the message says which and why)."""


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


_NO_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({})


def add_args(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    *,
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] = _NO_DEFAULTS,
    seen: dict[str, tuple[str, Any, Any]] | None = None,
) -> None:
    """Add one flag per field of dataclass `cls` (fields in `skip` or with cli=False excluded).

    `defaults` replaces the dataclass defaults of some fields for this parser. `seen` (flag ->
    (field name, type, default)) is shared by the calls that fill one parser: a flag another
    dataclass already added is not added again (the one flag sets the field of both), and the
    same flag with another field name, type or default raises ValueError.
    """
    hints = typing.get_type_hints(cls)
    group: Any = None
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or f.name in skip:
            continue
        flag = _flag(f)
        override = f.name in defaults
        default = defaults[f.name] if override else _default(f)
        if seen is not None:
            meaning = (f.name, hints[f.name], default)
            if flag in seen:
                if seen[flag] != meaning:
                    raise ValueError(f"{flag} is declared twice with different meanings")
                continue
            seen[flag] = meaning
        if group is None:
            doc = (cls.__doc__ or "").strip().split("\n\n")[0]
            group = parser.add_argument_group(cls.__name__, " ".join(doc.split()))
        tp, _ = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": default if override else argparse.SUPPRESS,
            "help": f"{f.metadata.get('help', '')} (default: {_show(default)})",
        }
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            group.add_argument(flag, choices=[m.value for m in tp], **kwargs)
        elif typing.get_origin(tp) in (list, tuple):
            (inner, *_) = typing.get_args(tp)
            group.add_argument(flag, nargs="*", type=inner, **kwargs)
        else:
            group.add_argument(flag, type=tp, **kwargs)


@dataclass(frozen=True)
class Flags:
    """The config dataclasses whose fields are one process's flags, declared once by its entry
    point: `kvmesh <command>` builds its parser from it, and `kvmesh up` composes the Flags of
    the processes it starts (`+`, minus the fields it sets itself: `without`) into its own.

    A field name several of the dataclasses share (the frontend's and the worker's `model`) is
    one flag that sets the field of each.
    """

    groups: tuple[tuple[type[Any], frozenset[str]], ...] = ()
    """(config dataclass, names of its fields that are not flags here), in help order."""
    defaults: tuple[tuple[str, Any], ...] = ()
    """(field name, value): defaults of this command that differ from the dataclasses'."""

    @classmethod
    def of(cls, *configs: type[Any], skip: Iterable[str] = ()) -> Flags:
        """The fields of `configs`, but those named in `skip`, as flags."""
        return cls(tuple((c, frozenset(skip)) for c in configs))

    @property
    def configs(self) -> tuple[type[Any], ...]:
        """The config dataclasses."""
        return tuple(c for c, _ in self.groups)

    def __add__(self, other: Flags) -> Flags:
        """The flags of both; a dataclass in both keeps the fields either offers."""
        groups = dict(self.groups)
        for c, skip in other.groups:
            groups[c] = groups[c] & skip if c in groups else skip
        return Flags(tuple(groups.items()), self.defaults + other.defaults)

    def without(self, *names: str) -> Flags:
        """These flags but the fields `names` (of every dataclass)."""
        return Flags(tuple((c, skip | set(names)) for c, skip in self.groups), self.defaults)

    def with_defaults(self, **defaults: Any) -> Flags:
        """These flags with other defaults for some fields."""
        return Flags(self.groups, self.defaults + tuple(defaults.items()))

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add the flags to `parser`, one argument group per dataclass."""
        seen: dict[str, tuple[str, Any, Any]] = {}
        for c, skip in self.groups:
            add_args(parser, c, skip=skip, defaults=dict(self.defaults), seen=seen)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    return repr(value)


def from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Build `cls` from parsed flags; unset flags keep the dataclass defaults. `overrides` set
    fields outright (names `cls` lacks are ignored). Raises ConfigError for values `cls`
    rejects."""
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
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def to_argv(config: Any, *, skip: set[str] | None = None) -> list[str]:
    """Flags that reproduce the non-default fields of `config` (for spawning processes).

    Scalars are written `--flag=value`, so a value that starts with `-` stays a value."""
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
            argv.append(f"{flag}={value.value}")
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv.append(f"{flag}={value}")
    return argv
