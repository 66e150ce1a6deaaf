"""`kvmesh worker --engine sglang`: SGLang's offline Engine behind the kvmesh Engine interface.

A thin layer over SGLang's own async API:
  * generation: `await Engine.async_generate(input_ids=..., sampling_params={...}, stream=True,
    rid=...)` returns an async iterator of dicts `{"output_ids", "meta_info": {"id",
    "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
    "output_token_logprobs", "output_top_logprobs"}, ...}`. Depending on SGLang's
    `incremental_streaming_output` the ids (and logprobs) are either the new ones or all so
    far; the adapter takes the last `completion_tokens - tokens seen` of them, which is right in
    both modes;
  * sampling: SGLang's sampling-params dict (max_new_tokens, min_new_tokens, stop_token_ids,
    json_schema / regex / ebnf, logit_bias keyed by token id strings, sampling_seed, ...); only
    values that differ from SGLang's defaults are sent, so older SGLang versions accept them;
  * cancellation: `Engine.tokenizer_manager.abort_request(rid=...)`;
  * KV events: SGLang's ZMQ publisher (`kv_events_config`), received by ZmqKvSubscriber: one page
    per BlockStored, signed 64-bit hashes, the GPU tier only; pages with request metadata (a
    cache salt) or token pairs (bigram caches) are withheld from the router;
  * load: `tokenizer_manager.get_loads(include=["core"])` (SGLang's /v1/loads source: one
    LoadSnapshot per DP rank; get_load() on SGLang versions before it) polled every
    `--sglang-load-interval-s`;
  * disaggregation hooks: SGLang moves KV between a prefill and a decode engine that serve the
    same request at the same time, matched by a bootstrap room on the prefill engine's
    bootstrap server (`bootstrap_host`, `bootstrap_port`, `bootstrap_room` of async_generate).
    `bootstrap_params()` makes that triple for this (prefill) engine, `submit` of a request
    whose `remote_prefill.engine_params_json` carries one joins that room (and drops the first
    token, which the prefill engine produced), and `start_prefill()` runs the prefill side.
    kvmesh's PrefillRemote, which finishes the prefill before the decode starts, cannot drive
    that protocol (SGLang's prefill engine waits for its decode peer before it computes), so
    the worker roles prefill/decode are refused for SGLang until the router dispatches both
    halves together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.runtime.errors import InvalidRequest, KvmeshError, Unavailable, Unimplemented
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedKind,
    LoadInfo,
    Role,
    TokenLogprob,
)
from kvmesh.workers.adapters.base import OutputDecoder, StreamingAdapter, top_logprobs
from kvmesh.workers.adapters.config import SglangConfig
from kvmesh.workers.adapters.kv_translate import KvEventTranslator, StoredChain, engine_hash
from kvmesh.workers.adapters.zmq_endpoints import (
    private_ipc_endpoints,
    remove_private_ipc_files,
)
from kvmesh.workers.engine import DisaggSettings, OutputSink, RequestHandle

__all__ = ["SglangDecoder", "SglangEngine", "SglangEngineLike", "sampling_dict"]

log = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kvmesh"
MAX_REPETITION_PENALTY = 2.0
"""SGLang refuses repetition_penalty above 2 (kvmesh allows any value > 0)."""


class TokenizerManagerLike(Protocol):
    """The part of sglang.srt.managers.tokenizer_manager.TokenizerManager the adapter uses."""

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None: ...

    async def get_loads(self, include: list[str] | None = None) -> Any:
        """SGLang's /v1/loads source (one LoadSnapshot per DP rank). SGLang 0.5.17 and later
        have only this; older versions may have only `get_load()`, which the adapter then
        uses."""
        ...

    async def flush_cache(self) -> Any: ...


class SglangEngineLike(Protocol):
    """The part of sglang.Engine (sglang.srt.entrypoints.engine.Engine) the adapter uses."""

    server_args: Any
    """Resolved ServerArgs: page_size, context_length, max_running_requests, ..."""
    tokenizer_manager: Any

    async def async_generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any: ...

    def shutdown(self) -> None: ...


EngineFactory = Callable[[dict[str, Any]], SglangEngineLike]
"""ServerArgs keyword arguments -> a started sglang.Engine."""


def _default_factory(kwargs: dict[str, Any]) -> SglangEngineLike:
    import sglang  # pyright: ignore[reportMissingImports]  (GPU-only engine)

    engine: SglangEngineLike = sglang.Engine(**kwargs)
    return engine


def sampling_dict(request: EngineRequest, context_length: int) -> dict[str, Any]:
    """SGLang's sampling_params dict for `request`: the values that differ from SGLang's
    defaults. Raises InvalidRequest for what SGLang cannot do."""
    s, stop = request.sampling, request.stop
    if s.repetition_penalty > MAX_REPETITION_PENALTY:
        raise InvalidRequest(
            f"repetition_penalty must be at most {MAX_REPETITION_PENALTY} with SGLang, "
            f"got {s.repetition_penalty}",
            param="repetition_penalty",
        )
    max_new = stop.max_tokens
    if max_new is None:
        max_new = context_length - len(request.prompt)
    d: dict[str, Any] = {"max_new_tokens": max_new}
    defaults: dict[str, Any] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    for name, default in defaults.items():
        value = getattr(s, name)
        if value != default:
            d[name] = value
    if s.top_k:
        d["top_k"] = s.top_k
    if stop.min_tokens:
        d["min_new_tokens"] = stop.min_tokens
    if stop.stop_token_ids:
        d["stop_token_ids"] = list(stop.stop_token_ids)
    if stop.ignore_eos:
        d["ignore_eos"] = True
    if s.logit_bias:
        d["logit_bias"] = {str(t): b for t, b in s.logit_bias.items()}
    if s.seed is not None:
        d["sampling_seed"] = s.seed
    g = s.guided
    if g is not None:
        if g.kind is GuidedKind.JSON_SCHEMA:
            d["json_schema"] = g.value
        elif g.kind is GuidedKind.JSON_OBJECT:
            d["json_schema"] = '{"type": "object"}'
        elif g.kind is GuidedKind.REGEX:
            d["regex"] = g.value
        elif g.kind is GuidedKind.GRAMMAR:
            d["ebnf"] = g.value
        else:
            d["regex"] = "(" + "|".join(re.escape(c) for c in g.choices) + ")"
    return d


@dataclass(slots=True)
class _SglangCall:
    """What `_open` passes to Engine.async_generate."""

    kwargs: dict[str, Any]
    skip: int = 0


class SglangDecoder(OutputDecoder[dict[str, Any]]):
    """SGLang's streamed output dicts -> EngineOutput (see the module docstring)."""

    def __init__(self, request: EngineRequest, *, skip: int = 0) -> None:
        super().__init__(request, skip=skip)
        self.want_logprobs = request.sampling.top_logprobs
        self.seen = 0
        """Engine tokens seen so far (SGLang's completion_tokens)."""
        self.last_token: int | None = None

    def feed(self, item: dict[str, Any]) -> EngineOutput | None:
        meta = item.get("meta_info") or {}
        ids = item.get("output_ids")
        if ids is None:
            ids = item.get("token_ids") or []
        total = meta.get("completion_tokens")
        if total is None:
            total = self.seen + len(ids)
        n_new = max(int(total) - self.seen, 0)
        tokens = [int(t) for t in ids[len(ids) - n_new :]] if n_new else []
        self.seen = int(total)
        if "prompt_tokens" in meta:
            self.prompt_tokens = int(meta["prompt_tokens"])
        if meta.get("cached_tokens"):
            self.cached_tokens = max(self.cached_tokens, int(meta["cached_tokens"]))
        if tokens:
            self.last_token = tokens[-1]
        logprobs = None
        if self.want_logprobs is not None and tokens:
            logprobs = self._logprobs(tokens, meta)
        finish: FinishReason | None = None
        stop_id: int | None = None
        reason = meta.get("finish_reason")
        if reason is not None:
            kind = reason.get("type") if isinstance(reason, dict) else str(reason)
            if kind == "stop":
                finish = FinishReason.STOP
                matched = reason.get("matched") if isinstance(reason, dict) else None
                stop_id = matched if isinstance(matched, int) else self.last_token
            elif kind == "length":
                finish = FinishReason.LENGTH
            else:
                message = reason.get("message") if isinstance(reason, dict) else None
                status = reason.get("status_code") if isinstance(reason, dict) else None
                text = f"SGLang aborted request {self.request.request_id}: {message or kind}"
                if status == 400:
                    raise InvalidRequest(text)
                raise Unavailable(text)
        return self.emit(tokens, logprobs, finish, stop_id)

    def _logprobs(self, tokens: list[int], meta: dict[str, Any]) -> list[TokenLogprob]:
        n = len(tokens)
        chosen = list(meta.get("output_token_logprobs") or [])[-n:]
        tops = list(meta.get("output_top_logprobs") or [])[-n:]
        k = self.want_logprobs or 0
        result: list[TokenLogprob] = []
        for i, token in enumerate(tokens):
            value = float("nan")
            if i < len(chosen) and chosen[i] is not None:
                value = float(chosen[i][0])
            candidates = (
                [(int(c[1]), float(c[0])) for c in (tops[i] or [])] if i < len(tops) else []
            )
            if not any(t == token for t, _ in candidates):
                candidates.append((token, value))
            lp = top_logprobs(token, candidates, k)
            result.append(lp if lp is not None else TokenLogprob(token, value))
        return result


class SglangEngine(StreamingAdapter[dict[str, Any]]):
    """SGLang behind the kvmesh Engine interface (see the module docstring).

    `engine_factory` builds the engine from ServerArgs keyword arguments; the default is
    `sglang.Engine(**kwargs)`. Tests pass a factory returning an object with sglang.Engine's API.
    """

    def __init__(
        self,
        config: SglangConfig,
        *,
        model_path: str,
        served_model_name: str,
        eos_token_ids: Sequence[int] = (),
        context_length: int = 8192,
        engine_factory: EngineFactory | None = None,
        advertise_host: str = "127.0.0.1",
    ) -> None:
        super().__init__(
            engine_name="sglang",
            served_model_name=served_model_name,
            model_path=model_path,
            eos_token_ids=eos_token_ids,
            context_length=context_length,
        )
        self.config = config
        self.advertise_host = advertise_host
        """Host decode engines reach this engine's bootstrap server on."""
        self._factory = engine_factory or _default_factory
        self._engine: SglangEngineLike | None = None
        self.kv_events_endpoint: str | None = None
        self.kv_events_replay_endpoint: str | None = None
        self._kv_topic = KV_EVENTS_TOPIC
        self._load_errors = 0
        self._load_wake = asyncio.Event()

    # -- engine arguments ----------------------------------------------------------------------

    def engine_kwargs(self) -> dict[str, Any]:
        """ServerArgs keyword arguments: --sglang-engine-args plus the model and KV events."""
        kwargs = dict(self.config.engine_args)
        kwargs["model_path"] = self._info.model_path
        kwargs.setdefault("served_model_name", self._info.served_model_name)
        if self.config.sglang_kv_events and not kwargs.get("disable_radix_cache"):
            events = kwargs.get("kv_events_config")
            if isinstance(events, str) and events:
                events = json.loads(events)
            if isinstance(events, dict) and events:
                events = {"publisher": "zmq", **events}
            else:
                endpoint = self.config.sglang_kv_events_endpoint
                replay = None
                if not endpoint:
                    endpoint, replay = private_ipc_endpoints("sglang")
                events = {
                    "publisher": "zmq",
                    "endpoint": endpoint,
                    "replay_endpoint": replay,
                    "topic": KV_EVENTS_TOPIC,
                }
            kwargs["kv_events_config"] = json.dumps(events)  # SGLang takes the CLI JSON string
            self.kv_events_endpoint = str(events.get("endpoint", "tcp://*:5557"))
            self.kv_events_replay_endpoint = events.get("replay_endpoint")
            self._kv_topic = str(events.get("topic", ""))
        else:
            self.kv_events_endpoint = None
        return kwargs

    # -- StreamingAdapter ----------------------------------------------------------------------

    async def _start_engine(self) -> None:
        kwargs = self.engine_kwargs()
        if self.kv_events_endpoint is not None:
            await self._start_kv_events()
        self._engine = engine = self._factory(kwargs)
        args = engine.server_args
        page = int(getattr(args, "page_size", None) or 1)
        info = self._info
        info.kv_block_size = page
        tm = engine.tokenizer_manager
        context = getattr(tm, "context_len", None) or getattr(args, "context_length", None)
        if context:
            info.context_length = int(context)
        sched = _scheduler_info(engine)
        total_tokens = int(sched.get("max_total_num_tokens") or 0)
        info.kv_total_blocks = total_tokens // page
        info.max_num_seqs = int(
            sched.get("max_running_requests") or getattr(args, "max_running_requests", 0) or 0
        )
        caps = ["LOGPROBS"]
        if getattr(args, "grammar_backend", None) != "none":  # SGLang's default: xgrammar
            caps.append("GUIDED_DECODING")
        if getattr(args, "lora_paths", None):
            caps.append("LORA")
        if self._events is not None:
            caps.append("KV_EVENTS")
            self._translator = KvEventTranslator(self._events, page)
        info.capabilities = tuple(caps)
        self._spawn(self._poll_load(), "sglang-load")

    async def _start_kv_events(self) -> None:
        assert self.kv_events_endpoint is not None
        await self._start_zmq_kv_events(
            endpoint=self.kv_events_endpoint,
            replay_endpoint=self.kv_events_replay_endpoint,
            topic=self._kv_topic,
            on_payload=self.apply_kv_payload,
            task_name="sglang-kv-events",
        )

    async def _stop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        self.subscriber = None
        remove_private_ipc_files(self.kv_events_endpoint, self.kv_events_replay_endpoint)

    def _prepare(self, request: EngineRequest) -> _SglangCall:
        kwargs: dict[str, Any] = {
            "input_ids": list(request.prompt),
            "sampling_params": sampling_dict(request, self._info.context_length),
            "stream": True,
            "rid": request.request_id,
        }
        s = request.sampling
        if s.top_logprobs is not None:
            kwargs["return_logprob"] = True
            if s.top_logprobs:
                kwargs["top_logprobs_num"] = s.top_logprobs
        if request.lora_name:
            kwargs["lora_path"] = request.lora_name  # an adapter name from --lora-paths
        if request.priority:
            kwargs["priority"] = request.priority
        call = _SglangCall(kwargs)
        rp = request.remote_prefill
        if rp is not None:
            boot = _bootstrap(rp.engine_params_json)
            kwargs.update(boot)
            call.skip = 1  # the decode engine's output starts with the prefill engine's token
        return call

    async def _open(self, request: EngineRequest, prepared: _SglangCall) -> AsyncIterator[Any]:
        engine = self._engine
        if engine is None:
            raise Unavailable("the sglang engine is not running")
        stream: AsyncIterator[Any] = await engine.async_generate(**prepared.kwargs)
        return stream

    def _decoder(self, request: EngineRequest, prepared: _SglangCall) -> SglangDecoder:
        return SglangDecoder(request, skip=prepared.skip)

    async def _abort(self, request_id: str, stream: AsyncIterator[Any] | None) -> None:
        if self._engine is not None:
            self._engine.tokenizer_manager.abort_request(rid=request_id)

    def _translate_error(self, exc: Exception) -> BaseException:
        # SGLang raises fastapi.HTTPException for some refusals (status_code + detail).
        status = getattr(exc, "status_code", None)
        if isinstance(status, int) and not isinstance(exc, KvmeshError):
            detail = getattr(exc, "detail", None) or str(exc)
            if status == 400:
                return InvalidRequest(f"SGLang refused the request: {detail}")
            if status in (429, 503):
                return Unavailable(f"SGLang is busy: {detail}")
        return super()._translate_error(exc)

    # -- load ----------------------------------------------------------------------------------

    def _requests_changed(self) -> None:
        self._load_wake.set()

    async def _poll_load(self) -> None:
        """The engine's load every interval, and as soon as a request starts or ends."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.sglang_load_interval_s):
                    await self._load_wake.wait()
            self._load_wake.clear()
            engine = self._engine
            if engine is None:
                continue
            manager = engine.tokenizer_manager
            get_loads = getattr(manager, "get_loads", None)
            try:
                if get_loads is not None:
                    loads = await get_loads(include=["core"])
                else:  # an SGLang from before get_loads()
                    loads = await manager.get_load()
            except Exception as exc:
                self._load_errors += 1
                if self._load_errors == 1:
                    log.warning("SGLang's load query failed (%r); load metrics stay stale", exc)
                continue
            self.apply_load(loads)

    def apply_load(self, loads: Any) -> None:
        """SGLang's load, one item per DP rank -> engine_load. Items of get_loads()
        (LoadSnapshot, or GetLoadsReqOutput before it: num_running_reqs, num_waiting_reqs,
        num_used_tokens) or of the older get_load() (GetLoadReqOutput: num_reqs counting the
        waiting ones, num_waiting_reqs, num_pages or num_tokens); objects or dicts."""
        if not isinstance(loads, (list, tuple)):
            loads = [loads]
        page = max(self._info.kv_block_size, 1)
        running = waiting = blocks = 0
        for item in loads:
            queued = int(_field(item, "num_waiting_reqs"))
            waiting += queued
            now_running = _field(item, "num_running_reqs", None)
            if now_running is not None:  # get_loads()
                running += int(now_running)
                blocks += -(-int(_field(item, "num_used_tokens")) // page)
                continue
            running += max(int(_field(item, "num_reqs")) - queued, 0)
            pages = _field(item, "num_pages", None)
            if pages is None:
                pages = -(-int(_field(item, "num_tokens")) // page)
            blocks += int(pages)
        self.engine_load = LoadInfo(
            num_running=running,
            num_waiting=waiting,
            kv_active_blocks=blocks,
            kv_total_blocks=self._info.kv_total_blocks,
        )

    # -- KV events -----------------------------------------------------------------------------

    def apply_kv_payload(self, payload: bytes) -> None:
        """One msgpack event batch from SGLang's publisher -> the KvEventLog."""
        import msgspec

        from kvmesh.workers.adapters.zmq_events import SglangBatch, SglangEvent, decode_events

        batch = msgspec.msgpack.decode(payload, type=SglangBatch)
        if batch.attn_dp_rank not in (None, 0):
            return  # one kvmesh worker per attention-DP rank (see README)
        self.apply_kv_events(decode_events(batch.events, SglangEvent))

    def apply_kv_events(self, events: Sequence[Any]) -> None:
        """Decoded SGLang events -> the KvEventLog (GPU tier)."""
        from kvmesh.workers.adapters.zmq_events import SglangRemoved, SglangStored

        tr = self._translator
        if tr is None:
            return
        for ev in events:
            if isinstance(ev, SglangStored):
                if ev.medium not in (None, "GPU"):
                    continue
                n = len(ev.block_hashes)
                size = ev.block_size
                tokens: list[Sequence[int]] = [
                    ev.token_ids[i * size : (i + 1) * size] for i in range(n)
                ]
                if size < 1 or len(ev.token_ids) != n * size:
                    tokens = [ev.token_ids] * n  # malformed: withheld (length check)
                opaque = [ev.metadata is not None] * n
                tr.stored(
                    StoredChain(
                        parent=(
                            engine_hash(ev.parent_block_hash)
                            if ev.parent_block_hash is not None
                            else None
                        ),
                        hashes=[engine_hash(h) for h in ev.block_hashes],
                        tokens=tokens,
                        opaque=opaque,
                    )
                )
            elif isinstance(ev, SglangRemoved):
                if ev.medium not in (None, "GPU"):
                    continue
                tr.removed(engine_hash(h) for h in ev.block_hashes)
            else:
                tr.cleared()

    async def clear_kv_cache(self) -> int:
        engine = self._engine
        if engine is None:
            return 0
        held = self._translator.num_held if self._translator is not None else 0
        result = await engine.tokenizer_manager.flush_cache()
        return held if getattr(result, "success", True) else 0

    # -- disaggregation hooks ------------------------------------------------------------------

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        """Only the aggregated role (see the module docstring)."""
        if settings.role is not Role.AGGREGATED:
            raise Unimplemented(
                "SGLang disaggregation needs the prefill and decode engines to receive a request "
                "at the same time (bootstrap room); kvmesh's PrefillRemote runs the prefill "
                "first, so --role prefill/decode is not available for --engine sglang yet"
            )
        self._disagg = settings

    def bootstrap_params(self, room: int | None = None) -> dict[str, Any]:
        """The bootstrap triple a decode engine uses to receive KV from this prefill engine:
        this worker's host, SGLang's `disaggregation_bootstrap_port` and a room id."""
        port = 8998
        if self._engine is not None:
            port = int(getattr(self._engine.server_args, "disaggregation_bootstrap_port", port))
        return {
            "bootstrap_host": self.advertise_host,
            "bootstrap_port": port,
            "bootstrap_room": secrets.randbits(63) if room is None else room,
        }

    def start_prefill(
        self, request: EngineRequest, bootstrap: dict[str, Any], sink: OutputSink
    ) -> RequestHandle:
        """Run `request` on this (prefill-mode) engine for the decode engine that joins the
        same bootstrap room; outputs go to `sink` like submit's."""
        if not self._running:
            raise Unavailable("the sglang engine is not running")
        from kvmesh.workers.validation import validate_request

        validate_request(request, self._info)
        call = self._prepare(request)
        call.kwargs.update(
            {k: bootstrap[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
        )
        return self._submit_prepared(request, sink, call)


def _bootstrap(text: str) -> dict[str, Any]:
    """bootstrap_host/port/room from a remote prefill's engine_params_json."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"remote_prefill.engine_params_json is not valid JSON: {exc.msg}",
            param="remote_prefill",
        ) from exc
    keys = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    if not isinstance(value, dict) or not all(k in value for k in keys):
        raise InvalidRequest(
            "remote_prefill.engine_params_json must hold bootstrap_host, bootstrap_port and "
            "bootstrap_room for SGLang",
            param="remote_prefill",
        )
    return {k: value[k] for k in keys}


def _field(item: Any, name: str, default: Any = 0) -> Any:
    if isinstance(item, dict):
        return item.get(name, default)
    return getattr(item, name, default)


def _scheduler_info(engine: Any) -> dict[str, Any]:
    """The first scheduler's info dict (max_total_num_tokens, ...), wherever this SGLang
    version keeps it."""
    info = getattr(engine, "scheduler_info", None)
    if isinstance(info, dict):
        return info
    init = getattr(engine, "_scheduler_init_result", None)
    infos = getattr(init, "scheduler_infos", None)
    if infos:
        first = infos[0]
        return first if isinstance(first, dict) else {}
    return {}
