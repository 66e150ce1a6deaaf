"""W3C trace context (https://www.w3.org/TR/trace-context/) carried across every hop.

A `TraceContext` names one span: the trace it belongs to (`trace_id`), the span itself
(`span_id`), the trace flags (bit 0 = sampled) and the vendor `tracestate`. The gateway reads
the `traceparent`/`tracestate` HTTP headers (starting a new trace when they are absent or
invalid), makes a child context for its own span, and hands that child to the backend, which
puts it into gRPC metadata (`grpc_metadata()`); servers read it back with
`from_grpc_metadata()`.

Real OpenTelemetry spans slot in later: a span exporter only needs the ids kept here
(`trace_id`, `span_id`, the parent's `span_id`), so nothing in the callers has to change.

Ids come from the `random` module's global generator (re-seeded by Python after `fork`), not
from `os.urandom`: trace ids must be unique, not secret, and this is on every request's path.
(The spans `Tracer.record` builds in C take theirs from kvmesh.runtime._otlpc's generator,
seeded from `os.urandom` at import and after `fork`: kvmesh.runtime.otlp.)
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["TRACEPARENT", "TRACESTATE", "TraceContext", "new_span_id"]

TRACEPARENT = "traceparent"
"""Header / gRPC metadata key of the trace parent."""
TRACESTATE = "tracestate"
"""Header / gRPC metadata key of the vendor trace state."""

_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_MAX_TRACESTATE_MEMBERS = 32
_MAX_TRACESTATE_LEN = 512
# key: simple-key or multi-tenant tenant@system; value: printable ASCII except ',' and '='
# (no trailing space). See section 3.3.1 of the specification.
_TS_KEY = re.compile(
    r"^(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})$"
)
_TRACEPARENT = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL
)
"""version-trace_id-parent_id-flags, lowercase hex; a version after 00 may append fields after a
'-' (section 3.2 of the specification; the checks the pattern cannot make are in the parser)."""
_TS_VALUE = re.compile(r"^[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$")


_tuple_new = tuple.__new__
_bits = random.getrandbits  # the module's global generator (the same one after a fork)


def _new_trace_id() -> str:
    return (_bits(128) or 1).to_bytes(16).hex()  # never all zero (invalid)


def new_span_id() -> str:
    """A new span id: 16 lowercase hex digits, not all zero (random: unique, not secret)."""
    return (_bits(64) or 1).to_bytes(8).hex()  # (half the time of "%016x" formatting)


def _clean_tracestate(raw: str | None) -> str:
    """The tracestate normalised (members trimmed, empties dropped), or "" if invalid."""
    if not raw:
        return ""
    members: list[str] = []
    keys: set[str] = set()
    for part in raw.split(","):
        member = part.strip(" \t")
        if not member:
            continue
        key, sep, value = member.partition("=")
        if not sep or not _TS_KEY.match(key) or not _TS_VALUE.match(value) or key in keys:
            return ""
        keys.add(key)
        members.append(member)
    if len(members) > _MAX_TRACESTATE_MEMBERS:
        return ""
    out = ",".join(members)
    return out if len(out) <= _MAX_TRACESTATE_LEN else ""


class TraceContext(NamedTuple):
    """One span's identity in a W3C trace (immutable; a named tuple because a new one is made
    at every hop of every request, traced or not, and a tuple is the cheapest to make).

    Invariants (enforced by the constructors below, not by the class's own constructor):
    `trace_id` is 32 lowercase hex digits, not all zero; `span_id` is 16 lowercase hex digits,
    not all zero; `flags` fits in a byte; `tracestate` is a valid, normalised tracestate or "".
    """

    trace_id: str
    span_id: str
    flags: int = 1
    """Trace flags; bit 0 = sampled."""
    tracestate: str = ""
    """Vendor-specific state, passed on unchanged ("" = none)."""

    @classmethod
    def new(cls, *, sampled: bool = True) -> TraceContext:
        """Start a new trace: fresh trace id and span id."""
        return cls(_new_trace_id(), new_span_id(), 1 if sampled else 0)

    def child(self) -> TraceContext:
        """A context for a span whose parent is this one: same trace, new span id."""
        return _tuple_new(TraceContext, (self[0], new_span_id(), self[2], self[3]))

    @property
    def sampled(self) -> bool:
        """Whether the sampled flag is set."""
        return bool(self.flags & 1)

    @property
    def trace_flags(self) -> TraceContext:
        """This context, read as the OpenTelemetry SDK reads an ended span's flags
        (`span.context.trace_flags.sampled`, in its batch processor): kvmesh's recording spans
        go to that processor as they are (kvmesh.runtime.telemetry)."""
        return self

    @property
    def traceparent(self) -> str:
        """The `traceparent` header value (version 00)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    @classmethod
    def parse_traceparent(cls, value: str) -> TraceContext | None:
        """Parse a `traceparent` value strictly; None if it is not valid.

        Version 00 must be exactly 55 characters. Higher versions (not ff) may append fields
        after the flags, separated by '-', which are ignored (forward compatibility).
        """
        match = _TRACEPARENT.fullmatch(value.strip(" \t"))
        if match is None:
            return None
        version, trace_id, span_id, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest is not None):
            return None
        if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
            return None
        return _tuple_new(cls, (trace_id, span_id, int(flags, 16), ""))

    @classmethod
    def from_headers(cls, traceparent: str | None, tracestate: str | None) -> TraceContext | None:
        """The context the headers describe, or None if `traceparent` is absent or invalid.

        An invalid `tracestate` is dropped (the context is kept), as the specification asks.
        """
        if not traceparent:
            return None
        ctx = cls.parse_traceparent(traceparent)
        if ctx is None:
            return None
        state = _clean_tracestate(tracestate)
        if state:
            return cls(ctx.trace_id, ctx.span_id, ctx.flags, state)
        return ctx

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata entries that carry this context to the next hop."""
        if self.tracestate:
            return ((TRACEPARENT, self.traceparent), (TRACESTATE, self.tracestate))
        return ((TRACEPARENT, self.traceparent),)

    @classmethod
    def from_grpc_metadata(
        cls, metadata: Iterable[tuple[str, str | bytes]] | None
    ) -> TraceContext | None:
        """The context in gRPC invocation metadata, or None if there is none or it is invalid."""
        if not metadata:
            return None
        parent: str | None = None
        state: str | None = None
        for key, value in metadata:
            lowered = key.lower()
            if lowered == TRACEPARENT:
                parent = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            elif lowered == TRACESTATE:
                text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
                state = text if state is None else f"{state},{text}"
        return cls.from_headers(parent, state)
