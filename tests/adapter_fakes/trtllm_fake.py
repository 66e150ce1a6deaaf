"""A fake of TensorRT-LLM's LLM API, speaking its formats, with the kvmesh mocker as the model.

Upstream: TensorRT-LLM 1.2.1 (UPSTREAM_VERSION, the newest release; tests/unit/
test_adapter_fake_versions.py fails if the `trtllm` extra of pyproject.toml excludes it). Not
checked against an installed 1.2.1: PyPI's tensorrt-llm 1.2.1 is a 10 kB sdist that fetches the
wheel from NVIDIA's own index, which this project cannot reach. What was checked, against
TensorRT-LLM's GitHub sources: the SamplingParams public fields and defaults (sampling_params.py
at commit 000a01de, version 1.0.0rc4), the DisaggregatedParams P-D fields (disaggregated_params.py
at commit 01009a33) and the generate_async parameters (tensorrt_llm/llmapi/llm.py on main, with
conversation_params, cache_salt and priority). The adapter passes only inputs, sampling_params,
lora_request, streaming and disaggregated_params, which every 1.x release takes.

What follows TensorRT-LLM's source (tensorrt_llm/llmapi/llm.py, executor/result.py,
sampling_params.py, disaggregated_params.py, _utils.py KVCacheEventSerializer):
  * `LLM(**llm_args)`, `LLM.generate_async(inputs, sampling_params, ..., streaming=True, ...,
    disaggregated_params=...)` with the real parameter list, returning a RequestOutput that is
    its own async iterator (`__anext__` returns itself after each step until `finished`), with
    `outputs[0]` a CompletionOutput (cumulative token_ids, logprobs as {token id: Logprob},
    finish_reason "stop"/"length"/"cancelled", stop_reason) and `abort()`;
  * SamplingParams / GuidedDecodingParams / DisaggregatedParams as keyword-only dataclasses with
    the real field names (an unknown name is a TypeError); a stop token is cut from the output
    unless include_stop_str_in_output, like TensorRT-LLM does;
  * `get_kv_cache_events_async(timeout)` / `get_stats_async(timeout)`: iterators that yield what
    is buffered and end after `timeout` seconds without anything new; KV events as the
    serializer's dicts ("created", "stored" with unique_token tokens, "removed"), stats as the
    iteration-stats dicts (numActiveRequests, kvCacheStats, ...).
This is an independent implementation of those formats for testing, not TensorRT-LLM's code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvmesh.runtime.kv_events import AllCleared, BlocksRemoved, BlocksStored
from kvmesh.runtime.types import EngineRequest, FinishReason, SamplingParams, StopParams

from .backend import Backend

UPSTREAM_DIST = "tensorrt_llm"
UPSTREAM_VERSION = "1.2.1"
UPSTREAM_SOURCES = (
    "tensorrt_llm/llmapi/llm.py",
    "tensorrt_llm/executor/result.py",
    "tensorrt_llm/sampling_params.py",
    "tensorrt_llm/disaggregated_params.py",
    "tensorrt_llm/_utils.py",
)


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None


@dataclass(slots=True, kw_only=True)
class TrtSamplingParams:
    """tensorrt_llm.SamplingParams' public fields and defaults."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: Any = None
    bad_token_ids: list[int] | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    beam_width_array: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Any = None
    lookahead_config: Any = None
    guided_decoding: GuidedDecodingParams | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list[Any] | None = None
    first_gen_logits: list[Any] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: Any = None


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: Any = None
    disaggregated_params: DisaggregatedParams | None = None


class RequestOutput:
    """The result of generate_async: its own async iterator, one step per __anext__."""

    def __init__(
        self,
        llm: FakeLLM,
        request_id: int,
        prompt: list[int],
        params: TrtSamplingParams,
        disagg: DisaggregatedParams | None,
    ) -> None:
        self.llm = llm
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.params = params
        self.outputs = [CompletionOutput(0)]
        self.finished = False
        self._aborted = False
        self.disaggregated_params: DisaggregatedParams | None = None
        self._disagg = disagg
        gen_only = disagg is not None and disagg.request_type == "generation_only"
        if gen_only:  # the context server's first token comes first
            assert disagg is not None and disagg.first_gen_tokens
            self.outputs[0].token_ids.append(disagg.first_gen_tokens[0])
        top_k = params.top_k
        temperature = params.temperature if params.temperature is not None else 1.0
        if top_k == 1:
            temperature, top_k = 0.0, 0
        self.stream = llm.backend.submit(
            EngineRequest(
                f"trt-{request_id}",
                list(prompt),
                SamplingParams(
                    temperature=temperature,
                    top_p=params.top_p if params.top_p is not None else 1.0,
                    top_k=top_k or 0,
                    min_p=params.min_p or 0.0,
                    presence_penalty=params.presence_penalty or 0.0,
                    frequency_penalty=params.frequency_penalty or 0.0,
                    repetition_penalty=params.repetition_penalty or 1.0,
                    seed=params.seed,
                    top_logprobs=params.logprobs,
                ),
                StopParams(
                    max_tokens=params.max_tokens,
                    min_tokens=params.min_tokens or 0,
                    stop_token_ids=tuple(params.stop_token_ids or ()),
                    ignore_eos=params.ignore_eos,
                ),
            )
        )
        self._skip_first = gen_only  # the mocker re-samples the first token: drop it

    def abort(self) -> None:
        self._aborted = True
        self.llm.aborted.append(self.request_id)
        self.stream.cancel()

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = self.outputs[0]
        while True:
            if self._aborted:
                out.finish_reason = "cancelled"
                self.finished = True
                return self
            try:
                async with asyncio.timeout(0.05):
                    step = await anext(self.stream)
                break
            except TimeoutError:
                continue
        self.llm._stat()  # one iteration-stats record per step
        tokens = list(step.token_ids)
        lps = list(step.logprobs or [])
        if self._skip_first and tokens:
            tokens, lps, self._skip_first = tokens[1:], lps[1:], False
        out.token_ids += tokens
        if self.params.logprobs is not None:
            out.logprobs += [
                {lp.token_id: Logprob(lp.logprob), **{t: Logprob(v) for t, v in lp.top}}
                for lp in lps
            ]
        if step.finish_reason is not None:
            self.finished = True
            if step.finish_reason is FinishReason.STOP:
                out.finish_reason = "stop"
                out.stop_reason = step.stop_token_id
                if not self.params.include_stop_str_in_output:
                    out.token_ids = out.token_ids[:-1]  # TensorRT-LLM cuts the stop word
            else:
                out.finish_reason = "length"
            if self._disagg is not None and self._disagg.request_type == "context_only":
                self.disaggregated_params = out.disaggregated_params = DisaggregatedParams(
                    request_type="context_only",
                    first_gen_tokens=out.token_ids[:1],
                    ctx_request_id=self.request_id,
                    opaque_state=b"\x00opaque\xff",
                    draft_tokens=None,
                )
        return self


class _Polled:
    """get_kv_cache_events_async / get_stats_async: yields what arrives, ends after `timeout`
    seconds without anything."""

    def __init__(self, queue: asyncio.Queue[Any], timeout: float | None) -> None:
        self.queue = queue
        self.timeout = timeout

    def __aiter__(self) -> _Polled:
        return self

    async def __anext__(self) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await self.queue.get()
        except TimeoutError:
            raise StopAsyncIteration from None


class FakeLLM:
    """tensorrt_llm.LLM's API (generate_async, get_kv_cache_events_async, get_stats_async, args,
    shutdown)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        kv = dict(kwargs.get("kv_cache_config") or {})
        kv.setdefault("tokens_per_block", 32)
        self.args = SimpleNamespace(
            model=kwargs["model"],
            kv_cache_config=SimpleNamespace(**kv),
            max_seq_len=int(kwargs.get("max_seq_len") or 1024),
            max_batch_size=int(kwargs.get("max_batch_size") or 256),
            guided_decoding_backend=kwargs.get("guided_decoding_backend"),
            enable_iter_perf_stats=bool(kwargs.get("enable_iter_perf_stats")),
        )
        self.backend = Backend(
            block_size=kv["tokens_per_block"],
            num_blocks=256,
            context_length=self.args.max_seq_len,
            prefix_caching=bool(kv.get("enable_block_reuse")),
            speedup_ratio=float(kwargs.get("fake_speedup_ratio", 1e6)),  # test knob
        )
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.stats: asyncio.Queue[Any] = asyncio.Queue()
        self.calls: dict[int, dict[str, Any]] = {}
        self.aborted: list[int] = []
        self._ids = 0
        self._event_id = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._cached: set[int] = set()
        self.window = self.args.max_seq_len
        if kv.get("event_buffer_max_size") and kv.get("enable_block_reuse"):
            self._event({"type": "created", "num_blocks_per_cache_level": [256, 0]})
            self._tasks.append(asyncio.get_running_loop().create_task(self._forward()))

    def generate_async(
        self,
        inputs: Any,
        sampling_params: Any = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        trace_headers: Mapping[str, str] | None = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        conversation_params: Any = None,
        cache_salt: str | None = None,
        priority: float = 0.5,
    ) -> RequestOutput:
        assert streaming and isinstance(sampling_params, TrtSamplingParams)
        prompt = list(inputs["prompt_token_ids"])
        if len(prompt) + sampling_params.max_tokens > self.args.max_seq_len:
            raise ValueError("prompt + max_tokens exceed max_seq_len")
        self._ids += 1
        self.calls[self._ids] = {
            "sampling_params": sampling_params,
            "lora_request": lora_request,
            "disaggregated_params": disaggregated_params,
        }
        return RequestOutput(self, self._ids, prompt, sampling_params, disaggregated_params)

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> _Polled:
        return _Polled(self.events, timeout)

    def get_stats_async(self, timeout: float | None = 2) -> _Polled:
        self._stat()
        return _Polled(self.stats, timeout)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.stopping = asyncio.get_running_loop().create_task(self.backend.stop())

    async def aclose(self) -> None:
        """Test helper: wait for what shutdown() started."""
        with contextlib.suppress(Exception):
            await self.stopping

    # -- internals -------------------------------------------------------------------------

    def _event(self, data: dict[str, Any]) -> None:
        self.events.put_nowait(
            {"event_id": self._event_id, "data": data, "window_size": self.window}
        )
        self._event_id += 1

    def _stat(self) -> None:
        load = self.backend.load()
        self.stats.put_nowait(
            {
                "iter": self._event_id,
                "numActiveRequests": load.num_running,
                "numQueuedRequests": load.num_waiting,
                "maxNumActiveRequests": self.args.max_batch_size,
                "kvCacheStats": {
                    "maxNumBlocks": load.kv_total_blocks,
                    "usedNumBlocks": load.kv_active_blocks,
                    "freeNumBlocks": load.kv_total_blocks - load.kv_active_blocks,
                    "tokensPerBlock": self.args.kv_cache_config.tokens_per_block,
                    "cacheHitRate": load.prefix_cache_hit_rate,
                },
                "inflightBatchingStats": {"numPausedRequests": 0},
            }
        )

    async def _forward(self) -> None:
        await self.backend.ensure_started()
        async for kind in self.backend.events():
            if isinstance(kind, BlocksStored):
                self._event(
                    {
                        "type": "stored",
                        "parent_hash": kind.parent_hash,
                        "blocks": [
                            {
                                "type": "stored_block",
                                "block_hash": b.block_hash,
                                "tokens": [
                                    {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                    for t in b.token_ids
                                ],
                                "cache_level": 0,
                                "priority": 35,
                            }
                            for b in kind.blocks
                        ],
                    }
                )
            elif isinstance(kind, BlocksRemoved):
                self._event({"type": "removed", "block_hashes": list(kind.block_hashes)})
            else:
                assert isinstance(kind, AllCleared)
                # TensorRT-LLM has no "all cleared" event: it removes every block.
                self._event({"type": "removed", "block_hashes": list(self._cached)})
            self._cached = set(self.backend.cached_blocks())
            self._stat()


class FakeRuntime:
    """The TrtllmRuntime protocol over the fakes (kvmesh.workers.adapters.trtllm_runtime's
    functions, building fake tensorrt_llm objects)."""

    def __init__(self, **llm_overrides: Any) -> None:
        self.llm_overrides = llm_overrides
        self.last: FakeLLM | None = None

    def create_llm(self, kwargs: dict[str, Any]) -> FakeLLM:
        self.last = FakeLLM(**{**kwargs, **self.llm_overrides})
        return self.last

    def sampling_params(self, kwargs: dict[str, Any], guided: dict[str, Any] | None) -> Any:
        if guided:
            kwargs = {**kwargs, "guided_decoding": GuidedDecodingParams(**guided)}
        return TrtSamplingParams(**kwargs)

    def disaggregated_params(self, kwargs: dict[str, Any]) -> DisaggregatedParams:
        return DisaggregatedParams(**kwargs)

    def lora_request(self, name: str, int_id: int, path: str) -> Any:
        return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=path)
