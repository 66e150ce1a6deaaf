"""Timing models: the Dynamo polynomial numbers and the JSON table profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.workers.mocker import PolynomialTiming, TableTiming, load_timing

pytestmark = pytest.mark.unit


def test_polynomial_matches_dynamo() -> None:
    poly = PolynomialTiming()
    # prefill(1000) = 4.209989e-7 * 1000^2 + 1.518344e-2 * 1000 + 16.50142
    assert poly.prefill_ms(1000) == pytest.approx(32.1058589, abs=1e-9)
    assert poly.prefill_ms(8192) == pytest.approx(
        4.209989e-7 * 8192**2 + 1.518344e-2 * 8192 + 16.50142
    )
    assert poly.prefill_ms(0) == 0.0
    assert poly.decode_ms(0.5) == pytest.approx(26.31)  # -25.74/4 + 54.01/2 + 5.74
    assert poly.decode_ms(0.0) == pytest.approx(5.74)
    assert poly.decode_ms(1.0) == pytest.approx(34.01)
    assert poly.decode_ms(7.0) == pytest.approx(34.01)  # usage is clamped to [0, 1]
    assert poly.decode_ms(-1.0) == pytest.approx(5.74)


def test_table_interpolates_and_extrapolates() -> None:
    t = TableTiming([100, 1000], [10, 100], [0.0, 1.0], [5, 25])
    assert t.prefill_ms(550) == pytest.approx(55)
    assert t.prefill_ms(2000) == pytest.approx(200)  # extrapolated from the last segment
    assert t.prefill_ms(10) == pytest.approx(1)
    assert t.prefill_ms(0) == 0.0
    assert t.decode_ms(0.25) == pytest.approx(10)
    single = TableTiming([1], [7], [0.5], [0.2])
    assert single.prefill_ms(99) == 7 and single.decode_ms(0.9) == 1.0  # 1 ms floor


def test_load_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "prefill_tokens": [128, 1024, 8192],
                "prefill_ms": [18.5, 33.0, 160.0],
                "decode_kv_usage": [0.0, 0.5, 1.0],
                "decode_ms": [6.0, 25.0, 34.0],
            }
        )
    )
    model = load_timing(str(path))
    assert model.prefill_ms(1024) == pytest.approx(33.0)
    assert model.decode_ms(0.75) == pytest.approx(29.5)
    assert isinstance(load_timing(""), PolynomialTiming)


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"prefill_tokens": [1]}),
        json.dumps(
            {
                "prefill_tokens": [2, 1],
                "prefill_ms": [1, 2],
                "decode_kv_usage": [0],
                "decode_ms": [1],
            }
        ),
        json.dumps(
            {"prefill_tokens": [1], "prefill_ms": [1, 2], "decode_kv_usage": [0], "decode_ms": [1]}
        ),
        json.dumps(
            {"prefill_tokens": ["x"], "prefill_ms": [1], "decode_kv_usage": [0], "decode_ms": [1]}
        ),
    ],
)
def test_bad_profiles_are_rejected(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        load_timing(str(path))
    with pytest.raises(ValueError):
        load_timing(str(tmp_path / "missing.json"))
