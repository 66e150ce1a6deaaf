"""W3C trace context parsing, propagation and gRPC metadata."""

from __future__ import annotations

import pytest

from kvmesh.runtime.tracing import TraceContext

pytestmark = pytest.mark.unit

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
VALID = f"00-{TRACE}-{SPAN}-01"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (VALID, (TRACE, SPAN, 1)),
        (f"00-{TRACE}-{SPAN}-00", (TRACE, SPAN, 0)),
        (f"  00-{TRACE}-{SPAN}-01\t", (TRACE, SPAN, 1)),  # optional whitespace
        (f"01-{TRACE}-{SPAN}-09-extra-fields", (TRACE, SPAN, 9)),  # future version
        (f"cc-{TRACE}-{SPAN}-01", (TRACE, SPAN, 1)),
        (f"00-{TRACE}-{SPAN}-01-extra", None),  # version 00 must be exactly 55 chars
        (f"01-{TRACE}-{SPAN}-01x", None),  # future version: extra must follow a dash
        (f"01-{TRACE}-{SPAN}-01-", (TRACE, SPAN, 1)),  # an empty extra field
        (f"01-{TRACE}-{SPAN}-01-a\nb", (TRACE, SPAN, 1)),  # extra fields are not read
        (f"00-{TRACE}-{SPAN}-01\n", None),  # only spaces and tabs are trimmed
        (f"ff-{TRACE}-{SPAN}-01", None),  # forbidden version
        (f"00-{TRACE.upper()}-{SPAN}-01", None),  # uppercase hex is invalid
        (f"00-{'0' * 32}-{SPAN}-01", None),  # all-zero trace id
        (f"00-{TRACE}-{'0' * 16}-01", None),  # all-zero parent id
        (f"00-{TRACE[:-1]}g-{SPAN}-01", None),
        (f"00-{TRACE}-{SPAN}-0g", None),
        (f"00_{TRACE}-{SPAN}-01", None),
        (f"00-{TRACE}-{SPAN[:-1]}-01", None),
        ("", None),
        ("garbage", None),
    ],
)
def test_traceparent_validation(header: str, expected: tuple[str, str, int] | None) -> None:
    ctx = TraceContext.from_headers(header, None)
    if expected is None:
        assert ctx is None
    else:
        assert ctx is not None
        assert (ctx.trace_id, ctx.span_id, ctx.flags) == expected


def test_absent_header_gives_none() -> None:
    assert TraceContext.from_headers(None, "a=b") is None


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("congo=t61rcWkgMzE", "congo=t61rcWkgMzE"),
        ("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
        ("a=1,,b=2", "a=1,b=2"),
        ("tenant@vendor=x", "tenant@vendor=x"),
        ("Upper=1", ""),  # keys are lowercase
        ("a=1,a=2", ""),  # duplicate keys
        ("novalue", ""),
        ("a=b=c", ""),
        (",".join(f"k{i}=v" for i in range(33)), ""),  # more than 32 members
    ],
)
def test_tracestate_kept_only_when_valid(state: str, expected: str) -> None:
    ctx = TraceContext.from_headers(VALID, state)
    assert ctx is not None
    assert ctx.tracestate == expected
    assert ctx.trace_id == TRACE


def test_new_and_child() -> None:
    a, b = TraceContext.new(), TraceContext.new()
    assert a.trace_id != b.trace_id
    assert len(a.trace_id) == 32 and len(a.span_id) == 16 and a.sampled
    assert not TraceContext.new(sampled=False).sampled
    parent = TraceContext.from_headers(VALID, "x=1")
    assert parent is not None
    child = parent.child()
    assert child.trace_id == TRACE and child.span_id != SPAN
    assert child.flags == parent.flags and child.tracestate == "x=1"
    assert TraceContext.parse_traceparent(child.traceparent) == TraceContext(
        TRACE, child.span_id, 1
    )


def test_traceparent_roundtrip() -> None:
    ctx = TraceContext.from_headers(VALID, None)
    assert ctx is not None
    assert ctx.traceparent == VALID


def test_grpc_metadata_roundtrip() -> None:
    ctx = TraceContext.from_headers(VALID, "a=1")
    assert ctx is not None
    md = ctx.grpc_metadata()
    assert md == (("traceparent", VALID), ("tracestate", "a=1"))
    assert TraceContext.from_grpc_metadata(md) == ctx
    bare = TraceContext(TRACE, SPAN)
    assert bare.grpc_metadata() == (("traceparent", VALID),)
    # bytes values, mixed-case keys and unrelated entries are handled
    mixed: list[tuple[str, str | bytes]] = [
        ("user-agent", "x"),
        ("TraceParent", VALID.encode()),
        ("tracestate", b"a=1"),
    ]
    assert TraceContext.from_grpc_metadata(mixed) == ctx
    assert TraceContext.from_grpc_metadata(None) is None
    assert TraceContext.from_grpc_metadata([("traceparent", "bad")]) is None
