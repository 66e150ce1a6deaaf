"""A fake of vLLM's AsyncLLM built from vLLM's own classes, with the kvmesh mocker as the model.

Real vLLM pieces: the AsyncEngineArgs it is built from, SamplingParams it reads, the
RequestOutput / CompletionOutput / Logprob objects it yields, the SchedulerStats /
PrefixCacheStats / IterationStats records it hands to stat loggers (through the per-engine
factory protocol of vLLM's StatLoggerManager), and the KV events: vLLM's BlockStored /
BlockRemoved / AllBlocksCleared in a KVEventBatch, published by vLLM's ZmqEventPublisher on the
endpoints of the engine args' kv_events_config. Block hashes are sent as 32-byte values (vLLM's
default sha256 form) whose low 64 bits are the mocker's hash, so the adapter's KvEventLog can be
compared with the mocker's cache exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import warnings
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

with warnings.catch_warnings():
    # vLLM's imports reach torch APIs torch 2.13 deprecates; tests turn warnings into errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    from kvmesh.workers.adapters import vllm_runtime  # noqa: F401  (imports the same modules)

from kvmesh.runtime.kv_events import AllCleared, BlocksRemoved, BlocksStored
from kvmesh.runtime.types import EngineRequest, FinishReason, StopParams
from kvmesh.runtime.types import SamplingParams as KvSamplingParams

from .backend import Backend


def as_vllm_hash(h: int) -> bytes:
    """A 32-byte block hash (vLLM's sha256 form) whose low 64 bits are `h`."""
    return h.to_bytes(32, "big")


class FakeAsyncLLM:
    """AsyncLLM's API (generate, abort, reset_prefix_cache, add_lora, remove_lora, shutdown,
    vllm_config)."""

    def __init__(
        self,
        engine_args: Any,
        stat_loggers: Sequence[Callable[[Any, int], Any]],
        *,
        num_blocks: int = 256,
        max_model_len: int = 1024,
        max_num_seqs: int = 256,
        speedup_ratio: float = 1e6,
    ) -> None:
        self.engine_args = engine_args
        block_size = engine_args.block_size or 16
        caching = bool(engine_args.enable_prefix_caching)
        self.backend = Backend(
            block_size=block_size,
            num_blocks=num_blocks,
            context_length=max_model_len,
            prefix_caching=caching,
            speedup_ratio=speedup_ratio,
        )
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=block_size, num_gpu_blocks=num_blocks),
            model_config=SimpleNamespace(max_model_len=max_model_len),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        )
        self.stat_loggers = [factory(self.vllm_config, 0) for factory in stat_loggers]
        self.streams: dict[str, Any] = {}
        self.aborted: list[str] = []
        self.loras: dict[int, Any] = {}
        """lora_int_id -> the LoRARequest add_lora got."""
        self.requests: dict[str, tuple[Any, SamplingParams, dict[str, Any]]] = {}
        """request_id -> (prompt, sampling params, keyword arguments) as generate got them."""
        self.publisher: ZmqEventPublisher | None = None
        self._forward: asyncio.Task[None] | None = None
        self._hits = 0
        cfg = engine_args.kv_events_config
        if cfg is not None and cfg.enable_kv_cache_events and caching:
            self.publisher = ZmqEventPublisher(
                data_parallel_rank=0,
                endpoint=cfg.endpoint,
                replay_endpoint=cfg.replay_endpoint,
                topic=cfg.topic,
            )
            self._forward = asyncio.get_running_loop().create_task(self._publish_events())
        self.published_batches = 0

    # -- AsyncLLM API ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        await self.backend.ensure_started()
        assert sampling_params.output_kind == RequestOutputKind.DELTA
        token_ids = list(prompt["prompt_token_ids"])
        self.requests[request_id] = (
            prompt,
            sampling_params,
            {"lora_request": lora_request, "priority": priority},
        )
        stream = self.backend.submit(_mocker_request(request_id, token_ids, sampling_params))
        self.streams[request_id] = stream
        try:
            async for out in stream:
                finish = out.finish_reason
                logprobs = None
                if sampling_params.logprobs is not None and out.logprobs is not None:
                    logprobs = [
                        {
                            lp.token_id: Logprob(lp.logprob, rank=1),
                            **{t: Logprob(v, rank=r + 1) for r, (t, v) in enumerate(lp.top)},
                        }
                        for lp in out.logprobs
                    ]
                completion = CompletionOutput(
                    index=0,
                    text="",
                    token_ids=list(out.token_ids),
                    cumulative_logprob=None,
                    logprobs=logprobs,
                    finish_reason=None if finish is None else _FINISH[finish],
                    stop_reason=out.stop_token_id if finish is FinishReason.STOP else None,
                )
                yield RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=token_ids,
                    prompt_logprobs=None,
                    outputs=[completion],
                    finished=finish is not None,
                    num_cached_tokens=out.usage.cached_tokens if out.usage else None,
                    kv_transfer_params=_kv_transfer_params(sampling_params, finish),
                )
                self._record()
                if finish is not None:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id, internal=True)
            raise
        finally:
            self.streams.pop(request_id, None)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.aborted.append(rid)
            stream = self.streams.pop(rid, None)
            if stream is not None:
                stream.cancel()
        self._record()

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        await self.backend.mocker.clear_kv_cache()
        return True

    async def add_lora(self, lora_request: Any) -> bool:
        """As AsyncLLM.add_lora: vLLM's worker fails to read a missing adapter (a bare
        Exception, as vLLM's collective RPC raises it)."""
        if not await asyncio.to_thread(Path(lora_request.lora_path).is_dir):
            raise Exception(
                f"Call to add_lora method failed: Loading lora {lora_request.lora_name} failed: "
                f"No adapter found for {lora_request.lora_path}"
            )
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None

    def shutdown(self, timeout: float | None = None) -> None:
        if self._forward is not None:
            self._forward.cancel()
        if self.publisher is not None:
            self.publisher.shutdown()
        self.stopping = asyncio.get_running_loop().create_task(self.backend.stop())

    # -- internals -------------------------------------------------------------------------

    def _record(self) -> None:
        load = self.backend.load()
        stats = SchedulerStats(
            num_running_reqs=load.num_running,
            num_waiting_reqs=load.num_waiting,
            kv_cache_usage=load.kv_active_blocks / max(load.kv_total_blocks, 1),
            prefix_cache_stats=PrefixCacheStats(requests=1, queries=10, hits=5),
        )
        iteration = IterationStats()
        for logger in self.stat_loggers:
            logger.record(stats, iteration)

    async def _publish_events(self) -> None:
        assert self.publisher is not None
        await self.backend.ensure_started()
        block_size = self.vllm_config.cache_config.block_size
        async for kind in self.backend.events():
            if isinstance(kind, BlocksStored):
                event: Any = BlockStored(
                    block_hashes=[as_vllm_hash(b.block_hash) for b in kind.blocks],
                    parent_block_hash=(
                        as_vllm_hash(kind.parent_hash) if kind.parent_hash is not None else None
                    ),
                    token_ids=[t for b in kind.blocks for t in b.token_ids],
                    block_size=block_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=kind.lora_name or None,
                    group_idx=0,
                )
            elif isinstance(kind, BlocksRemoved):
                event = BlockRemoved(
                    block_hashes=[as_vllm_hash(h) for h in kind.block_hashes],
                    medium="GPU",
                    group_idx=0,
                )
            else:
                assert isinstance(kind, AllCleared)
                event = AllBlocksCleared()
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
            self.published_batches += 1

    async def aclose(self) -> None:
        """Test helper: wait for what shutdown() started."""
        with contextlib.suppress(Exception):
            await self.stopping


_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}


def _kv_transfer_params(params: SamplingParams, finish: FinishReason | None) -> Any:
    """What vLLM's NixlConnector hands back on a prefill-side request's last output."""
    asked = (params.extra_args or {}).get("kv_transfer_params")
    if finish is None or not asked or not asked.get("do_remote_decode"):
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1]],
        "remote_engine_id": "fake-engine",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


def _mocker_request(request_id: str, prompt: list[int], p: SamplingParams) -> EngineRequest:
    """The mocker request for vLLM SamplingParams (the knobs the mocker simulates)."""
    return EngineRequest(
        request_id,
        prompt,
        KvSamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(p.top_k, 0),
            min_p=p.min_p,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            seed=p.seed,
            top_logprobs=p.logprobs,
            logit_bias=dict(p.logit_bias or {}),
        ),
        StopParams(
            max_tokens=p.max_tokens,
            min_tokens=p.min_tokens,
            stop_token_ids=tuple(p.stop_token_ids or ()),
            ignore_eos=p.ignore_eos,
        ),
    )


def factory(**kwargs: Any) -> Callable[[Any, Sequence[Callable[[Any, int], Any]]], FakeAsyncLLM]:
    """An engine_factory for VllmEngine that builds a FakeAsyncLLM (and remembers it)."""

    def build(engine_args: Any, stat_loggers: Sequence[Callable[[Any, int], Any]]) -> FakeAsyncLLM:
        fake = FakeAsyncLLM(engine_args, stat_loggers, **kwargs)
        build.last = fake  # type: ignore[attr-defined]
        return fake

    return build
