"""The vLLM adapter against vLLM's real Python classes (no GPU: the engine itself is a fake).

Real vLLM here: AsyncEngineArgs / KVEventsConfig / KVTransferConfig built from the worker
flags, SamplingParams / StructuredOutputsParams / LoRARequest built per request, RequestOutput /
CompletionOutput / Logprob decoded, SchedulerStats / IterationStats / PrefixCacheStats through a
real StatLoggerBase subclass, and the KV events: BlockStored / BlockRemoved / AllBlocksCleared in
a KVEventBatch sent by vLLM's ZmqEventPublisher (its PUB socket and its replay ROUTER socket).
What stands in for vLLM is only AsyncLLM itself (tests/adapter_fakes/vllm_fake.py), because it
needs a GPU; its method signatures are checked against AsyncLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import time
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (bash tests/install_vllm.sh)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # see tests/adapter_fakes/vllm_fake.py
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import FinishReason as VllmFinishReason
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError
    from vllm.v1.metrics.stats import (
        FinishedRequestStats,
        IterationStats,
        PrefixCacheStats,
        SchedulerStats,
    )

    from kvmesh.workers.adapters import vllm_runtime
    from tests.adapter_fakes import vllm_fake

from kvmesh.runtime.errors import InvalidRequest, NotFound, Unavailable, Unimplemented
from kvmesh.runtime.kv_events import KvEventLog, KvTier
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    MediaInput,
    RemotePrefill,
    Role,
    StopParams,
)
from kvmesh.runtime.types import SamplingParams as KvSampling
from kvmesh.workers.adapters.config import VllmConfig
from kvmesh.workers.adapters.kv_translate import KvEventTranslator, engine_hash
from kvmesh.workers.adapters.vllm_adapter import (
    OMP_THREADS_BIND,
    VllmEngine,
    omp_threads_bind,
    sampling_kwargs,
)
from kvmesh.workers.adapters.zmq_events import ZmqKvSubscriber
from kvmesh.workers.engine import DisaggSettings

pytestmark = pytest.mark.unit

PROMPT = [10 + (i * 37) % 800 for i in range(70)]


def request(
    rid: str = "r1", prompt: list[int] | None = None, max_tokens: int | None = 8, **sampling: Any
) -> EngineRequest:
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(
        rid, list(prompt or PROMPT), KvSampling(**sampling), StopParams(max_tokens=max_tokens)
    )


async def collect(eng: VllmEngine, req: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(req)]


async def eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def adapter() -> AsyncIterator[tuple[VllmEngine, vllm_fake.FakeAsyncLLM]]:
    async with running() as pair:
        yield pair


@contextlib.asynccontextmanager
async def running() -> AsyncIterator[tuple[VllmEngine, vllm_fake.FakeAsyncLLM]]:
    """A started VllmEngine over a FakeAsyncLLM, and the fake."""
    build = vllm_fake.factory()
    eng = VllmEngine(
        VllmConfig(), model_path="/models/m", served_model_name="m", engine_factory=build
    )
    await eng.start()
    fake: vllm_fake.FakeAsyncLLM = build.last  # type: ignore[attr-defined]
    try:
        yield eng, fake
    finally:
        await eng.stop()
        await fake.aclose()


# --- the fake mimics AsyncLLM's real API ---------------------------------------------------


@pytest.mark.parametrize("method", ["generate", "abort", "reset_prefix_cache", "shutdown"])
def test_fake_has_async_llm_signatures(method: str) -> None:
    real = inspect.signature(getattr(AsyncLLM, method))
    fake = inspect.signature(getattr(vllm_fake.FakeAsyncLLM, method))
    assert [(p.name, p.kind, p.default) for p in fake.parameters.values()] == [
        (p.name, p.kind, p.default) for p in real.parameters.values()
    ]
    assert inspect.isasyncgenfunction(getattr(AsyncLLM, method)) == inspect.isasyncgenfunction(
        getattr(vllm_fake.FakeAsyncLLM, method)
    )
    assert inspect.iscoroutinefunction(getattr(AsyncLLM, method)) == inspect.iscoroutinefunction(
        getattr(vllm_fake.FakeAsyncLLM, method)
    )


# --- sampling options -> vLLM SamplingParams ------------------------------------------------


def test_sampling_options_map_to_real_sampling_params() -> None:
    req = EngineRequest(
        "r",
        [1, 2, 3],
        KvSampling(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            seed=1234,
            top_logprobs=3,
            logit_bias={7: -100.0, 9: 2.5},
        ),
        StopParams(max_tokens=50, min_tokens=2, stop_token_ids=(5, 6), ignore_eos=True),
    )
    kwargs, structured = sampling_kwargs(req)
    p = vllm_runtime.build_sampling_params(kwargs, structured)
    assert isinstance(p, SamplingParams)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 40, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.seed, p.max_tokens, p.min_tokens, p.ignore_eos) == (1234, 50, 2, True)
    assert p.stop_token_ids == [5, 6] and p.logprobs == 3
    assert p.logit_bias == {7: -100.0, 9: 2.5}
    assert p.output_kind == RequestOutputKind.DELTA and p.detokenize is False
    assert p.n == 1 and p.structured_outputs is None


def test_defaults_mean_what_vllm_defaults_mean() -> None:
    kwargs, _ = sampling_kwargs(request(max_tokens=None, temperature=1.0))
    p = vllm_runtime.build_sampling_params(kwargs, None)
    default = SamplingParams(max_tokens=None)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        assert getattr(p, name) == getattr(default, name), name
    assert p.max_tokens is None  # vLLM: until the model length
    assert p.logprobs is None and p.logit_bias is None


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        (
            GuidedDecoding(GuidedKind.JSON_SCHEMA, '{"type": "object"}'),
            {"json": '{"type": "object"}'},
        ),
        (GuidedDecoding(GuidedKind.JSON_OBJECT), {"json_object": True}),
        (GuidedDecoding(GuidedKind.REGEX, "[a-z]+"), {"regex": "[a-z]+"}),
        (GuidedDecoding(GuidedKind.GRAMMAR, 'root ::= "x"'), {"grammar": 'root ::= "x"'}),
        (GuidedDecoding(GuidedKind.CHOICE, choices=("yes", "no")), {"choice": ["yes", "no"]}),
    ],
)
def test_guided_decoding_maps_to_structured_outputs(
    guided: GuidedDecoding, expected: dict[str, Any]
) -> None:
    kwargs, structured = sampling_kwargs(request(guided=guided))
    p = vllm_runtime.build_sampling_params(kwargs, structured)
    assert p.structured_outputs is not None
    for name, value in expected.items():
        assert getattr(p.structured_outputs, name) == value


async def test_options_vllm_refuses_are_invalid_requests(adapter: Any) -> None:
    eng, _ = adapter
    # kvmesh's own validation catches these first; vLLM's refusals map the same way.
    with pytest.raises(InvalidRequest, match="top_k"):
        eng._prepare(request(top_k=-5))
    with pytest.raises(InvalidRequest) as e:
        eng._prepare(request(max_tokens=0))
    assert e.value.param == "max_tokens"


# --- engine arguments -> vLLM AsyncEngineArgs -----------------------------------------------


def test_engine_args_pass_through_and_kvmesh_settings() -> None:
    cfg = VllmConfig(
        vllm_engine_args=json.dumps(
            {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "block_size": 32}
        )
    )
    eng = VllmEngine(cfg, model_path="/models/m", served_model_name="served")
    args = vllm_runtime.build_engine_args(eng.engine_kwargs())
    assert (args.model, args.served_model_name) == ("/models/m", "served")
    assert (args.tensor_parallel_size, args.gpu_memory_utilization, args.block_size) == (2, 0.8, 32)
    assert args.enable_prefix_caching is True and args.disable_log_stats is False
    events = args.kv_events_config
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    assert events.endpoint.startswith("ipc://") and events.replay_endpoint.startswith("ipc://")
    assert events.topic == "kvmesh"
    assert args.kv_transfer_config is None  # aggregated: no KV connector


def test_cpu_defaults_give_vllm_a_kv_cache_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    eng = VllmEngine(VllmConfig(vllm_cpu_kv_cache_gib=1.5), model_path="/m", served_model_name="m")
    args = vllm_runtime.build_engine_args(eng.engine_kwargs(cpu=True))
    assert args.kv_cache_memory_bytes == int(1.5 * 2**30)
    assert "kv_cache_memory_bytes" not in eng.engine_kwargs(cpu=False)  # GPUs: vLLM decides
    user = VllmEngine(
        VllmConfig(vllm_engine_args='{"kv_cache_memory_bytes": 12345}'),
        model_path="/m",
        served_model_name="m",
    )
    assert user.engine_kwargs(cpu=True)["kv_cache_memory_bytes"] == 12345
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # vLLM's own variable wins
    assert "kv_cache_memory_bytes" not in eng.engine_kwargs(cpu=True)
    with pytest.raises(ValueError, match="vllm_cpu_kv_cache_gib"):
        VllmConfig(vllm_cpu_kv_cache_gib=0)


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.33.1rc1.dev4+g00", True),
        ("0.31.2", False),
        ("0.34.0", False),
        ("1.0.0", False),
        ("main", False),
    ],
)
def test_supported_vllm_versions(version: str, ok: bool) -> None:
    if ok:
        assert vllm_runtime.check_version(version) == version
    else:
        with pytest.raises(RuntimeError, match=r"supports vLLM >=0\.32,<0\.34"):
            vllm_runtime.check_version(version)
    assert vllm_runtime.check_version()  # the installed one (0.33.0 here) is supported


def test_engine_args_from_file_and_unknown_names(tmp_path: Path) -> None:
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps({"max_model_len": 4096, "no_such_flag": 1}))
    eng = VllmEngine(
        VllmConfig(vllm_engine_args=f"@{path}"), model_path="/m", served_model_name="m"
    )
    with pytest.raises(ValueError, match="no_such_flag"):
        vllm_runtime.build_engine_args(eng.engine_kwargs())
    with pytest.raises(ValueError, match="--vllm-engine-args"):
        VllmConfig(vllm_engine_args="[1, 2]")


def test_kv_events_off_and_user_endpoint() -> None:
    off = VllmEngine(VllmConfig(vllm_kv_events=False), model_path="/m", served_model_name="m")
    assert vllm_runtime.build_engine_args(off.engine_kwargs()).kv_events_config is None
    user = VllmEngine(
        VllmConfig(vllm_engine_args=json.dumps({"enable_prefix_caching": False})),
        model_path="/m",
        served_model_name="m",
    )
    assert vllm_runtime.build_engine_args(user.engine_kwargs()).kv_events_config is None
    disabled = VllmEngine(
        VllmConfig(
            vllm_engine_args=json.dumps({"kv_events_config": {"enable_kv_cache_events": False}})
        ),
        model_path="/m",
        served_model_name="m",
    )
    disabled.engine_kwargs()
    assert disabled.kv_events_endpoint is None
    shared = VllmEngine(
        VllmConfig(vllm_kv_events_endpoint="tcp://*:5557"), model_path="/m", served_model_name="m"
    )
    args = vllm_runtime.build_engine_args(shared.engine_kwargs())
    assert args.kv_events_config.endpoint == "tcp://*:5557"
    assert shared.kv_events_endpoint == "tcp://*:5557"


def test_stopping_removes_the_private_event_socket_files(tmp_path: Path) -> None:
    """The private ipc sockets of the KV event publisher are unlinked when the engine stops
    (ZMQ leaves them behind when the engine never closes its publisher); a user's endpoint
    is not touched."""
    eng = VllmEngine(VllmConfig(), model_path="/m", served_model_name="m")
    eng.engine_kwargs()
    private = [
        e.removeprefix("ipc://")
        for e in (eng.kv_events_endpoint or "", eng.kv_events_replay_endpoint or "")
    ]
    user_path = tmp_path / "kvmesh-user-events"
    user = VllmEngine(
        VllmConfig(vllm_kv_events_endpoint=f"ipc://{user_path}"),
        model_path="/m",
        served_model_name="m",
    )
    user.engine_kwargs()
    for path in [*private, str(user_path)]:
        Path(path).touch()
    asyncio.run(eng._stop_engine())
    asyncio.run(user._stop_engine())
    assert not any(os.path.exists(p) for p in private)
    assert user_path.exists()


def test_nixl_workers_on_one_machine_get_their_own_side_channel_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvmesh.workers.adapters.vllm_adapter import NIXL_SIDE_CHANNEL_PORT, _nixl_side_channel_port

    monkeypatch.delenv(NIXL_SIDE_CHANNEL_PORT, raising=False)
    _nixl_side_channel_port({"kv_connector": "LMCacheConnectorV1"})
    assert NIXL_SIDE_CHANNEL_PORT not in os.environ
    _nixl_side_channel_port({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    port = int(os.environ[NIXL_SIDE_CHANNEL_PORT])
    assert 0 < port < 65536 and port != 5600
    # below the kernel's ephemeral range: no outgoing connection takes it before vLLM binds it
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ephemeral.exists():
        assert port < int(ephemeral.read_text().split()[0])
    monkeypatch.setenv(NIXL_SIDE_CHANNEL_PORT, "6000")  # a port the user chose stays
    _nixl_side_channel_port({"kv_connector": "NixlConnector"})
    assert os.environ[NIXL_SIDE_CHANNEL_PORT] == "6000"


def test_disaggregated_roles_get_a_kv_connector() -> None:
    eng = VllmEngine(VllmConfig(), model_path="/m", served_model_name="m")
    eng.configure_disaggregation(DisaggSettings(role=Role.DECODE))
    args = vllm_runtime.build_engine_args(eng.engine_kwargs())
    assert args.kv_transfer_config.kv_connector == "NixlConnector"
    assert args.kv_transfer_config.kv_role == "kv_both"
    # The worker's pin timeout is how long vLLM's prefill side keeps KV nobody read.
    assert args.kv_transfer_config.kv_connector_extra_config == {"kv_lease_duration": 30}
    eng.configure_disaggregation(DisaggSettings(role=Role.PREFILL, pin_timeout_s=299.5))
    args = vllm_runtime.build_engine_args(eng.engine_kwargs())
    assert args.kv_transfer_config.get_from_extra_config("kv_lease_duration", 0) == 300
    mine = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    eng = VllmEngine(
        VllmConfig(vllm_engine_args=json.dumps({"kv_transfer_config": mine})),
        model_path="/m",
        served_model_name="m",
    )
    eng.configure_disaggregation(DisaggSettings(role=Role.PREFILL))
    args = vllm_runtime.build_engine_args(eng.engine_kwargs())
    assert args.kv_transfer_config.kv_connector == "LMCacheConnectorV1"


# --- generation through the adapter ---------------------------------------------------------


async def test_generate_streams_deltas_with_usage_and_logprobs(adapter: Any) -> None:
    eng, fake = adapter
    outs = [o async for o in eng.generate(request(max_tokens=8, top_logprobs=2))]
    tokens = [t for o in outs for t in o.token_ids]
    assert len(outs) > 1 and len(tokens) == 8
    final = outs[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert final.usage is not None and (
        final.usage.prompt_tokens,
        final.usage.completion_tokens,
    ) == (
        70,
        8,
    )
    lps = [lp for o in outs for lp in o.logprobs or []]
    assert [lp.token_id for lp in lps] == tokens and all(len(lp.top) == 2 for lp in lps)
    prompt, params, kwargs = fake.requests["r1"]
    assert prompt == {"type": "token", "prompt_token_ids": PROMPT}  # rendered: no thread hop
    assert isinstance(params, SamplingParams) and params.max_tokens == 8 and params.logprobs == 2
    assert kwargs == {"lora_request": None, "priority": 0}


async def test_stop_token_finishes_with_stop(adapter: Any) -> None:
    eng, _ = adapter
    ref = [
        t for o in [o async for o in eng.generate(request("a", max_tokens=20))] for t in o.token_ids
    ]
    stop = ref[5]
    k = ref.index(stop)
    req = request("b", max_tokens=20)
    req.stop.stop_token_ids = (stop,)
    outs = [o async for o in eng.generate(req)]
    assert [t for o in outs for t in o.token_ids] == ref[: k + 1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_token_id == stop


async def test_cancel_aborts_in_vllm() -> None:
    build = vllm_fake.factory(speedup_ratio=10.0)  # slow enough to cancel mid-request
    eng = VllmEngine(VllmConfig(), model_path="/m", served_model_name="m", engine_factory=build)
    await eng.start()
    fake = build.last  # type: ignore[attr-defined]
    try:
        gen = eng.generate(request("c", max_tokens=None))
        first = await anext(gen)
        assert first.token_ids and eng.num_in_flight == 1
        await gen.aclose()
        assert eng.num_in_flight == 0 and eng.load().num_running == 0
        await eventually(lambda: "c" in fake.aborted)
        await eventually(lambda: fake.backend.load().kv_active_blocks == 0)
    finally:
        await eng.stop()
        await fake.aclose()


async def test_stop_ends_in_flight_requests_and_shuts_vllm_down(adapter: Any) -> None:
    eng, fake = adapter
    gen = eng.generate(request("d", max_tokens=None))
    await anext(gen)
    await eng.stop()
    rest = [o async for o in gen]
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert "d" in fake.aborted and fake.publisher is not None
    with pytest.raises(Unavailable):
        await anext(eng.generate(request("e")))


async def test_engine_errors_become_status_errors(adapter: Any) -> None:
    eng, fake = adapter

    async def dead(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise EngineDeadError("GPU fell off the bus")
        yield  # pragma: no cover

    async def bad(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise vllm_runtime.EngineGenerateError() from ValueError("prompt too long for vLLM")
        yield  # pragma: no cover

    fake.generate = dead
    with pytest.raises(Unavailable, match="died"):
        await anext(eng.generate(request("f")))
    fake.generate = bad
    with pytest.raises(InvalidRequest, match="too long"):
        await anext(eng.generate(request("g")))
    assert eng.num_in_flight == 0


async def test_lora_modules(tmp_path: Path) -> None:
    build = vllm_fake.factory()
    eng = VllmEngine(
        VllmConfig(vllm_lora_modules=("sql=/loras/sql",)),
        model_path="/m",
        served_model_name="m",
        engine_factory=build,
    )
    assert eng.engine_kwargs()["enable_lora"] is True
    await eng.start()
    try:
        assert "LORA" in eng.info.capabilities
        req = request("h")
        req.lora_name = "sql"
        _ = [o async for o in eng.generate(req)]
        lora = build.last.requests["h"][2]["lora_request"]  # type: ignore[attr-defined]
        assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("sql", 1, "/loras/sql")
        req = request("i")
        req.lora_name = "nope"
        with pytest.raises(NotFound):
            await anext(eng.generate(req))
    finally:
        await eng.stop()


async def test_lora_load_and_unload_at_runtime(tmp_path: Path) -> None:
    """LoadLoraAdapter / UnloadLoraAdapter: AsyncLLM.add_lora / remove_lora with kvmesh's ids;
    requests name runtime adapters as they name configured ones."""
    build = vllm_fake.factory()
    (tmp_path / "sql").mkdir()
    eng = VllmEngine(
        VllmConfig(vllm_engine_args='{"enable_lora": true}'),
        model_path="/m",
        served_model_name="m",
        engine_factory=build,
    )
    await eng.start()
    try:
        fake = build.last
        assert "LORA" in eng.info.capabilities and eng.info.lora_adapters == ()
        info = await eng.load_lora("sql", str(tmp_path / "sql"))
        assert info.lora_adapters == ("sql",)
        (lora,) = fake.loras.values()  # type: ignore[attr-defined]
        assert (lora.lora_name, lora.lora_path) == ("sql", str(tmp_path / "sql"))
        req = request("a")
        req.lora_name = "sql"
        _ = [o async for o in eng.generate(req)]
        used = fake.requests["a"][2]["lora_request"]  # type: ignore[attr-defined]
        assert (used.lora_name, used.lora_int_id) == ("sql", lora.lora_int_id)
        with pytest.raises(InvalidRequest, match="already loaded"):
            await eng.load_lora("sql", str(tmp_path / "sql"))
        with pytest.raises(InvalidRequest, match="served model's name"):
            await eng.load_lora("m", str(tmp_path / "sql"))
        with pytest.raises(InvalidRequest, match="No adapter found"):
            await eng.load_lora("gone", str(tmp_path / "gone"))
        assert eng.info.lora_adapters == ("sql",)
        assert (await eng.unload_lora("sql")).lora_adapters == ()
        assert fake.loras == {}  # type: ignore[attr-defined]
        with pytest.raises(NotFound):
            await eng.unload_lora("sql")
        req = request("b")
        req.lora_name = "sql"
        with pytest.raises(NotFound):
            await anext(eng.generate(req))
    finally:
        await eng.stop()


async def test_runtime_lora_and_embeddings_need_their_engine_args() -> None:
    """Without enable_lora / vLLM's pooling runner: refused, naming the engine argument."""
    eng = VllmEngine(
        VllmConfig(), model_path="/m", served_model_name="m", engine_factory=vllm_fake.factory()
    )
    await eng.start()
    try:
        assert not {"LORA", "EMBEDDINGS"} & set(eng.info.capabilities)
        with pytest.raises(Unimplemented, match="enable_lora"):
            await eng.load_lora("sql", "/loras/sql")
        with pytest.raises(Unimplemented, match="runner"):
            await eng.embed([[1, 2, 3]])
    finally:
        await eng.stop()


# --- load: vLLM's stat logger protocol -----------------------------------------------------


async def test_stats_from_vllm_scheduler_stats(adapter: Any) -> None:
    eng, fake = adapter
    logger = fake.stat_loggers[0]
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.25,
            prefix_cache_stats=PrefixCacheStats(requests=4, queries=100, hits=40),
        ),
        IterationStats(),
    )
    it = IterationStats()
    it.num_preempted_reqs = 2
    logger.record(None, it)
    assert eng.engine_load.num_running == 3 and eng.engine_load.num_waiting == 2
    assert eng.engine_load.kv_active_blocks == 64  # 25% of 256
    assert eng.engine_load.prefix_cache_hit_rate == pytest.approx(0.4)
    assert eng.load().preemptions_total == 2
    # Nothing in flight in the adapter: no active blocks whatever vLLM's last report said.
    assert eng.load().kv_active_blocks == 0 and eng.load().num_waiting == 0


async def test_worker_metrics_from_vllm_stats(adapter: Any) -> None:
    """vLLM's stat logger records -> the EngineStats behind the worker's /metrics: its request
    timeline and token counts (IterationStats, FinishedRequestStats), prefix cache, and the KV
    connector's numbers (connector prefix-cache stats; NixlConnector's per-transfer lists, as
    vLLM's scheduler hands over NixlKVConnectorStats.data)."""
    eng, fake = adapter
    logger = fake.stat_loggers[0]
    it = IterationStats()
    it.num_generation_tokens = 5
    it.time_to_first_tokens_iter = [0.02, 0.03]
    it.inter_token_latencies_iter = [0.001, 0.002, 0.003]
    it.finished_requests = [
        FinishedRequestStats(
            VllmFinishReason.LENGTH, "a", e2e_latency=0.5, num_prompt_tokens=163, queued_time=0.1
        ),
        FinishedRequestStats(VllmFinishReason.ABORT, "b", num_prompt_tokens=7),
        FinishedRequestStats(VllmFinishReason.ERROR, "c", num_prompt_tokens=9),
    ]
    nixl = {
        "transfer_duration": [0.004, 0.006],
        "post_duration": [0.001, 0.001],
        "bytes_transferred": [131_072, 65_536],
        "num_descriptors": [8, 4],
        "num_failed_transfers": [1],
        "num_failed_notifications": [],
    }
    for _ in range(2):  # counters accumulate over steps
        logger.record(
            SchedulerStats(
                prefix_cache_stats=PrefixCacheStats(requests=1, queries=163, hits=32),
                connector_prefix_cache_stats=PrefixCacheStats(requests=1, queries=163, hits=160),
                kv_connector_stats=nixl,
            ),
            it,
        )
    stats = eng.stats
    assert (stats.external_prefix_query_tokens, stats.external_prefix_hit_tokens) == (326, 320)
    assert stats.kv_transfer_bytes == 2 * 196_608 and stats.kv_transfer_failures == 2
    assert stats.kv_transfer.count == 4 and stats.kv_transfer.total == pytest.approx(0.02)
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (326, 64)
    assert stats.generation_tokens == 10 and stats.prompt_tokens == 2 * (163 + 7 + 9)
    assert stats.finished == {FinishReason.LENGTH: 2, FinishReason.CANCELLED: 2}
    assert stats.ttft.count == 4 and stats.itl.count == 6 and stats.e2e.count == 6
    assert stats.queue.total == pytest.approx(0.2)


# --- KV events: vLLM's ZmqEventPublisher -> KvEventLog ------------------------------------


def _stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    fields.update(kw)
    return BlockStored(**fields)


@pytest.fixture
async def published(tmp_path: Path) -> AsyncIterator[tuple[VllmEngine, ZmqEventPublisher]]:
    async with publishing(tmp_path) as pair:
        yield pair


@contextlib.asynccontextmanager
async def publishing(tmp_path: Path) -> AsyncIterator[tuple[VllmEngine, ZmqEventPublisher]]:
    """A VllmEngine fed by a real ZmqEventPublisher on its KV event endpoints."""
    build = vllm_fake.factory()
    eng = VllmEngine(
        VllmConfig(vllm_engine_args=json.dumps({"block_size": 4})),
        model_path="/m",
        served_model_name="m",
        engine_factory=lambda args, loggers: _NoEvents(build(args, loggers)),
    )
    await eng.start()
    args_events = build.last.engine_args.kv_events_config  # type: ignore[attr-defined]
    pub = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=args_events.endpoint,
        replay_endpoint=args_events.replay_endpoint,
        topic=args_events.topic,
    )
    try:
        yield eng, pub
    finally:
        pub.shutdown()
        await eng.stop()


class _NoEvents:
    """A FakeAsyncLLM whose own publisher is off (the test publishes instead)."""

    def __init__(self, fake: vllm_fake.FakeAsyncLLM) -> None:
        if fake._forward is not None:
            fake._forward.cancel()
        if fake.publisher is not None:
            fake.publisher.shutdown()
            fake.publisher = None
        self.fake = fake
        self.vllm_config = fake.vllm_config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)


async def test_vllm_events_reach_the_kv_event_log(published: Any) -> None:
    eng, pub = published
    log: KvEventLog = eng.kv_events
    a, b, c = b"\xaa" * 32, b"\xbb" * 32, 0xC0FFEE  # sha256 bytes and an int hash
    pub.publish(KVEventBatch(ts=time.time(), events=[_stored([a, b], None, list(range(8)))]))
    pub.publish(KVEventBatch(ts=time.time(), events=[_stored([c], b, [8, 9, 10, 11], group_idx=0)]))
    ha, hb = engine_hash(a), engine_hash(b)
    assert hb == int.from_bytes(b"\xbb" * 8, "big")  # vLLM's own int form: the low 64 bits
    await eventually(lambda: len(log.cached()) == 3)
    assert log.cached() == {
        ha: (None, (0, 1, 2, 3), ""),
        hb: (ha, (4, 5, 6, 7), ""),
        c: (hb, (8, 9, 10, 11), ""),
    }
    pub.publish(
        KVEventBatch(
            ts=time.time(),
            events=[
                _stored([b"\x01" * 32], c, [1, 1, 1, 1], medium="CPU"),  # the host tier
                _stored([b"\x03" * 32], c, [3, 3, 3, 3], medium="STORAGE"),  # the disk tier
                _stored([b"\x04" * 32], c, [4, 4, 4, 4], medium="TAPE"),  # unknown: ignored
                _stored([b"\x02" * 32], c, [2, 2, 2, 2], group_idx=1),  # other group: ignored
                BlockRemoved(block_hashes=[c], medium="GPU"),
                BlockRemoved(block_hashes=[a], medium="CPU"),  # no CPU copy: GPU one stays
            ],
        )
    )
    await eventually(lambda: c not in log.cached())
    assert set(log.cached()) == {ha, hb}
    assert log.cached(KvTier.HOST) == {engine_hash(b"\x01" * 32): (c, (1, 1, 1, 1), "")}
    assert log.cached(KvTier.DISK) == {engine_hash(b"\x03" * 32): (c, (3, 3, 3, 3), "")}
    pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    await eventually(lambda: not log.cached())


async def test_blocks_the_router_cannot_reproduce_are_withheld(published: Any) -> None:
    eng, pub = published
    log: KvEventLog = eng.kv_events
    h = [bytes([i]) * 32 for i in range(1, 7)]
    events = [
        # LoRA: the name is the only extra key; the router hashes it too.
        _stored([h[0]], None, [1, 2, 3, 4], lora_id=1, lora_name="sql", extra_keys=[("sql",)]),
        # An image in the second block: it and everything after it are withheld.
        _stored(
            [h[1], h[2], h[3]],
            None,
            list(range(12)),
            extra_keys=[None, (("img-hash", 0),), None],
        ),
        # Chained after a withheld block (a later event): withheld too.
        _stored([h[4]], h[3], [5, 5, 5, 5]),
        # A cache salt on a block of its own.
        _stored([h[5]], None, [7, 7, 7, 7], extra_keys=[("salt-123",)]),
    ]
    pub.publish(KVEventBatch(ts=time.time(), events=events))
    await eventually(lambda: eng.subscriber.batches_total == 1)
    assert log.cached() == {
        engine_hash(h[0]): (None, (1, 2, 3, 4), "sql"),
        engine_hash(h[1]): (None, (0, 1, 2, 3), ""),
    }
    assert eng._translator is not None and eng._translator.withheld_total == 4
    # Removing a withheld block publishes nothing.
    before = log.last_event_id
    pub.publish(
        KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[h[2]], medium=None)])
    )
    await eventually(lambda: eng.subscriber.batches_total == 2)
    assert log.last_event_id == before


async def test_reannounced_blocks_are_not_republished(published: Any) -> None:
    eng, pub = published
    log: KvEventLog = eng.kv_events
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    pub.publish(KVEventBatch(ts=time.time(), events=[_stored([a, b], None, list(range(8)))]))
    # vLLM re-announces reused prefix blocks with the request's new ones.
    pub.publish(KVEventBatch(ts=time.time(), events=[_stored([a, b, c], None, list(range(12)))]))
    await eventually(lambda: len(log.cached()) == 3)
    assert log.last_event_id == 2
    assert log.cached()[engine_hash(c)] == (engine_hash(b), (8, 9, 10, 11), "")


async def test_batches_published_before_connecting_are_replayed(tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic="t")
    got: list[KVEventBatch] = []
    gaps: list[str] = []
    try:
        for i in range(5):  # nobody listens yet: the PUB socket drops these
            pub.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
        await asyncio.sleep(0.3)
        sub = ZmqKvSubscriber(
            endpoint=endpoint,
            replay_endpoint=replay,
            topic="t",
            on_payload=lambda p: got.append(msgspec.msgpack.decode(p, type=KVEventBatch)),
            on_gap=gaps.append,
            idle_replay_s=0.2,
        )
        task = asyncio.create_task(sub.run())
        await sub.wait_connected()
        await eventually(lambda: len(got) == 5)  # the idle check replayed them
        pub.publish(KVEventBatch(ts=5.0, events=[AllBlocksCleared()]))
        await eventually(lambda: len(got) == 6)
        assert [b.ts for b in got] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert not gaps and sub.replayed_total == 5
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        pub.shutdown()


async def test_flowing_batches_send_no_idle_replay_requests(tmp_path: Path) -> None:
    """Once batches flow, the tail-gap check waits `idle_replay_s` of quiet: batches 100 ms
    apart never trigger one (a replay request stalls the engine's outputs; see the class)."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic="t")
    got: list[bytes] = []
    sub = ZmqKvSubscriber(
        endpoint=endpoint,
        replay_endpoint=replay,
        topic="t",
        on_payload=got.append,
        on_gap=lambda why: None,
        idle_replay_s=1.0,
    )
    try:
        task = asyncio.create_task(sub.run())
        await sub.wait_connected()
        # Until a batch comes through the subscription itself (a slow joiner's first ones are
        # dropped and replayed by the connect-time checks).
        while sub.batches_total == sub.replayed_total:
            pub.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
            await asyncio.sleep(0.05)
        before, n = sub.idle_checks_total, len(got)
        for i in range(1, 8):
            await asyncio.sleep(0.1)
            pub.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
        await eventually(lambda: len(got) == n + 7)
        assert sub.idle_checks_total == before
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        pub.shutdown()


async def test_lost_batches_resync_the_log(tmp_path: Path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=2, topic="t")
    eng = VllmEngine(VllmConfig(), model_path="/m", served_model_name="m")
    eng._events = KvEventLog()
    eng._translator = KvEventTranslator(eng._events, 4)
    sub = ZmqKvSubscriber(
        endpoint=endpoint,
        replay_endpoint=replay,
        topic="t",
        on_payload=eng.apply_kv_payload,
        on_gap=eng._on_kv_gap,
        idle_replay_s=0.2,
    )
    try:
        for i in range(4):  # before we listen; the publisher keeps only the last 2
            pub.publish(
                KVEventBatch(ts=0.0, events=[_stored([bytes([i + 1]) * 32], None, [i] * 4)])
            )
        await asyncio.sleep(0.3)
        task = asyncio.create_task(sub.run())
        await sub.wait_connected()
        await eventually(lambda: sub.next_seq == 4)
        assert sub.gaps_total == 1
        # The log was cleared at the gap, then got the two replayed stores.
        assert set(eng._events.cached()) == {
            engine_hash(bytes([3]) * 32),
            engine_hash(bytes([4]) * 32),
        }
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        pub.shutdown()


async def test_generated_requests_mirror_the_engine_cache(adapter: Any) -> None:
    eng, fake = adapter
    shared = [100 + (i * 13) % 700 for i in range(64)]
    reqs = [request(f"m{i}", shared + [900 + i] * (5 + i), max_tokens=20) for i in range(6)]
    await asyncio.gather(*(collect(eng, r) for r in reqs))
    await eventually(lambda: eng.kv_events.cached() == fake.backend.cached_blocks())
    assert len(eng.kv_events.cached()) >= 4
    assert await eng.clear_kv_cache() > 0
    await eventually(lambda: eng.kv_events.cached() == fake.backend.cached_blocks() == {})


# --- disaggregation hooks -------------------------------------------------------------------


async def test_prefill_remote_returns_vllm_kv_transfer_params(adapter: Any) -> None:
    eng, fake = adapter
    eng.configure_disaggregation(DisaggSettings(role=Role.PREFILL))
    result = await eng.prefill_remote(request("p", max_tokens=10, temperature=0.8))
    _, params, _ = fake.requests["p"]
    assert params.max_tokens == 1
    assert params.extra_args["kv_transfer_params"]["do_remote_decode"] is True
    engine_params = json.loads(result.remote.engine_params_json)
    assert engine_params["kv_transfer_params"]["remote_engine_id"] == "fake-engine"
    assert engine_params["seed"] == params.seed  # chosen here, reused by the decode side
    assert result.finish_reason is None and result.remote.handle is None
    assert result.usage.completion_tokens == 1


async def test_decode_continues_with_kv_transfer_params(adapter: Any) -> None:
    eng, fake = adapter
    eng.configure_disaggregation(DisaggSettings(role=Role.DECODE))
    full = [o async for o in eng.generate(request("full", max_tokens=6))]
    tokens = [t for o in full for t in o.token_ids]
    transfer = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [[1]]}
    req = request("dec", max_tokens=6)
    req.remote_prefill = RemotePrefill(
        first_token_id=tokens[0],
        engine_params_json=json.dumps({"kv_transfer_params": transfer, "seed": 77}),
    )
    outs: list[EngineOutput] = [o async for o in eng.generate(req)]
    _, params, _ = fake.requests["dec"]
    assert params.extra_args == {"kv_transfer_params": transfer} and params.seed == 77
    # vLLM's decode side samples the first token again; the adapter drops it.
    assert [t for o in outs for t in o.token_ids] == tokens[1:]
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 6
    bad = request("bad")
    bad.remote_prefill = RemotePrefill(first_token_id=1, engine_params_json="{nope")
    with pytest.raises(InvalidRequest):
        await anext(eng.generate(bad))


# --- images (MULTIMODAL) --------------------------------------------------------------------

IMG, PER_IMAGE = 900, 4
"""The image token and placeholders per image the tests' LLaVA-like model card carries."""


def _png(color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (5, 3), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
async def llava(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[VllmEngine, vllm_fake.FakeAsyncLLM]]:
    """The adapter over a fake engine whose model vLLM would serve images for (what
    vllm_runtime.image_placeholders reads from a real LLaVA config; the real-engine tier runs
    the real one: tests/vllm_real/test_vllm_llava.py)."""
    monkeypatch.setattr(vllm_runtime, "image_placeholders", lambda cfg: (IMG, PER_IMAGE))
    async with running() as pair:
        yield pair


def test_text_models_do_not_take_images() -> None:
    """image_placeholders of a model vLLM does not serve images for (the fake's text model)."""
    cfg = vllm_fake.factory()(vllm_runtime.build_engine_args({"model": "/m"}), []).vllm_config
    assert vllm_runtime.image_placeholders(cfg) is None


async def test_images_go_to_vllm_as_multi_modal_data_with_collapsed_placeholders(
    llava: Any,
) -> None:
    from kvmesh.runtime.multimodal import media_hash
    from kvmesh.workers.adapters.vllm_adapter import media_uuid

    eng, fake = llava
    info = eng.info
    assert "MULTIMODAL" in info.capabilities
    assert (info.image_token_id, info.tokens_per_image) == (IMG, PER_IMAGE)
    red, blue = MediaInput("image/png", _png((200, 0, 0))), MediaInput("image/png", _png((0, 0, 9)))
    prompt = [1, 2, *[IMG] * PER_IMAGE, 3, *[IMG] * PER_IMAGE, IMG, 4]  # a plain IMG after them
    req = dataclasses.replace(request("mm", prompt), media=(red, blue))
    # The fake engine does not expand placeholders as vLLM does: the adapter notices that the
    # prompt vLLM ran is not the gateway's.
    with pytest.raises(Unavailable, match="tokens_per_image"):
        await collect(eng, req)
    sent = fake.requests["mm"][0]
    assert sent["prompt_token_ids"] == [1, 2, IMG, 3, IMG, IMG, 4]
    images = sent["multi_modal_data"]["image"]
    assert [(im.mode, im.size) for im in images] == [("RGB", (5, 3))] * 2
    assert images[0].getpixel((0, 0)) == (200, 0, 0)
    assert sent["multi_modal_uuids"] == {"image": [media_uuid(media_hash(m)) for m in (red, blue)]}


async def test_images_without_their_placeholders_or_undecodable_are_refused(llava: Any) -> None:
    eng, _ = llava
    red = MediaInput("image/png", _png((200, 0, 0)))
    split = [1, *[IMG] * (PER_IMAGE - 1), 5, IMG, 2]
    cases = [
        ([1, IMG, 2], (red,), "image placeholder"),  # too few
        (split, (red,), "consecutive"),
        ([1, *[IMG] * PER_IMAGE], (MediaInput("image/png", b"not a png"),), "decodable"),
    ]
    for prompt, media, match in cases:
        req = dataclasses.replace(request("bad", prompt), media=media)
        with pytest.raises(InvalidRequest, match=match) as err:
            await collect(eng, req)
        assert err.value.param == "media"
    assert eng.num_in_flight == 0


async def test_image_blocks_are_published_with_salted_placeholders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM's extra keys of kvmesh's images ([uuid, offset in the block]) -> the salted ids the
    router hashes for the same request (kvmesh.runtime.multimodal); keys of images vLLM named
    itself stay withheld (test_blocks_the_router_cannot_reproduce_are_withheld)."""
    from kvmesh.runtime.multimodal import media_hash, salt_placeholders
    from kvmesh.workers.adapters.vllm_adapter import media_uuid

    monkeypatch.setattr(vllm_runtime, "image_placeholders", lambda cfg: (IMG, PER_IMAGE))
    async with publishing(tmp_path) as (eng, pub):
        red = MediaInput("image/png", _png((200, 0, 0)))
        uuid = media_uuid(media_hash(red))
        tokens = [1, 2, IMG, IMG, IMG, IMG, 7, 8, 9, 9, 9, 9]  # image at 2..5, blocks of 4
        hashes = [bytes([i]) * 32 for i in (1, 2, 3)]
        # Each block's image and where it starts relative to the block (-2: two tokens before).
        keys = [((uuid, 2),), ((uuid, -2),), None]
        pub.publish(
            KVEventBatch(ts=time.time(), events=[_stored(hashes, None, tokens, extra_keys=keys)])
        )
        log: KvEventLog = eng.kv_events
        await eventually(lambda: len(log.cached()) == 3)
        want = salt_placeholders(tokens, IMG, [red], PER_IMAGE)
        h = [engine_hash(x) for x in hashes]
        assert log.cached() == {
            h[0]: (None, tuple(want[0:4]), ""),
            h[1]: (h[0], tuple(want[4:8]), ""),
            h[2]: (h[1], tuple(want[8:12]), ""),
        }
        assert want[2:6] != tokens[2:6]


@pytest.mark.parametrize(
    ("environ", "kwargs", "cores", "expected"),
    [
        ({"KVMESH_CORE_SLOT": "1/2"}, {}, {0, 1}, "1"),  # one core each: the engine core too
        ({"KVMESH_CORE_SLOT": "0/2"}, {}, set(range(8)), "0,1,2"),  # the last for its engine core
        ({"KVMESH_CORE_SLOT": "0/2", OMP_THREADS_BIND: "auto"}, {}, {0, 1}, None),  # the user's
        ({"KVMESH_CORE_SLOT": "0/2"}, {"tensor_parallel_size": 2}, {0, 1, 2, 3}, None),
        ({"KVMESH_CORE_SLOT": "0/2"}, {"kv_transfer_config": {"kv_connector": "x"}}, {0, 1}, None),
        ({}, {}, {0, 1}, None),  # not started by kvmesh up in a slot: vLLM's own binding
    ],
)
def test_vllm_threads_take_the_workers_core_slot(
    environ: dict[str, str],
    kwargs: dict[str, Any],
    cores: set[int],
    expected: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    assert omp_threads_bind(environ, kwargs) == expected
