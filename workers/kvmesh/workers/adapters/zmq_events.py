"""The subscriber side of vLLM's and SGLang's ZMQ KV event publishers.

Both engines publish the same way (SGLang's publisher derives from vLLM's): a PUB socket sends
multipart messages `(topic, seq, payload)`, `seq` an 8-byte big-endian counter from 0 and
`payload` a msgpack-encoded event batch; a ROUTER "replay" socket answers a request carrying a
start sequence number (8 bytes, big-endian) with every buffered message from there on, then an
end marker whose sequence number is -1. A vLLM replay message is `(topic, seq, payload)`, an
SGLang one `(seq, payload)`; both end markers have an empty payload.

The payload formats differ (learned from the engines' sources, decoded here with our own types):
  * vLLM (vllm.distributed.kv_events): `KVEventBatch` is an array `[ts, events, dp_rank]`; each
    event is a map tagged by `"type"`: `BlockStored` {block_hashes (bytes or int),
    parent_block_hash, token_ids (flat, all blocks), block_size, lora_id, medium, lora_name,
    extra_keys, group_idx, ...}, `BlockRemoved` {block_hashes, medium, group_idx, ...},
    `AllBlocksCleared` {}.
  * SGLang (sglang.srt.disaggregation.kv_events): `[ts, events, attn_dp_rank]` with each event an
    array whose first item is the tag: `["BlockStored", block_hashes, parent_block_hash,
    token_ids, block_size, lora_id, medium?, metadata?]`, `["BlockRemoved", block_hashes,
    medium?]`, `["AllBlocksCleared"]`. One page per BlockStored; hashes are signed 64-bit ints.

Fields a newer engine adds are ignored; an event type we do not know is skipped (once logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

__all__ = [
    "SglangAllCleared",
    "SglangBatch",
    "SglangRemoved",
    "SglangStored",
    "VllmAllCleared",
    "VllmBatch",
    "VllmRemoved",
    "VllmStored",
    "ZmqKvSubscriber",
    "connect_address",
    "decode_events",
]

log = logging.getLogger(__name__)

Hash = int | bytes

# --- vLLM ------------------------------------------------------------------------------------


class VllmStored(msgspec.Struct, tag="BlockStored"):
    """vLLM BlockStored (a map on the wire)."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    """One entry per block: None, or the extra items its hash covers (LoRA name first when
    lora_name is set, then multimodal (identifier, offset) pairs, cache salt, ...)."""
    group_idx: int | None = None


class VllmRemoved(msgspec.Struct, tag="BlockRemoved"):
    """vLLM BlockRemoved."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class VllmAllCleared(msgspec.Struct, tag="AllBlocksCleared"):
    """vLLM AllBlocksCleared."""


VllmEvent = VllmStored | VllmRemoved | VllmAllCleared


class VllmBatch(msgspec.Struct, array_like=True):
    """vLLM KVEventBatch; events stay raw so one unknown event does not lose the batch."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


# --- SGLang ----------------------------------------------------------------------------------


class SglangStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """SGLang BlockStored (an array on the wire)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    """Ints; SGLang's bigram caches send pairs (such blocks are opaque to kvmesh)."""
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    metadata: dict[str, Any] | None = None
    """Request metadata the block's hash covers (e.g. a cache salt); such blocks are opaque."""


class SglangRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    """SGLang BlockRemoved."""

    block_hashes: list[int]
    medium: str | None = None


class SglangAllCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    """SGLang AllBlocksCleared."""


SglangEvent = SglangStored | SglangRemoved | SglangAllCleared


class SglangBatch(msgspec.Struct, array_like=True):
    """SGLang KVEventBatch."""

    ts: float
    events: list[msgspec.Raw]
    attn_dp_rank: int | None = None


_unknown_logged: set[str] = set()


def decode_events(raws: list[msgspec.Raw], event_type: Any) -> list[Any]:
    """Decode each raw event as `event_type` (a tagged union); unknown or malformed events are
    skipped with a warning (once per kind)."""
    events: list[Any] = []
    for raw in raws:
        try:
            events.append(msgspec.msgpack.decode(raw, type=event_type))
        except msgspec.ValidationError as exc:
            key = str(exc).split(" - ")[0]
            if key not in _unknown_logged:
                _unknown_logged.add(key)
                log.warning("skipping a KV event kvmesh does not understand: %s", exc)
    return events


# --- transport -------------------------------------------------------------------------------


def connect_address(endpoint: str) -> str:
    """The address a subscriber connects to for a publisher's bind endpoint
    (`tcp://*:5557` -> `tcp://127.0.0.1:5557`; ipc/inproc unchanged)."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if sep and host in ("*", "0.0.0.0"):
            return f"tcp://127.0.0.1:{port}"
        if sep and host in ("::", "[::]"):
            return f"tcp://[::1]:{port}"
    return endpoint


_END = -1
_MIN_IDLE_S = 0.05


class ZmqKvSubscriber:
    """Receives a ZMQ KV event publisher's batches in sequence order, replaying gaps.

    `on_payload(payload)` is called for every batch in sequence order, exactly once; when a gap
    cannot be filled from the replay socket (none configured, the batches are no longer
    buffered, or it does not answer within `replay_timeout_s`), `on_gap(description)` is called
    and delivery continues after the gap. Sequence numbers start at 0, so batches published
    before this subscriber connected (ZMQ drops them) are replayed too: on the next batch, or
    when no batch came for a while, since a gap at the end of a burst is invisible until then:
    50 ms after connecting (doubling up to `idle_replay_s`: a slow joiner's losses), and
    `idle_replay_s` after the last batch once batches flow. Not sooner: while requests run, a
    replay request to vLLM's publisher held up the engine's outputs to this process for tens of
    milliseconds, and a check 50 ms after every batch made half the streams at concurrency 1
    arrive in one burst at their end (first token 10 -> 110 ms).
    """

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_payload: Callable[[bytes], None],
        on_gap: Callable[[str], None],
        replay_timeout_s: float = 2.0,
        idle_replay_s: float = 1.0,
    ) -> None:
        self.endpoint = connect_address(endpoint)
        self.replay_endpoint = connect_address(replay_endpoint) if replay_endpoint else None
        self.topic = topic.encode()
        self.on_payload = on_payload
        self.on_gap = on_gap
        self.replay_timeout_s = replay_timeout_s
        self.idle_replay_s = idle_replay_s
        self.next_seq = 0
        """Sequence number of the next batch to deliver."""
        self.batches_total = 0
        self.replayed_total = 0
        self.gaps_total = 0
        self.idle_checks_total = 0
        """Replay requests sent because no batch came for a while."""
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._ready = asyncio.Event()

    async def wait_connected(self) -> None:
        """Until the SUB socket is connected (batches published before may still be replayed)."""
        await self._ready.wait()

    async def run(self) -> None:
        """Receive until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        self._sub = sub
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RECONNECT_IVL, 10)  # the publisher binds after we connect
        sub.connect(self.endpoint)
        self._ready.set()
        idle = _MIN_IDLE_S
        try:
            while True:
                if self.replay_endpoint is not None and not await sub.poll(int(idle * 1000)):
                    # Quiet: ask for anything published that never reached us (a PUB socket
                    # drops what it sends before our connection is up, or beyond its HWM),
                    # soon after the last batch, then less and less often.
                    self.idle_checks_total += 1
                    await self._fill(None)
                    idle = min(idle * 2, self.idle_replay_s)
                    continue
                idle = self.idle_replay_s
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("ignoring a KV event message with %d frames", len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < self.next_seq:
                    continue  # already delivered (by a replay)
                if seq > self.next_seq:
                    await self._fill(seq)
                    if self.next_seq < seq:
                        self._gap(f"batches {self.next_seq}..{seq - 1} were not replayed")
                self._deliver(seq, frames[2])
        finally:
            self.close()

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self.batches_total += 1
        try:
            self.on_payload(payload)
        except Exception:
            log.exception("failed to apply KV event batch %d", seq)

    def _gap(self, why: str) -> None:
        self.gaps_total += 1
        self.on_gap(why)

    async def _fill(self, until: int | None) -> None:
        """Replay batches next_seq..until-1 (None: all there are), as far as the publisher
        still has them."""
        if self.replay_endpoint is None:
            return
        if self._replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.replay_endpoint)
            self._replay = sock
        sock = self._replay
        await sock.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            if not await sock.poll(int(self.replay_timeout_s * 1000)):
                # No answer: drop the socket so a late answer cannot be mistaken for the next.
                sock.close(0)
                self._replay = None
                return
            frames = await sock.recv_multipart()
            if len(frames) < 3:
                continue
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == _END:
                return
            if seq < self.next_seq or (until is not None and seq >= until):
                continue
            if seq > self.next_seq:
                self._gap(f"batches {self.next_seq}..{seq - 1} are no longer buffered")
            self.replayed_total += 1
            self._deliver(seq, frames[-1])

    def close(self) -> None:
        """Close the sockets (idempotent)."""
        for sock in (self._sub, self._replay):
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.close(0)
        self._sub = self._replay = None
        if not self._ctx.closed:
            self._ctx.term()
