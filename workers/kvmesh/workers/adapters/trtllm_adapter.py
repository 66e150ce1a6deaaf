"""`kvmesh worker --engine trtllm`: TensorRT-LLM's LLM API behind the kvmesh Engine interface.

A thin layer over TensorRT-LLM's own async API:
  * generation: `LLM.generate_async(inputs, sampling_params, streaming=True)` returns a
    RequestOutput that is its own async iterator; each step updates `outputs[0]` (cumulative
    `token_ids`, `logprobs` as one {token id: Logprob} per token, `finish_reason` "stop" /
    "length" / "timeout" / "cancelled", `stop_reason`). The adapter tracks how many tokens it
    already sent. `include_stop_str_in_output=True` keeps stop tokens in the output, as the
    kvmesh contract wants;
  * cancellation: `RequestOutput.abort()`;
  * KV events: the engine's event API, `LLM.get_kv_cache_events_async(timeout)`, polled in a
    loop (each call yields the buffered events and ends after `timeout` without new ones).
    Event dicts (tensorrt_llm._utils.KVCacheEventSerializer): `{"event_id", "window_size",
    "attention_dp_rank"?, "data": {"type": "created" | "stored" | "removed" | "updated", ...}}`;
    "stored" carries `parent_hash` and blocks `{"block_hash", "tokens": [{"token_id",
    "token_extra_id"}], "cache_level", "priority"}`. The largest attention window's blocks are
    published: level 0 (GPU) on the DEVICE tier, the host level on the HOST tier; a block moved
    between them ("updated" cache_level 0 -> 1 and back) moves between those tiers; blocks with
    extra token ids (multimodal, prompt tables) are withheld. A jump in event ids (the engine's
    buffer overflowed) resyncs the log;
  * load: `LLM.get_stats_async(timeout)` iteration stats (numActiveRequests,
    numQueuedRequests, kvCacheStats.usedNumBlocks / maxNumBlocks / cacheHitRate);
  * disaggregation: TensorRT-LLM's cache transceiver moves the KV. The prefill side runs the
    request with `DisaggregatedParams(request_type="context_only")` and returns the
    DisaggregatedParams the engine hands back (first_gen_tokens, ctx_request_id, opaque_state
    ...) as engine_params_json; the decode side passes them with
    `request_type="generation_only"`. The decode output repeats the first token; it is dropped.

Engine arguments pass through to `LLM(**kwargs)` (what `trtllm-serve --config` takes).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from kvmesh.runtime.errors import DeadlineExceeded, InvalidRequest, NotFound, Unavailable
from kvmesh.runtime.kv_events import KvEventLog, KvTier
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedKind,
    LoadInfo,
    PrefillResult,
    RemotePrefill,
    Role,
    TokenLogprob,
    Usage,
)
from kvmesh.workers.adapters.base import OutputDecoder, PrefillSink, StreamingAdapter, top_logprobs
from kvmesh.workers.adapters.config import TrtllmConfig
from kvmesh.workers.adapters.kv_tiers import model_kv_block_bytes, trtllm_with_tiers
from kvmesh.workers.adapters.kv_translate import KvEventTranslator, StoredChain, engine_hash
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.engine import DisaggSettings
from kvmesh.workers.validation import validate_request

__all__ = ["LlmLike", "TrtllmDecoder", "TrtllmEngine", "TrtllmRuntime", "sampling_kwargs"]

log = logging.getLogger(__name__)

DEFAULT_TOKENS_PER_BLOCK = 32
"""TensorRT-LLM's default KV block size (tokens_per_block)."""
EVENT_POLL_S = 1.0
"""Timeout of one get_kv_cache_events_async / get_stats_async call."""
_DISAGG_FIELDS = (
    "request_type",
    "first_gen_tokens",
    "ctx_request_id",
    "opaque_state",
    "draft_tokens",
    "disagg_request_id",
    "ctx_dp_rank",
    "ctx_info_endpoint",
)


class LlmLike(Protocol):
    """The part of tensorrt_llm.LLM the adapter uses."""

    args: Any
    """LlmArgs: kv_cache_config.tokens_per_block, max_seq_len, max_batch_size."""

    def generate_async(
        self,
        inputs: Any,
        sampling_params: Any = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        trace_headers: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        conversation_params: Any = None,
        cache_salt: str | None = None,
        priority: float = 0.5,
    ) -> Any: ...

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> AsyncIterator[Any]: ...

    def get_stats_async(self, timeout: float | None = 2) -> AsyncIterator[Any]: ...

    def shutdown(self) -> None: ...


class TrtllmRuntime(Protocol):
    """Constructors of tensorrt_llm objects (kvmesh.workers.adapters.trtllm_runtime)."""

    def create_llm(self, kwargs: dict[str, Any]) -> LlmLike: ...

    def sampling_params(self, kwargs: dict[str, Any], guided: dict[str, Any] | None) -> Any: ...

    def disaggregated_params(self, kwargs: dict[str, Any]) -> Any: ...

    def lora_request(self, name: str, int_id: int, path: str) -> Any: ...


def sampling_kwargs(
    request: EngineRequest, context_length: int
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """tensorrt_llm.SamplingParams keyword arguments and GuidedDecodingParams keyword arguments
    (or None) for `request`. Raises InvalidRequest for what the adapter cannot map."""
    s, stop = request.sampling, request.stop
    if s.logit_bias:
        raise InvalidRequest(
            "logit_bias is not supported with TensorRT-LLM (it takes a vocabulary-sized "
            "embedding_bias tensor)",
            param="logit_bias",
        )
    max_tokens = stop.max_tokens
    if max_tokens is None:
        max_tokens = context_length - len(request.prompt)
    kw: dict[str, Any] = {
        "max_tokens": max_tokens,
        "include_stop_str_in_output": True,  # stop tokens stay in the output (kvmesh contract)
        "detokenize": False,
    }
    if s.temperature == 0:
        kw["top_k"] = 1  # greedy
    else:
        kw["temperature"] = s.temperature
        if s.top_k:
            kw["top_k"] = s.top_k
        if s.top_p != 1.0:
            kw["top_p"] = s.top_p
        if s.min_p:
            kw["min_p"] = s.min_p
    for name, default in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        value = getattr(s, name)
        if value != default:
            kw[name] = value
    if s.seed is not None:
        kw["seed"] = s.seed
    if stop.min_tokens:
        kw["min_tokens"] = stop.min_tokens
    if stop.stop_token_ids:
        kw["stop_token_ids"] = list(stop.stop_token_ids)
    if stop.ignore_eos:
        kw["ignore_eos"] = True
    if s.top_logprobs is not None:
        kw["logprobs"] = max(s.top_logprobs, 1)
    guided: dict[str, Any] | None = None
    g = s.guided
    if g is not None:
        if g.kind is GuidedKind.JSON_SCHEMA:
            guided = {"json": g.value}
        elif g.kind is GuidedKind.JSON_OBJECT:
            guided = {"json_object": True}
        elif g.kind is GuidedKind.REGEX:
            guided = {"regex": g.value}
        elif g.kind is GuidedKind.GRAMMAR:
            guided = {"grammar": g.value}
        else:
            guided = {"regex": "(" + "|".join(re.escape(c) for c in g.choices) + ")"}
    return kw, guided


@dataclasses.dataclass(slots=True)
class _TrtCall:
    """What `_open` passes to LLM.generate_async."""

    inputs: dict[str, Any]
    params: Any
    lora: Any = None
    disaggregated: Any = None
    skip: int = 0


class TrtllmDecoder(OutputDecoder[Any]):
    """TensorRT-LLM RequestOutput (cumulative) -> EngineOutput."""

    def __init__(self, request: EngineRequest, *, skip: int = 0) -> None:
        super().__init__(request, skip=skip)
        self.want_logprobs = request.sampling.top_logprobs
        self.seen = 0
        self.last_token: int | None = None
        self.disaggregated_params: Any = None

    def feed(self, item: Any) -> EngineOutput | None:
        ids = getattr(item, "prompt_token_ids", None)
        if ids:
            self.prompt_tokens = len(ids)
        out = item.outputs[0] if item.outputs else None
        if out is None:
            return None
        params = getattr(out, "disaggregated_params", None) or getattr(
            item, "disaggregated_params", None
        )
        if params is not None:
            self.disaggregated_params = params
        token_ids = list(out.token_ids or [])
        tokens = [int(t) for t in token_ids[self.seen :]]
        logprobs = None
        if self.want_logprobs is not None and tokens:
            logprobs = self._logprobs(tokens, list(out.logprobs or [])[self.seen :])
        self.seen = len(token_ids)
        if tokens:
            self.last_token = tokens[-1]
        finish: FinishReason | None = None
        stop_id: int | None = None
        reason = out.finish_reason
        if reason is not None and item.finished:
            if reason == "stop":
                finish = FinishReason.STOP
                stop_id = out.stop_reason if isinstance(out.stop_reason, int) else self.last_token
            elif reason == "length":
                finish = FinishReason.LENGTH
            elif reason == "timeout":
                raise DeadlineExceeded(f"TensorRT-LLM timed out request {self.request.request_id}")
            else:
                raise Unavailable(
                    f"TensorRT-LLM ended request {self.request.request_id} with {reason!r}"
                )
        return self.emit(tokens, logprobs, finish, stop_id)

    def _logprobs(self, tokens: list[int], positions: list[Any]) -> list[TokenLogprob]:
        k = self.want_logprobs or 0
        result: list[TokenLogprob] = []
        for i, token in enumerate(tokens):
            position = positions[i] if i < len(positions) else None
            if isinstance(position, dict):
                candidates = [(int(t), float(lp.logprob)) for t, lp in position.items()]
                lp = top_logprobs(token, candidates, k)
            elif isinstance(position, (int, float)):  # older API: the chosen token's only
                lp = TokenLogprob(token, float(position))
            else:
                lp = None
            result.append(lp if lp is not None else TokenLogprob(token, float("nan")))
        return result


class TrtllmEngine(StreamingAdapter[Any]):
    """TensorRT-LLM behind the kvmesh Engine interface (see the module docstring).

    `runtime` builds tensorrt_llm objects; the default is kvmesh.workers.adapters.trtllm_runtime
    (needs tensorrt_llm). Tests pass an object with the same functions returning fakes.
    """

    created_timeout_s = 5.0
    """How long start() waits for the engine's first KV event (the cache size)."""

    def __init__(
        self,
        config: TrtllmConfig,
        *,
        model_path: str,
        served_model_name: str,
        eos_token_ids: Sequence[int] = (),
        context_length: int = 8192,
        runtime: TrtllmRuntime | None = None,
        tiers: KvTierConfig | None = None,
    ) -> None:
        super().__init__(
            engine_name="trtllm",
            served_model_name=served_model_name,
            model_path=model_path,
            eos_token_ids=eos_token_ids,
            context_length=context_length,
        )
        self.config = config
        self._runtime = runtime
        self._tiers = tiers
        """KV tiers: the host tier as TensorRT-LLM's host cache level (adapters.kv_tiers)."""
        self._llm: LlmLike | None = None
        self._lora_ids = {name: i + 1 for i, name in enumerate(config.lora_modules)}
        self._last_event_id: int | None = None
        self._window: int | None = None
        self._primary: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        """Published blocks: hash -> (parent, tokens), to bring back blocks that return from the
        host level."""
        self._secondary: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        """Blocks on the host level only."""
        self._created = asyncio.Event()
        self.events_total = 0

    # -- engine arguments ----------------------------------------------------------------------

    def engine_kwargs(self) -> dict[str, Any]:
        """LLM(...) keyword arguments: --trtllm-engine-args plus the model, KV events and stats."""
        kwargs = dict(self.config.engine_args)
        kwargs["model"] = self._info.model_path
        kwargs["enable_iter_perf_stats"] = True  # get_stats_async is kvmesh's load source
        kv = dict(kwargs.get("kv_cache_config") or {})
        if self.config.trtllm_kv_events and kv.get("enable_block_reuse", True):
            kv["enable_block_reuse"] = True
            kv.setdefault("event_buffer_max_size", self.config.trtllm_kv_event_buffer)
        if kv:
            kwargs["kv_cache_config"] = kv
        if self._info.role is not Role.AGGREGATED:
            kwargs.setdefault("cache_transceiver_config", {"backend": "DEFAULT"})
        return self._with_tiers(kwargs)

    def _with_tiers(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The host tier flag as TensorRT-LLM's host cache level (adapters.kv_tiers)."""
        if self._tiers is None or not self._tiers.enabled:
            return kwargs
        tokens = _nested(kwargs, "kv_cache_config", "tokens_per_block") or DEFAULT_TOKENS_PER_BLOCK
        dtype = str(_nested(kwargs, "kv_cache_config", "dtype") or "auto")
        block_bytes = model_kv_block_bytes(self._info.model_path, int(tokens), dtype)
        return trtllm_with_tiers(kwargs, self._tiers, block_bytes=block_bytes)

    @property
    def kv_events_enabled(self) -> bool:
        kv = self.engine_kwargs().get("kv_cache_config") or {}
        return bool(kv.get("enable_block_reuse")) and bool(kv.get("event_buffer_max_size"))

    # -- StreamingAdapter ----------------------------------------------------------------------

    def _rt(self) -> TrtllmRuntime:
        if self._runtime is None:
            from kvmesh.workers.adapters import trtllm_runtime

            self._runtime = trtllm_runtime
        assert self._runtime is not None
        return self._runtime

    async def _start_engine(self) -> None:
        kwargs = self.engine_kwargs()
        events = self.kv_events_enabled
        self._llm = llm = self._rt().create_llm(kwargs)
        args = llm.args
        info = self._info
        block = _nested(args, "kv_cache_config", "tokens_per_block") or _nested(
            args, "build_config", "plugin_config", "tokens_per_block"
        )
        info.kv_block_size = int(block or DEFAULT_TOKENS_PER_BLOCK)
        max_len = getattr(args, "max_seq_len", None)
        if max_len:
            info.context_length = int(max_len)
        info.max_num_seqs = int(getattr(args, "max_batch_size", 0) or 0)
        caps = ["LOGPROBS"]
        if getattr(args, "guided_decoding_backend", None):
            caps.append("GUIDED_DECODING")
        if self._lora_ids:
            caps.append("LORA")
        if info.role is not Role.AGGREGATED:
            caps.append("DISAGGREGATION")
        self._spawn(self._poll_stats(), "trtllm-stats")
        if events:
            self._events = KvEventLog()
            self._translator = KvEventTranslator(self._events, info.kv_block_size)
            caps.append("KV_EVENTS")
            self._spawn(self._poll_kv_events(), "trtllm-kv-events")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._created.wait(), self.created_timeout_s)
        info.capabilities = tuple(caps)

    async def _stop_engine(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    def _prepare(self, request: EngineRequest) -> _TrtCall:
        rt = self._rt()
        kw, guided = sampling_kwargs(request, self._info.context_length)
        call = _TrtCall({"prompt_token_ids": list(request.prompt)}, None)
        rp = request.remote_prefill
        if rp is not None:
            params = _disagg_from_json(rp.engine_params_json)
            params["request_type"] = "generation_only"
            call.disaggregated = rt.disaggregated_params(params)
            call.skip = 1  # the generation-only output repeats the first token
        try:
            call.params = rt.sampling_params(kw, guided)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"TensorRT-LLM refused the sampling options: {exc}") from exc
        if request.lora_name:
            lora_id = self._lora_ids.get(request.lora_name)
            if lora_id is None:
                raise NotFound(
                    f"LoRA adapter {request.lora_name!r} is not configured (--trtllm-lora-modules)",
                    param="lora_name",
                )
            path = self.config.lora_modules[request.lora_name]
            call.lora = rt.lora_request(request.lora_name, lora_id, path)
        return call

    async def _open(self, request: EngineRequest, prepared: _TrtCall) -> AsyncIterator[Any]:
        llm = self._llm
        if llm is None:
            raise Unavailable("the trtllm engine is not running")
        result: AsyncIterator[Any] = llm.generate_async(
            prepared.inputs,
            sampling_params=prepared.params,
            lora_request=prepared.lora,
            streaming=True,
            disaggregated_params=prepared.disaggregated,
        )
        return result

    def _decoder(self, request: EngineRequest, prepared: _TrtCall) -> TrtllmDecoder:
        return TrtllmDecoder(request, skip=prepared.skip)

    async def _abort(self, request_id: str, stream: AsyncIterator[Any] | None) -> None:
        if stream is not None and not getattr(stream, "finished", False):
            stream.abort()  # type: ignore[attr-defined]

    # -- load ----------------------------------------------------------------------------------

    async def _poll_stats(self) -> None:
        while not self._stopping:
            llm = self._llm
            if llm is None:
                return
            try:
                async for stat in llm.get_stats_async(EVENT_POLL_S):
                    self.apply_stats(stat)
            except Exception as exc:
                log.warning("TensorRT-LLM get_stats_async failed: %r", exc)
                await asyncio.sleep(EVENT_POLL_S)
            await asyncio.sleep(0)

    def apply_stats(self, stat: Any) -> None:
        """One iteration-stats record (a dict, or its JSON text) -> engine_load."""
        if isinstance(stat, (str, bytes)):
            stat = json.loads(stat)
        kv = stat.get("kvCacheStats") or {}
        batching = stat.get("inflightBatchingStats") or {}
        total = int(kv.get("maxNumBlocks") or 0)
        if total and not self._info.kv_total_blocks:
            self._info.kv_total_blocks = total
        self.engine_load = LoadInfo(
            num_running=int(stat.get("numActiveRequests") or 0),
            num_waiting=int(stat.get("numQueuedRequests") or 0)
            + int(batching.get("numPausedRequests") or 0),
            kv_active_blocks=int(kv.get("usedNumBlocks") or 0),
            kv_total_blocks=self._info.kv_total_blocks,
            prefix_cache_hit_rate=float(kv.get("cacheHitRate") or 0.0),
        )

    # -- KV events -----------------------------------------------------------------------------

    async def _poll_kv_events(self) -> None:
        while not self._stopping:
            llm = self._llm
            if llm is None:
                return
            try:
                async for event in llm.get_kv_cache_events_async(EVENT_POLL_S):
                    self.apply_kv_event(event)
            except Exception as exc:
                log.warning("TensorRT-LLM get_kv_cache_events_async failed: %r", exc)
                await asyncio.sleep(EVENT_POLL_S)
            await asyncio.sleep(0)

    def apply_kv_event(self, event: Any) -> None:
        """One TensorRT-LLM KV cache event (a dict, or its JSON text) -> the KvEventLog."""
        if isinstance(event, (str, bytes)):
            event = json.loads(event)
        if not event:
            return
        self.events_total += 1
        if event.get("attention_dp_rank") not in (None, 0):
            return  # one kvmesh worker per attention-DP rank (see README)
        eid = event.get("event_id")
        if isinstance(eid, int):
            last = self._last_event_id
            if last is not None and eid > last + 1 and self._translator is not None:
                self._secondary.clear()
                self._primary.clear()
                self._translator.resync(f"TensorRT-LLM events {last + 1}..{eid - 1} were lost")
            self._last_event_id = eid if last is None else max(last, eid)
        data = event.get("data") or {}
        kind = data.get("type")
        window = event.get("window_size")
        if kind == "created":
            if isinstance(window, int) and (self._window is None or window > self._window):
                self._window = window
            levels = data.get("num_blocks_per_cache_level") or []
            if levels and self._window in (None, window):
                self._info.kv_total_blocks = int(levels[0])
            self._created.set()
            return
        if self._window is not None and isinstance(window, int) and window != self._window:
            return  # a smaller (sliding) attention window's blocks: not what the router hashes
        tr = self._translator
        if tr is None:
            return
        if kind == "stored":
            self._stored(tr, data)
        elif kind == "removed":
            hashes = [engine_hash(h) for h in data.get("block_hashes") or []]
            for h in hashes:
                self._primary.pop(h, None)
                self._secondary.pop(h, None)
            tr.removed(hashes)
        elif kind == "updated":
            self._updated(tr, data)

    def _stored(self, tr: KvEventTranslator, data: dict[str, Any]) -> None:
        parent = data.get("parent_hash")
        parent = engine_hash(parent) if parent is not None else None
        hashes: list[int] = []
        tokens: list[tuple[int, ...]] = []
        opaque: list[bool] = []
        levels: list[int] = []
        for block in data.get("blocks") or []:
            toks = block.get("tokens") or []
            hashes.append(engine_hash(block["block_hash"]))
            tokens.append(tuple(int(t["token_id"]) for t in toks))
            opaque.append(any(t.get("token_extra_id") for t in toks))
            levels.append(int(block.get("cache_level") or 0))
        prev = parent
        for h, t, level in zip(hashes, tokens, levels, strict=True):
            (self._primary if level == 0 else self._secondary)[h] = (prev, t)
            prev = h
        if all(level == 0 for level in levels):
            tr.stored(StoredChain(parent, hashes, list(tokens), opaque=opaque))
            return
        # Mixed levels: publish each on its tier (the host level: HOST) with its parent.
        prev = parent
        for i, h in enumerate(hashes):
            tier = KvTier.DEVICE if levels[i] == 0 else KvTier.HOST
            tr.stored(StoredChain(prev, [h], [tokens[i]], opaque=[opaque[i]]), tier)
            prev = h

    def _updated(self, tr: KvEventTranslator, data: dict[str, Any]) -> None:
        diff = data.get("cache_level")
        if not isinstance(diff, dict):
            return  # a priority change: nothing for the router
        h = engine_hash(data["block_hash"])
        old, new = diff.get("old_value"), diff.get("new_value")
        if old == 0 and new != 0:  # offloaded to the host level
            entry = self._primary.pop(h, None)
            if entry is not None:
                self._secondary[h] = entry
                tr.stored(StoredChain(entry[0], [h], [entry[1]]), KvTier.HOST)
            tr.removed([h])
        elif old != 0 and new == 0:  # back on the GPU
            entry = self._secondary.pop(h, None)
            if entry is not None:
                self._primary[h] = entry
                tr.stored(StoredChain(entry[0], [h], [entry[1]]))
                tr.removed([h], KvTier.HOST)

    # -- disaggregation ------------------------------------------------------------------------

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        """Any role: TensorRT-LLM's cache transceiver (cache_transceiver_config) moves the KV;
        kvmesh carries the DisaggregatedParams between the workers."""
        self._disagg = settings
        self._info.role = settings.role

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        if not self._running:
            raise Unavailable("the trtllm engine is not running")
        validate_request(request, self._info)
        one = dataclasses.replace(
            request,
            stop=dataclasses.replace(
                request.stop, max_tokens=1, min_tokens=min(request.stop.min_tokens, 1)
            ),
        )
        call = self._prepare(one)
        call.disaggregated = self._rt().disaggregated_params({"request_type": "context_only"})
        sink = PrefillSink()
        handle = self._submit_prepared(one, sink, call)
        try:
            last = await sink.future
        except BaseException:
            handle.cancel()
            raise
        decoder = handle.decoder
        assert isinstance(decoder, TrtllmDecoder)
        if last.finish_reason is FinishReason.CANCELLED or not sink.tokens:
            raise Unavailable("the trtllm engine stopped during the prefill")
        usage = Usage(decoder.prompt_tokens, 1, decoder.cached_tokens)
        remote = RemotePrefill(
            first_token_id=sink.tokens[0],
            first_logprob=sink.logprobs[0] if sink.logprobs else None,
            engine_params_json=json.dumps(
                {"disaggregated_params": _disagg_to_json(decoder.disaggregated_params)}
            ),
        )
        if last.finish_reason is FinishReason.STOP:
            return PrefillResult(remote, usage, FinishReason.STOP, last.stop_token_id)
        if request.stop.max_tokens == 1:
            return PrefillResult(remote, usage, FinishReason.LENGTH)
        return PrefillResult(remote, usage)


def _nested(obj: Any, *names: str) -> Any:
    for name in names:
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def _disagg_to_json(params: Any) -> dict[str, Any]:
    """DisaggregatedParams -> JSON-able dict (opaque_state as base64)."""
    if params is None:
        return {}
    out: dict[str, Any] = {}
    for name in _DISAGG_FIELDS:
        value = _nested(params, name)
        if value is None:
            continue
        if isinstance(value, bytes):
            value = {"base64": base64.b64encode(value).decode()}
        out[name] = value
    return out


def _disagg_from_json(text: str) -> dict[str, Any]:
    """engine_params_json of a TensorRT-LLM remote prefill -> DisaggregatedParams kwargs."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"remote_prefill.engine_params_json is not valid JSON: {exc.msg}",
            param="remote_prefill",
        ) from exc
    params = value.get("disaggregated_params") if isinstance(value, dict) else None
    if not isinstance(params, dict) or "ctx_request_id" not in params:
        raise InvalidRequest(
            "remote_prefill.engine_params_json must hold TensorRT-LLM disaggregated_params with "
            "ctx_request_id",
            param="remote_prefill",
        )
    out: dict[str, Any] = {}
    for name in _DISAGG_FIELDS:
        if name in params:
            v = params[name]
            if isinstance(v, dict) and "base64" in v:
                v = base64.b64decode(v["base64"])
            out[name] = v
    return out
