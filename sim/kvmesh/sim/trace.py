"""Traces: loading (Mooncake JSONL, Azure LLM inference CSV), writing, the infinite-cache prefix
bound, and prompt expansion.

A Mooncake trace holds one request per line: `timestamp` (ms), `input_length`,
`output_length`, `hash_ids` (ids of 512-token prefix blocks: equal leading ids = equal
prefixes). An Azure trace (`TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock timestamps)
has no prefix information: its requests get no hash ids, so every prompt is unique (generators
that add prefix structure build on `load_trace` and `write_trace`). Each hash id
becomes a fixed pseudo-random run of `trace_block_size` token ids (a pure function of the id,
the same in every run and process), the runs are joined and cut to `input_length`; the engine
then splits the prompt into its own `block_size`-token blocks (8 per trace block at 64). The
request asks for exactly `output_length` tokens (at least 1; max_tokens, EOS ignored).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import TextIO

from kvmesh.sim.config import ReplayError

__all__ = [
    "VOCAB_SIZE",
    "PromptBuilder",
    "Trace",
    "TraceRequest",
    "load_trace",
    "prefix_hit_bound",
    "token_block",
    "write_trace",
]

VOCAB_SIZE = 256
"""Prompt token ids are in [0, 256) (see token_block); generated tokens too."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]

    @property
    def max_tokens(self) -> int:
        """The tokens the replay asks for: `output_length`, at least 1."""
        return max(1, self.output_length)


@dataclass(slots=True)
class Trace:
    """The requests to replay, in arrival order (stable for equal timestamps)."""

    path: str
    requests: list[TraceRequest]


def load_trace(path: str, limit: int = 0) -> Trace:
    """Read a trace (the first `limit` requests when > 0): Mooncake JSONL, or an Azure LLM
    inference CSV when the file name ends in `.csv`; ReplayError if malformed."""
    if not path:
        raise ReplayError("no trace given: pass --trace FILE (Mooncake JSONL or Azure CSV)")
    requests: list[TraceRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".csv"):
                requests = _read_azure_csv(f, path, limit)
            else:
                for lineno, line in enumerate(f, 1):
                    if limit and len(requests) >= limit:
                        break
                    if line.strip():
                        requests.append(_parse_line(line, path, lineno))
    except OSError as exc:
        raise ReplayError(f"cannot read trace {path!r}: {exc.strerror or exc}") from None
    if not requests:
        raise ReplayError(f"trace {path!r} holds no requests")
    requests.sort(key=lambda r: r.timestamp_ms)  # stable: equal timestamps keep file order
    return Trace(path, requests)


def _parse_line(line: str, path: str, lineno: int) -> TraceRequest:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ReplayError(f"{where}: expected a JSON object")
    try:
        ts = float(row["timestamp"])
        isl = int(row["input_length"])
        osl = int(row["output_length"])
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
            raise TypeError("hash_ids must be a list of integers")
    except KeyError as exc:
        raise ReplayError(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ReplayError(f"{where}: {exc}") from None
    if not math.isfinite(ts) or ts < 0:
        raise ReplayError(f"{where}: timestamp must be a finite number >= 0")
    if isl < 1 or osl < 0:
        raise ReplayError(f"{where}: input_length must be >= 1 and output_length >= 0")
    return TraceRequest(ts, isl, osl, ids)


def _read_azure_csv(f: TextIO, path: str, limit: int) -> list[TraceRequest]:
    """Rows of an Azure LLM inference trace; timestamps become ms after the first row's."""
    reader = csv.reader(f)
    header = next(reader, None)
    if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        raise ReplayError(f"{path}: not an Azure LLM inference trace (header {header!r})")
    requests: list[TraceRequest] = []
    start: datetime | None = None
    for lineno, row in enumerate(reader, 2):
        if limit and len(requests) >= limit:
            break
        if not row:
            continue
        where = f"{path}:{lineno}"
        try:
            stamp, isl, osl = row[0], int(row[1]), int(row[2])
            day, _, frac = stamp.partition(".")
            # Azure writes 7 fractional digits; datetime takes at most 6.
            when = datetime.strptime(f"{day}.{(frac or '0')[:6]:0<6}", "%Y-%m-%d %H:%M:%S.%f")
        except (ValueError, IndexError) as exc:
            raise ReplayError(f"{where}: {exc}") from None
        if isl < 1 or osl < 0:
            raise ReplayError(f"{where}: ContextTokens must be >= 1 and GeneratedTokens >= 0")
        start = start or when
        requests.append(TraceRequest((when - start).total_seconds() * 1e3, isl, osl, []))
    return requests


def write_trace(trace: Trace, path: str) -> None:
    """Write `trace` as Mooncake JSONL (what load_trace reads back)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace.requests:
            row = {
                "timestamp": round(r.timestamp_ms, 3),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": r.hash_ids,
            }
            f.write(json.dumps(row) + "\n")


def prefix_hit_bound(trace: Trace, trace_block_size: int = 512) -> tuple[float, float]:
    """The infinite-cache prefix hit rate: (blocks, tokens).

    A request hits its leading hash ids that appeared in any earlier request, up to the first
    one that did not (as `trace_stats.json` computes it). Block-weighted: hits / hash ids;
    token-weighted: hit tokens (the last block may be partial) / input tokens.
    """
    seen: set[int] = set()
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for r in trace.requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        hit_blocks += k
        total_blocks += len(r.hash_ids)
        hit_tokens += min(k * trace_block_size, r.input_length)
        total_tokens += r.input_length
        seen.update(r.hash_ids)
    return (
        hit_blocks / total_blocks if total_blocks else 0.0,
        hit_tokens / total_tokens if total_tokens else 0.0,
    )


def token_block(hash_id: int, size: int) -> bytes:
    """The fixed pseudo-random token run of a trace hash id: `size` token ids in [0, 256), one
    byte each (SHAKE-128 of the id; a pure function of (hash_id, size)).

    Ids below 256 are CPython's preallocated small ints, so expanding a 100k-token prompt
    allocates no int objects and the mockers' cached blocks hold pointers only; the router and
    the engine hash token ids, whose range does not matter to them.
    """
    return hashlib.shake_128(b"kvmesh-replay-block\0%d" % hash_id).digest(size)


class PromptBuilder:
    """Expands hash ids into prompts, caching each id's token run (one byte per token)."""

    __slots__ = ("_blocks", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[int, bytes] = {}

    def prompt(self, request: TraceRequest, index: int) -> list[int]:
        """The prompt of `request` (the `index`-th of the trace): its blocks joined, cut to
        input_length; missing trailing blocks (a short hash_ids list) are unique to the
        request."""
        bs = self.block_size
        n = request.input_length
        need = -(-n // bs)
        blocks = self._blocks
        parts: list[bytes] = []
        for h in request.hash_ids[:need]:
            b = blocks.get(h)
            if b is None:
                b = blocks[h] = token_block(h, bs)
            parts.append(b)
        for j in range(len(parts), need):
            parts.append(hashlib.shake_128(b"kvmesh-replay-pad\0%d\0%d" % (index, j)).digest(bs))
        return list(b"".join(parts)[:n])
