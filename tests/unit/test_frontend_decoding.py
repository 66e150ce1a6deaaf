"""kvmesh.frontend.decoding: which error a refused body reports, and what stays unchecked."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import pytest

from kvmesh.frontend.decoding import Refusals, decode, load_object
from kvmesh.runtime.errors import InvalidRequest

pytestmark = pytest.mark.unit


class Item(msgspec.Struct):
    name: str
    size: int = 0


class Options(msgspec.Struct):
    flag: bool | None = None
    level: Annotated[int, msgspec.Meta(ge=0, le=9)] = 0


class Body(msgspec.Struct, kw_only=True):
    model: str
    items: list[Item] | None = None
    options: Options | None = None
    ratio: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    extra: int | None = None


def bad_items(value: Any) -> None:
    raise InvalidRequest(f"bad items {value!r}", param="items")


REFUSALS: Refusals = {"items": bad_items, "options.flag": "'flag' must be a boolean (options)"}


def build(b: Body) -> list[Any]:
    """Reads model, then items (each item's size must be even), then options, then ratio;
    `extra` only when there are no items."""
    out: list[Any] = [b.model]
    for item in b.items or ():
        if item.size % 2:
            raise InvalidRequest(f"odd size of {item.name}", param="items")
        out.append(item.name)
    options = b.options
    if options is not None:
        out += [options.flag, options.level]
    out.append(b.ratio)
    if not b.items:
        out.append(b.extra)
    return out


def run(raw: dict[str, Any]) -> list[Any]:
    return decode(Body, raw, build, REFUSALS)


def error(raw: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(InvalidRequest) as info:
        run(raw)
    return info.value.param, info.value.message


def test_valid_bodies_go_straight_through() -> None:
    raw = {"model": "m", "items": [{"name": "a", "size": 2}], "options": {"flag": True}}
    assert run(raw) == ["m", "a", True, 0, None]


def test_the_first_error_the_build_meets_is_reported() -> None:
    # ratio comes first in the body, model first in the build
    assert error({"ratio": 2, "model": 5}) == ("model", "'model' must be a string")
    assert error({"ratio": 0, "model": "m"}) == ("ratio", "'ratio' must be in (0.0, 1.0], got 0")
    assert error({"model": "m", "ratio": "x"}) == ("ratio", "'ratio' must be a number")
    assert error({"ratio": 0.5}) == ("model", "'model' is required")
    # an item's own check (odd size) before a later item's type error
    items = [{"name": "a", "size": 1}, {"name": 5}]
    assert error({"model": "m", "items": items}) == ("items", "odd size of a")
    items = [{"name": "a", "size": 2}, {"name": 5}]
    assert error({"model": "m", "items": items}) == ("items", f"bad items {items!r}")
    assert error({"model": "m", "items": 5}) == ("items", "bad items 5")


def test_objects_are_converted_field_by_field() -> None:
    body = {"model": "m", "options": {"flag": "x"}}
    assert error(body) == ("options", "'flag' must be a boolean (options)")
    body = {"model": "m", "options": {"level": 10}}
    assert error(body) == ("level", "'level' must be between 0 and 9, got 10")
    # a non-object raises when first used: after the checks the build makes before
    body = {"model": "m", "options": 5, "items": [{"name": "a", "size": 3}]}
    assert error(body) == ("items", "odd size of a")


def test_a_field_the_build_does_not_read_stays_unchecked() -> None:
    raw = {"model": "m", "items": [{"name": "a"}], "extra": "not an int"}
    assert run(raw) == ["m", "a", None]
    assert error({"model": "m", "extra": "x"}) == ("extra", "'extra' must be an integer")


def test_load_object() -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        load_object(b"{")
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        load_object(b"[1]")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        load_object(b'{"ignored": 1e999}')  # orjson: infinities are malformed
