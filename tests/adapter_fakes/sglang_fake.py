"""A fake of SGLang's offline Engine, speaking SGLang's formats, with the kvmesh mocker as model.

Upstream: SGLang 0.5.18 (UPSTREAM_VERSION; tests/unit/test_adapter_fake_versions.py fails if the
`sglang` extra of pyproject.toml excludes it). Checked against the files of the sglang 0.5.18
wheel listed in UPSTREAM_SOURCES: the async_generate parameter list and the SamplingParams API
fields are exactly 0.5.18's, and KV events are 0.5.18's tagged arrays. SGLang 0.5.20 changed
KV events to tagged maps (KVCacheEvent lost array_like), which kvmesh's decoder does not read,
hence the extra's `<0.5.20`. The load is 0.5.18's `tokenizer_manager.get_loads()` (one
LoadSnapshot per DP rank, its core fields); `get_load()`, which older SGLang versions had
instead, is gone as in 0.5.18 (the adapter's fallback to it is tested with a manager of its
own).

What follows SGLang's source (python/sglang/srt/entrypoints/engine.py, managers/
tokenizer_manager.py, sampling/sampling_params.py, disaggregation/kv_events.py):
  * `Engine(**server_args)` and `await Engine.async_generate(..., stream=True)` returning an
    async iterator of dicts `{"text", "output_ids", "meta_info": {...}}`, with the real
    parameter list;
  * the sampling-params dict is checked like SGLang's SamplingParams (unknown keys are a
    TypeError, out-of-range values a ValueError, repetition_penalty at most 2);
  * `incremental_streaming_output` decides whether output_ids and the output logprob lists are
    the new ones or everything so far; finish_reason dicts as FINISH_MATCHED_TOKEN /
    FINISH_LENGTH / FINISH_ABORT's to_json();
  * `tokenizer_manager.abort_request(rid=...)` is the only way to stop a request (cancelling
    the iterator does not abort it here), `get_loads(include, dp_rank)`, `flush_cache()`;
  * KV events: a PUB socket sending (topic, seq, payload) and a ROUTER replay socket answering
    (seq, payload) messages then (-1, b""), payload `[ts, [events], attn_dp_rank]` with events
    as tagged arrays `["BlockStored", [hash], parent, page_tokens, page_size, lora_id,
    medium]`, one page per event, hashes as signed 64-bit ints.
This is an independent implementation of those formats for testing, not SGLang's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvmesh.runtime.kv_events import AllCleared, BlocksRemoved, BlocksStored
from kvmesh.runtime.types import EngineRequest, FinishReason, SamplingParams, StopParams

from .backend import VOCAB, Backend

UPSTREAM_DIST = "sglang"
UPSTREAM_VERSION = "0.5.18"
UPSTREAM_SOURCES = (
    "sglang/srt/entrypoints/engine.py",
    "sglang/srt/sampling/sampling_params.py",
    "sglang/srt/disaggregation/kv_events.py",
    "sglang/srt/managers/tokenizer_manager.py",
    "sglang/srt/managers/schedule_batch.py",
)

# SGLang's SamplingParams fields (the API ones) and their defaults.
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
    "custom_params": None,
}


def signed64(h: int) -> int:
    """A mocker (unsigned) hash as SGLang's signed 64-bit hash."""
    return h - (1 << 64) if h >= 1 << 63 else h


def check_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """SGLang's SamplingParams(**params) + verify(): merged values, or TypeError/ValueError."""
    unknown = set(params) - set(_SAMPLING_DEFAULTS)
    if unknown:
        raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
    p = {**_SAMPLING_DEFAULTS, **params}
    if not 0.0 < p["top_p"] <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p['top_p']}.")
    if p["top_k"] != -1 and p["top_k"] < 1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
    if not 0.0 < p["repetition_penalty"] <= 2.0:
        raise ValueError("repetition_penalty must be in (0, 2]")
    if p["max_new_tokens"] is not None and p["min_new_tokens"] > p["max_new_tokens"]:
        raise ValueError("min_new_tokens must be in [0, max_new_tokens]")
    for token_id in p["logit_bias"] or {}:
        if not 0 <= int(token_id) < VOCAB:
            raise ValueError(f"logit_bias must has keys in [0, {VOCAB - 1}], got {token_id}.")
    if sum(p[k] is not None for k in ("json_schema", "regex", "ebnf")) > 1:
        raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
    return p


@dataclass
class LoadSnapshot:
    """SGLang's get_loads() item (managers/load_snapshot.py, a msgspec Struct there): the core
    fields /v1/loads reports; the optional sections (memory, speculative, ...) are left out."""

    timestamp: float = 0.0
    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    utilization: float = 0.0


@dataclass
class FlushCacheReqOutput:
    success: bool = True


class FakeTokenizerManager:
    """The TokenizerManager surface the adapter uses."""

    def __init__(self, engine: FakeSglangEngine) -> None:
        self.engine = engine
        self.context_len = engine.server_args.context_length
        self.aborted: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)
        stream = self.engine.streams.pop(rid, None)
        if stream is not None:
            stream.cancel()
            stream.output_abort = True

    async def get_loads(
        self, include: list[str] | None = None, dp_rank: int | None = None
    ) -> list[LoadSnapshot]:
        """One snapshot per DP rank (this fake has one), [] for a rank it does not have."""
        if dp_rank not in (None, 0):
            return []
        load = self.engine.backend.load()
        page = self.engine.server_args.page_size
        used = load.kv_active_blocks * page
        capacity = load.kv_total_blocks * page
        return [
            LoadSnapshot(
                timestamp=time.time(),
                dp_rank=0,
                num_running_reqs=load.num_running,
                num_waiting_reqs=load.num_waiting,
                num_used_tokens=used,
                num_total_tokens=used,
                max_total_num_tokens=capacity,
                token_usage=used / capacity if capacity else 0.0,
            )
        ]

    async def flush_cache(self) -> FlushCacheReqOutput:
        await self.engine.backend.mocker.clear_kv_cache()
        return FlushCacheReqOutput(True)


class FakeSglangEngine:
    """sglang.Engine's API (async_generate, tokenizer_manager, server_args, shutdown)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        page = int(kwargs.get("page_size") or 16)
        self.server_args = SimpleNamespace(
            model_path=kwargs["model_path"],
            served_model_name=kwargs.get("served_model_name"),
            page_size=page,
            context_length=int(kwargs.get("context_length") or 1024),
            max_running_requests=int(kwargs.get("max_running_requests") or 256),
            incremental_streaming_output=bool(kwargs.get("incremental_streaming_output")),
            disaggregation_bootstrap_port=int(kwargs.get("disaggregation_bootstrap_port", 8998)),
            lora_paths=kwargs.get("lora_paths"),
            grammar_backend=kwargs.get("grammar_backend", "xgrammar"),
        )
        self.scheduler_info = {
            "max_total_num_tokens": 256 * page,
            "max_running_requests": self.server_args.max_running_requests,
        }
        self.backend = Backend(
            block_size=page,
            num_blocks=256,
            context_length=self.server_args.context_length,
            prefix_caching=not kwargs.get("disable_radix_cache", False),
            speedup_ratio=float(kwargs.get("fake_speedup_ratio", 1e6)),  # test knob, not SGLang's
        )
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.streams: dict[str, Any] = {}
        self.calls: dict[str, dict[str, Any]] = {}
        """rid -> the keyword arguments async_generate got."""
        self.publisher: SglangPublisher | None = None
        events = kwargs.get("kv_events_config")
        if events:
            cfg = json.loads(events)
            if cfg.get("publisher") == "zmq":
                self.publisher = SglangPublisher(
                    cfg["endpoint"], cfg.get("replay_endpoint"), cfg.get("topic", ""), self
                )
        self.shut_down = False

    async def async_generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        mm_hashes: Any = None,
        mm_content_hashes: Any = None,
        return_logprob: Any = False,
        logprob_start_len: Any = None,
        top_logprobs_num: Any = None,
        token_ids_logprob: Any = None,
        lora_path: Any = None,
        custom_logit_processor: Any = None,
        require_reasoning: bool = False,
        return_hidden_states: Any = False,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        stream: bool = False,
        bootstrap_host: Any = None,
        bootstrap_port: Any = None,
        bootstrap_room: Any = None,
        routed_dp_rank: int | None = None,
        disagg_prefill_dp_rank: int | None = None,
        data_parallel_rank: int | None = None,
        external_trace_header: dict[str, Any] | None = None,
        rid: Any = None,
        session_params: dict[str, Any] | None = None,
        priority: int | None = None,
        session_id: str | None = None,
        *,
        cache_salt: Any = None,
    ) -> Any:
        assert stream is True and input_ids is not None and rid is not None
        await self.backend.ensure_started()
        if self.publisher is not None:
            self.publisher.ensure_started()
        p = check_sampling(dict(sampling_params or {}))
        self.calls[rid] = {
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num,
            "lora_path": lora_path,
            "priority": priority,
            "bootstrap": (bootstrap_host, bootstrap_port, bootstrap_room),
        }
        top_k = p["top_k"]
        request = EngineRequest(
            rid,
            list(input_ids),
            SamplingParams(
                temperature=p["temperature"],
                top_p=p["top_p"],
                top_k=0 if top_k == -1 else top_k,
                min_p=p["min_p"],
                presence_penalty=p["presence_penalty"],
                frequency_penalty=p["frequency_penalty"],
                repetition_penalty=p["repetition_penalty"],
                seed=p["sampling_seed"],
                top_logprobs=(top_logprobs_num or 0) if return_logprob else None,
            ),
            StopParams(
                max_tokens=p["max_new_tokens"],
                min_tokens=p["min_new_tokens"],
                stop_token_ids=tuple(p["stop_token_ids"] or ()),
                ignore_eos=p["ignore_eos"],
            ),
        )
        s = self.backend.submit(request)
        s.output_abort = False
        self.streams[rid] = s
        return self._chunks(rid, len(input_ids), s, bool(return_logprob))

    async def _chunks(
        self, rid: str, prompt_len: int, stream: Any, logprobs: bool
    ) -> AsyncIterator[dict[str, Any]]:
        incremental = self.server_args.incremental_streaming_output
        ids: list[int] = []
        chosen: list[Any] = []
        tops: list[Any] = []
        while True:
            try:
                async with asyncio.timeout(0.05):
                    out = await anext(stream)
            except TimeoutError:
                if stream.output_abort:
                    yield self._chunk(
                        rid,
                        [],
                        prompt_len,
                        len(ids),
                        0,
                        {"type": "abort", "message": "Abort request", "status_code": None},
                        [],
                        [],
                        False,
                    )
                    return
                continue
            new = list(out.token_ids)
            new_chosen = [(lp.logprob, lp.token_id, None) for lp in out.logprobs or []]
            new_tops = [[(v, t, None) for t, v in lp.top] for lp in out.logprobs or []]
            ids += new
            chosen += new_chosen
            tops += new_tops
            reason: Any = None
            if out.finish_reason is FinishReason.STOP:
                reason = {"type": "stop", "matched": out.stop_token_id}
            elif out.finish_reason is FinishReason.LENGTH:
                reason = {"type": "length", "length": len(ids)}
            cached = out.usage.cached_tokens if out.usage else 0
            if incremental:
                yield self._chunk(
                    rid, new, prompt_len, len(ids), cached, reason, new_chosen, new_tops, logprobs
                )
            else:
                yield self._chunk(
                    rid, list(ids), prompt_len, len(ids), cached, reason, chosen, tops, logprobs
                )
            if reason is not None:
                self.streams.pop(rid, None)
                return

    @staticmethod
    def _chunk(
        rid: str,
        output_ids: list[int],
        prompt_len: int,
        completion: int,
        cached: int,
        reason: Any,
        chosen: list[Any],
        tops: list[Any],
        logprobs: bool,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "cached_tokens": cached,
        }
        if logprobs:
            meta["output_token_logprobs"] = list(chosen)
            meta["output_top_logprobs"] = list(tops)
        return {"text": "", "output_ids": output_ids, "meta_info": meta}

    def shutdown(self) -> None:
        self.shut_down = True
        if self.publisher is not None:
            self.publisher.close()
        self.stopping = asyncio.get_running_loop().create_task(self.backend.stop())

    async def aclose(self) -> None:
        """Test helper: wait for what shutdown() started."""
        with contextlib.suppress(Exception):
            await self.stopping


_END = (-1).to_bytes(8, "big", signed=True)


class SglangPublisher:
    """SGLang's KV event publishing protocol over ZMQ (see the module docstring)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, topic: str, engine: FakeSglangEngine
    ) -> None:
        self.engine = engine
        self.topic = topic.encode()
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.router: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.seq = 0
        self.tasks: list[asyncio.Task[None]] = []

    def ensure_started(self) -> None:
        if not self.tasks:
            loop = asyncio.get_running_loop()
            self.tasks.append(loop.create_task(self._forward()))
            if self.router is not None:
                self.tasks.append(loop.create_task(self._replay()))

    async def publish(self, events: list[Any], dp_rank: int = 0) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, dp_rank])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def _forward(self) -> None:
        page = self.engine.server_args.page_size
        async for kind in self.engine.backend.events():
            events: list[Any] = []
            if isinstance(kind, BlocksStored):
                parent = kind.parent_hash
                for b in kind.blocks:  # one page per BlockStored, chained
                    events.append(
                        [
                            "BlockStored",
                            [signed64(b.block_hash)],
                            signed64(parent) if parent is not None else None,
                            list(b.token_ids),
                            page,
                            None,
                            "GPU",
                        ]
                    )
                    parent = b.block_hash
            elif isinstance(kind, BlocksRemoved):
                events = [["BlockRemoved", [signed64(h)], "GPU"] for h in kind.block_hashes]
            else:
                assert isinstance(kind, AllCleared)
                events = [["AllBlocksCleared"]]
            await self.publish(events)

    async def _replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", _END, b""])

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()


def factory(**overrides: Any) -> Any:
    """An engine_factory for SglangEngine that builds a FakeSglangEngine (and remembers it)."""

    def build(kwargs: dict[str, Any]) -> FakeSglangEngine:
        fake = FakeSglangEngine(**{**kwargs, **overrides})
        build.last = fake  # type: ignore[attr-defined]
        return fake

    return build
