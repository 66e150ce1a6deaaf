"""kvmesh.runtime.otlp's span encoder, compiled (_otlpc.c; built by hatch_build.py)."""

from collections.abc import Sequence
from typing import Any

SOURCE: str
"""SHA-256 of the _otlpc.c it was built from."""

def encode_request(resource: bytes, scope: bytes, records: Sequence[Any]) -> bytes: ...
