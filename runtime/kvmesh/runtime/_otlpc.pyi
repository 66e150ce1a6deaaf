"""kvmesh.runtime.otlp's span encoder, compiled (_otlpc.c; built by hatch_build.py)."""

from collections.abc import Sequence
from typing import Any

SOURCE: str
"""SHA-256 of the _otlpc.c it was built from."""

def encode_request(resource: bytes, scope: bytes, records: Sequence[Any]) -> bytes: ...
def record_spans(
    context_type: type, span_type: type, parent: Any, steps: Sequence[Any], flags: int, remote: bool
) -> list[Any]: ...
def span_id() -> str: ...
def seed(state: bytes, /) -> None: ...
