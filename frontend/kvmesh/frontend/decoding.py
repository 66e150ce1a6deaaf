"""JSON request bodies -> msgspec Structs, with one clear message per refused field.

Both HTTP doors declare their request bodies as msgspec Structs (kvmesh.frontend.protocol for
OpenAI, kvmesh.frontend.kserve_http for KServe v2 REST) and decode them here:

1. `load_object`: orjson parses the body, so JSON means what it always did (integers past 64
   bits are floats; infinities and lone surrogates are malformed, in ignored fields too);
2. `decode`: msgspec converts the object into the Struct, checking every declared type and
   range in C, then the door's build function turns it into a typed request and makes the
   checks across fields.

When msgspec refuses a body, the build function runs again over a `_Lazy` view that converts
each field when the build first reads it. So the error reported is the first one the build's
checks meet, in the order they read the fields, and a field a request does not use (OpenAI's
`functions` next to `tools`) is ignored as it always was. The view goes one level down: into
the body's object-valued fields (`S | None`: their fields are converted one by one too) and
lists of objects (`list[S]`: item by item); an item or object that does not convert raises its
error when the build first uses it.

How a refused field is reported: an entry of the door's `Refusals` (by dotted path: a message,
or a function of the value that raises InvalidRequest), else "'f' must be an integer" (a
string, a boolean, a number) or "'f' must be between 0 and 2, got 3" from the field's type and
msgspec Meta bounds; a missing required field: "'f' is required".
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import msgspec
import orjson
from msgspec import Struct

from kvmesh.runtime.errors import InvalidRequest

__all__ = ["Refusals", "decode", "load_object"]

B = TypeVar("B", bound=Struct)
R = TypeVar("R")
Refusals = Mapping[str, str | Callable[[Any], object]]
"""Dotted field path -> message (param: the top-level field) or a function that raises."""
_MISSING: Any = object()


def load_object(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body; InvalidRequest if it is not JSON or not an object."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def decode(cls: type[B], raw: dict[str, Any], build: Callable[[B], R], refusals: Refusals) -> R:
    """`build(body)` over `raw` converted to `cls`, or over a `_Lazy` view of it."""
    try:
        body = msgspec.convert(raw, cls)
    except msgspec.ValidationError:
        return build(cast(B, _Lazy(cls, raw, (), refusals)))
    return build(body)


class _Lazy:
    """The fields of `raw` converted to `cls`'s field types one at a time, as they are read."""

    __slots__ = ("_fields", "_path", "_raw", "_refusals")

    def __init__(
        self, cls: type[Struct], raw: dict[str, Any], path: tuple[str, ...], refusals: Refusals
    ) -> None:
        self._fields = _fields(cls)
        self._raw = raw
        self._path = path
        self._refusals = refusals

    def __getattr__(self, name: str) -> Any:
        info = self._fields.get(name)
        if info is None:
            raise AttributeError(name)
        value = self._raw.get(info.encode_name, _MISSING)
        if value is _MISSING and not info.required:
            if info.default_factory is not msgspec.NODEFAULT:
                return info.default_factory()
            return info.default
        path = (*self._path, name)
        if value is _MISSING or (value is None and info.required):
            raise _refused(path, None, tp=info.type, refusals=self._refusals, required=True)
        try:
            return msgspec.convert(value, info.type)
        except msgspec.ValidationError:
            pass
        refused = functools.partial(_refused, path, tp=info.type, refusals=self._refusals)
        if not self._path:  # the body's own fields: look inside objects and lists of objects
            nested = _struct_of(info.type)
            if nested is not None and isinstance(value, dict):
                return _Lazy(nested, value, path, self._refusals)
            if nested is not None:
                return _Invalid(refused(value))
            item = _struct_of(info.type, inside=list)
            if item is not None and isinstance(value, list) and _dicts(value):
                return _items(item, value, refused)
        raise refused(value)


def _dicts(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(v, dict) for v in value)


def _items(
    cls: type[Struct], value: list[dict[str, Any]], refused: Callable[[Any], InvalidRequest]
) -> list[Any]:
    """The items of a list of objects msgspec refused: each converted, or (if it does not
    convert) an `_Invalid` with the list's first error up to it."""
    items: list[Any] = []
    for i, item in enumerate(value):
        try:
            items.append(msgspec.convert(item, cls))
        except msgspec.ValidationError:
            items.append(_Invalid(refused(value[: i + 1])))
    if not any(isinstance(item, _Invalid) for item in items):
        raise refused(value)  # a limit on the list itself
    return items


class _Invalid:
    """A value that does not convert to its Struct: raises its error once it is used."""

    __slots__ = ("_error",)

    def __init__(self, error: InvalidRequest) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Any:
        raise self._error


@functools.cache
def _fields(cls: type[Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    return {f.name: f for f in msgspec.structs.fields(cls)}


@functools.cache
def _struct_of(tp: Any, inside: type | None = None) -> type[Struct] | None:
    """S for a field of type `S` (`inside=list`: `list[S]`), maybe `| None` and with Meta
    (S a Struct), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if inside is not None:
        items = typing.get_args(tp) if typing.get_origin(tp) is inside else ()
        tp = items[0] if len(items) == 1 else None
    return tp if isinstance(tp, type) and issubclass(tp, Struct) else None


def _refused(
    path: tuple[str, ...],
    value: Any,
    *,
    tp: Any,
    refusals: Refusals,
    required: bool = False,
) -> InvalidRequest:
    """The InvalidRequest for `value` at `path`, which msgspec refused."""
    key = path[0]
    how = refusals.get(".".join(path))
    if isinstance(how, str):
        return InvalidRequest(how, param=key)
    try:
        if how is not None:
            how(value)
        elif required:
            return InvalidRequest(f"'{key}' is required", param=key)
        else:
            _scalar_error(path[-1], tp, value)
    except InvalidRequest as error:
        return error
    return InvalidRequest(f"'{key}' is invalid", param=key)


_KINDS: dict[type[Any], str] = {
    msgspec.inspect.StrType: "a string",
    msgspec.inspect.BoolType: "a boolean",
    msgspec.inspect.IntType: "an integer",
    msgspec.inspect.FloatType: "a number",
}


@functools.cache
def _scalar_type(tp: Any) -> msgspec.inspect.Type:
    """A field's type (`T`, `T | None`, maybe with Meta) without None and Meta."""
    info = msgspec.inspect.type_info(tp)
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    return info.type if isinstance(info, msgspec.inspect.Metadata) else info


def _scalar_error(key: str, tp: Any, value: Any) -> None:
    """Raise "'key' must be <kind>" or "'key' must be <range>, got <value>"."""
    info = _scalar_type(tp)
    kind = _KINDS.get(type(info))
    if kind is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    lo: float | None
    hi: float | None
    if isinstance(info, msgspec.inspect.IntType) and number and isinstance(value, int):
        lo, hi, lo_open = info.ge, info.le, False
    elif isinstance(info, msgspec.inspect.FloatType) and number:
        lo_open = info.gt is not None
        lo, hi = (info.gt if lo_open else info.ge), info.le
    else:
        raise InvalidRequest(f"'{key}' must be {kind}", param=key)
    raise InvalidRequest(f"'{key}' must be {_range(lo, hi, lo_open)}, got {value}", param=key)


def _range(lo: float | None, hi: float | None, lo_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in ({lo}, {hi}]" if lo_open else f"between {lo} and {hi}"
    if lo is not None:
        return f"> {lo}" if lo_open else f">= {lo}"
    return f"<= {hi}"
