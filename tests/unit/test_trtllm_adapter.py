"""The TensorRT-LLM adapter against TensorRT-LLM's formats (from its source; the engine needs a
GPU): the LLM API's generate_async / RequestOutput / SamplingParams / DisaggregatedParams, the
KV cache event dicts of get_kv_cache_events_async and the iteration stats of get_stats_async
(tests/adapter_fakes/trtllm_fake.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvmesh.runtime.errors import InvalidRequest, NotFound, Unavailable
from kvmesh.runtime.kv_events import KvEventLog, KvTier
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    RemotePrefill,
    Role,
    StopParams,
)
from kvmesh.runtime.types import SamplingParams as KvSampling
from kvmesh.workers.adapters.config import TrtllmConfig
from kvmesh.workers.adapters.kv_translate import KvEventTranslator
from kvmesh.workers.adapters.trtllm_adapter import TrtllmEngine, sampling_kwargs
from kvmesh.workers.engine import DisaggSettings
from tests.adapter_fakes import trtllm_fake
from tests.adapter_fakes.backend import Stream

pytestmark = pytest.mark.unit

PROMPT = [10 + (i * 37) % 800 for i in range(70)]


def request(
    rid: str = "r1", prompt: list[int] | None = None, max_tokens: int | None = 8, **sampling: Any
) -> EngineRequest:
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(
        rid, list(prompt or PROMPT), KvSampling(**sampling), StopParams(max_tokens=max_tokens)
    )


async def collect(eng: TrtllmEngine, req: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(req)]


async def eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def make_engine(config: TrtllmConfig | None = None, **llm: Any) -> tuple[TrtllmEngine, Any]:
    runtime = trtllm_fake.FakeRuntime(**llm)
    eng = TrtllmEngine(
        config or TrtllmConfig(), model_path="/models/m", served_model_name="m", runtime=runtime
    )
    return eng, runtime


@pytest.fixture
async def adapter() -> AsyncIterator[tuple[TrtllmEngine, trtllm_fake.FakeLLM]]:
    eng, runtime = make_engine()
    await eng.start()
    assert runtime.last is not None
    try:
        yield eng, runtime.last
    finally:
        await eng.stop()
        await runtime.last.aclose()


# --- sampling options -> tensorrt_llm.SamplingParams --------------------------------------


def test_sampling_options_map_to_trtllm_fields() -> None:
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
        ),
        StopParams(max_tokens=50, min_tokens=2, stop_token_ids=(5, 6), ignore_eos=True),
    )
    kw, guided = sampling_kwargs(req, 1024)
    p = trtllm_fake.TrtSamplingParams(**kw)  # the real field names, keyword-only
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 40, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.seed, p.max_tokens, p.min_tokens, p.ignore_eos) == (1234, 50, 2, True)
    assert p.stop_token_ids == [5, 6] and p.logprobs == 3
    assert p.include_stop_str_in_output is True and p.detokenize is False
    assert guided is None


def test_greedy_and_defaults() -> None:
    kw, _ = sampling_kwargs(request(max_tokens=None), 1024)
    assert kw == {
        "max_tokens": 1024 - 70,  # TensorRT-LLM's own default would be 32
        "include_stop_str_in_output": True,
        "detokenize": False,
        "top_k": 1,  # greedy
    }
    kw, _ = sampling_kwargs(request(temperature=1.0, top_logprobs=0), 1024)
    assert kw["temperature"] == 1.0 and "top_k" not in kw and kw["logprobs"] == 1


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        (GuidedDecoding(GuidedKind.JSON_SCHEMA, "{}"), {"json": "{}"}),
        (GuidedDecoding(GuidedKind.JSON_OBJECT), {"json_object": True}),
        (GuidedDecoding(GuidedKind.REGEX, "a+"), {"regex": "a+"}),
        (GuidedDecoding(GuidedKind.GRAMMAR, 'root ::= "x"'), {"grammar": 'root ::= "x"'}),
        (GuidedDecoding(GuidedKind.CHOICE, choices=("a", "b.")), {"regex": r"(a|b\.)"}),
    ],
)
def test_guided_decoding(guided: GuidedDecoding, expected: dict[str, Any]) -> None:
    _, g = sampling_kwargs(request(guided=guided), 1024)
    assert g == expected
    trtllm_fake.GuidedDecodingParams(**g)


def test_logit_bias_is_refused() -> None:
    with pytest.raises(InvalidRequest) as e:
        sampling_kwargs(request(logit_bias={3: 1.0}), 1024)
    assert e.value.param == "logit_bias"


# --- engine arguments ---------------------------------------------------------------------


def test_engine_kwargs() -> None:
    cfg = TrtllmConfig(
        trtllm_engine_args=json.dumps(
            {"tensor_parallel_size": 2, "kv_cache_config": {"free_gpu_memory_fraction": 0.8}}
        ),
        trtllm_kv_event_buffer=1000,
    )
    eng = TrtllmEngine(cfg, model_path="/models/m", served_model_name="m")
    kw = eng.engine_kwargs()
    assert kw["model"] == "/models/m" and kw["tensor_parallel_size"] == 2
    assert kw["enable_iter_perf_stats"] is True
    assert kw["kv_cache_config"] == {
        "free_gpu_memory_fraction": 0.8,
        "enable_block_reuse": True,
        "event_buffer_max_size": 1000,
    }
    assert eng.kv_events_enabled and "cache_transceiver_config" not in kw
    eng.configure_disaggregation(DisaggSettings(role=Role.PREFILL))
    assert eng.engine_kwargs()["cache_transceiver_config"] == {"backend": "DEFAULT"}
    for off in (
        TrtllmConfig(trtllm_kv_events=False),
        TrtllmConfig(
            trtllm_engine_args=json.dumps({"kv_cache_config": {"enable_block_reuse": False}})
        ),
    ):
        assert not TrtllmEngine(off, model_path="/m", served_model_name="m").kv_events_enabled


# --- generation -------------------------------------------------------------------------


async def test_generate_streams_deltas(adapter: Any) -> None:
    eng, fake = adapter
    assert eng.info.kv_block_size == 32 and eng.info.kv_total_blocks == 256
    assert "KV_EVENTS" in eng.info.capabilities
    outs = await collect(eng, request(max_tokens=8, top_logprobs=2))
    tokens = [t for o in outs for t in o.token_ids]
    assert len(outs) > 1 and len(tokens) == 8
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].usage is not None and outs[-1].usage.prompt_tokens == 70
    lps = [lp for o in outs for lp in o.logprobs or []]
    assert [lp.token_id for lp in lps] == tokens and all(len(lp.top) == 2 for lp in lps)
    assert fake.calls[1]["sampling_params"].max_tokens == 8


async def test_stop_token_is_kept(adapter: Any) -> None:
    eng, _ = adapter
    ref = [t for o in await collect(eng, request("a", max_tokens=20)) for t in o.token_ids]
    stop = ref[3]
    k = ref.index(stop)
    req = request("b", max_tokens=20)
    req.stop.stop_token_ids = (stop,)
    outs = await collect(eng, req)
    assert [t for o in outs for t in o.token_ids] == ref[: k + 1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_token_id == stop


async def test_cancel_calls_abort() -> None:
    eng, runtime = make_engine(fake_speedup_ratio=10.0)  # slow enough to cancel mid-request
    await eng.start()
    fake = runtime.last
    try:
        gen = eng.generate(request("c", max_tokens=None))
        await anext(gen)
        await gen.aclose()
        assert eng.num_in_flight == 0
        await eventually(lambda: fake.aborted == [1])
        await eventually(lambda: fake.backend.load().kv_active_blocks == 0)
    finally:
        await eng.stop()
        await fake.aclose()


async def test_engine_errors(adapter: Any) -> None:
    eng, fake = adapter

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("prompt is too long for this engine")

    fake.generate_async = refuse
    with pytest.raises(InvalidRequest, match="too long"):
        await anext(eng.generate(request("e")))


async def test_lora_modules() -> None:
    eng, runtime = make_engine(TrtllmConfig(trtllm_lora_modules=("sql=/loras/sql",)))
    await eng.start()
    try:
        assert "LORA" in eng.info.capabilities
        req = request("l")
        req.lora_name = "sql"
        await collect(eng, req)
        lora = runtime.last.calls[1]["lora_request"]
        assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("sql", 1, "/loras/sql")
        req = request("n")
        req.lora_name = "nope"
        with pytest.raises(NotFound):
            await anext(eng.generate(req))
    finally:
        await eng.stop()


# --- load ---------------------------------------------------------------------------------


def test_iteration_stats() -> None:
    eng = TrtllmEngine(TrtllmConfig(), model_path="/m", served_model_name="m")
    eng.apply_stats(
        json.dumps(  # older versions hand out JSON text
            {
                "numActiveRequests": 3,
                "numQueuedRequests": 1,
                "kvCacheStats": {"maxNumBlocks": 500, "usedNumBlocks": 42, "cacheHitRate": 0.25},
                "inflightBatchingStats": {"numPausedRequests": 2},
            }
        )
    )
    load = eng.engine_load
    assert (load.num_running, load.num_waiting, load.kv_active_blocks) == (3, 3, 42)
    assert load.prefix_cache_hit_rate == 0.25 and eng.info.kv_total_blocks == 500


# --- KV events ------------------------------------------------------------------------------


def _block(h: int, tokens: list[int], level: int = 0, extra: int = 0) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [
            {"type": "unique_token", "token_id": t, "token_extra_id": extra} for t in tokens
        ],
        "cache_level": level,
        "priority": 35,
    }


class Events:
    """A TrtllmEngine fed event dicts directly (tokens_per_block 4)."""

    def __init__(self) -> None:
        self.eng = TrtllmEngine(TrtllmConfig(), model_path="/m", served_model_name="m")
        self.eng._events = self.log = KvEventLog()
        self.eng._translator = KvEventTranslator(self.log, 4)
        self.next_id = 0

    def send(self, data: dict[str, Any], **extra: Any) -> None:
        self.eng.apply_kv_event(
            {"event_id": self.next_id, "data": data, "window_size": 4096, **extra}
        )
        self.next_id += 1


def test_trtllm_event_dicts() -> None:
    ev = Events()
    ev.send({"type": "created", "num_blocks_per_cache_level": [1000, 4000]})
    ev.send({"type": "created", "num_blocks_per_cache_level": [900, 0]}, window_size=128)
    assert ev.eng.info.kv_total_blocks == 1000  # the largest window's primary level
    ev.send(
        {
            "type": "stored",
            "parent_hash": None,
            "blocks": [_block(1, [1, 2, 3, 4]), _block(2, [5, 6, 7, 8])],
        }
    )
    ev.send({"type": "stored", "parent_hash": 2, "blocks": [_block(3, [9, 9, 9, 9])]})
    assert ev.log.cached() == {
        1: (None, (1, 2, 3, 4), ""),
        2: (1, (5, 6, 7, 8), ""),
        3: (2, (9, 9, 9, 9), ""),
    }
    ev.send(
        {"type": "stored", "parent_hash": None, "blocks": [_block(9, [1, 1, 1, 1])]},
        window_size=128,
    )
    # Another attention-DP rank's events (with its own ids) are neither applied nor a gap.
    for i, data in enumerate(
        [
            {"type": "stored", "parent_hash": None, "blocks": [_block(8, [2, 2, 2, 2])]},
            {"type": "removed", "block_hashes": [1, 2]},
        ]
    ):
        ev.eng.apply_kv_event(
            {"event_id": 9000 + i, "attention_dp_rank": 1, "window_size": 4096, "data": data}
        )
    ev.send({"type": "removed", "block_hashes": [3]})
    ev.send(
        {
            "type": "updated",
            "block_hash": 1,
            "cache_level": None,
            "priority": {"type": "event_diff", "new_value": 50, "old_value": 35},
        }
    )
    assert set(ev.log.cached()) == {1, 2}  # fmt: skip
    # Offloaded to host memory and back.
    ev.send(
        {
            "type": "updated",
            "block_hash": 2,
            "priority": None,
            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
        }
    )
    assert set(ev.log.cached()) == {1}
    assert ev.log.cached(KvTier.HOST) == {2: (1, (5, 6, 7, 8), "")}
    ev.send(
        {
            "type": "updated",
            "block_hash": 2,
            "priority": None,
            "cache_level": {"type": "event_diff", "new_value": 0, "old_value": 1},
        }
    )
    assert ev.log.cached()[2] == (1, (5, 6, 7, 8), "")  # fmt: skip
    assert ev.log.cached(KvTier.HOST) == {}


def test_host_level_and_opaque_blocks() -> None:
    ev = Events()
    ev.send(
        {
            "type": "stored",
            "parent_hash": None,
            "blocks": [
                _block(1, [1, 2, 3, 4]),
                _block(2, [5, 6, 7, 8], level=1),
                _block(3, [9] * 4),
            ],
        }
    )
    assert set(ev.log.cached()) == {1, 3} and ev.log.cached()[3][0] == 2
    assert ev.log.cached(KvTier.HOST) == {2: (1, (5, 6, 7, 8), "")}
    ev.send({"type": "updated", "block_hash": 2, "priority": None,
             "cache_level": {"type": "event_diff", "new_value": 0, "old_value": 1}})  # fmt: skip
    assert ev.log.cached()[2] == (1, (5, 6, 7, 8), "")
    ev.send({"type": "stored", "parent_hash": None, "blocks": [_block(4, [1, 2, 3, 4], extra=7)]})
    ev.send({"type": "stored", "parent_hash": 4, "blocks": [_block(5, [1, 2, 3, 4])]})
    ev.send({"type": "stored", "parent_hash": None, "blocks": [_block(6, [1, 2])]})  # partial
    assert set(ev.log.cached()) == {1, 2, 3}


def test_lost_events_resync() -> None:
    ev = Events()
    ev.send({"type": "stored", "parent_hash": None, "blocks": [_block(1, [1, 2, 3, 4])]})
    # The engine's event buffer overflowed: ids 1..5 never arrive. (Events may come as JSON.)
    late = {"type": "stored", "parent_hash": None, "blocks": [_block(2, [4, 3, 2, 1])]}
    ev.eng.apply_kv_event(json.dumps({"event_id": 6, "data": late, "window_size": 4096}))
    assert set(ev.log.cached()) == {2}


async def test_generated_requests_mirror_the_engine_cache(adapter: Any) -> None:
    eng, fake = adapter
    shared = [100 + (i * 13) % 700 for i in range(96)]
    reqs = [request(f"m{i}", shared + [900 + i] * (5 + i), max_tokens=40) for i in range(6)]
    await asyncio.gather(*(collect(eng, r) for r in reqs))
    await eventually(lambda: eng.kv_events.cached() == fake.backend.cached_blocks())
    assert len(eng.kv_events.cached()) >= 3
    await eventually(lambda: eng.engine_load.kv_active_blocks == 0)


async def test_pending_prefill_leaves_out_the_prefix_the_engine_holds(adapter: Any) -> None:
    """The router books a request's prefill as its prompt less the prefix the worker holds; the
    adapters report the engine's pending prefill the same way (from its KV events), so the
    router's correction by that measurement does not read cache hits as queued work."""
    eng, _ = adapter
    shared = [100 + (i * 13) % 700 for i in range(96)]  # three 32-token blocks
    await collect(eng, request("first", [*shared, 900], max_tokens=4))
    await eventually(lambda: len(eng.kv_events.cached()) >= 3)
    assert eng.load().pending_prefill_tokens == 0
    hit = eng.submit(request("hit", shared + [901] * 10, max_tokens=4), Stream())
    assert eng.load().pending_prefill_tokens == 10
    miss = eng.submit(request("miss", [7] * 50, max_tokens=4), Stream())
    assert eng.load().pending_prefill_tokens == 10 + 50
    hit.cancel()
    miss.cancel()
    assert eng.load().pending_prefill_tokens == 0


# --- disaggregation -----------------------------------------------------------------------


async def test_context_only_then_generation_only(adapter: Any) -> None:
    eng, fake = adapter
    eng.configure_disaggregation(DisaggSettings(role=Role.DECODE))
    full = [t for o in await collect(eng, request("full", max_tokens=6)) for t in o.token_ids]
    result = await eng.prefill_remote(request("p", max_tokens=6))
    ctx_call = fake.calls[2]
    assert ctx_call["disaggregated_params"].request_type == "context_only"
    assert ctx_call["sampling_params"].max_tokens == 1
    assert result.remote.first_token_id == full[0] and result.finish_reason is None
    params = json.loads(result.remote.engine_params_json)["disaggregated_params"]
    assert params["request_type"] == "context_only" and params["first_gen_tokens"] == full[:1]
    assert base64.b64decode(params["opaque_state"]["base64"]) == b"\x00opaque\xff"
    req = request("dec", max_tokens=6)
    req.remote_prefill = RemotePrefill(
        first_token_id=result.remote.first_token_id,
        engine_params_json=result.remote.engine_params_json,
    )
    outs = await collect(eng, req)
    gen = fake.calls[3]["disaggregated_params"]
    assert gen.request_type == "generation_only" and gen.ctx_request_id == 2
    assert gen.opaque_state == b"\x00opaque\xff" and gen.first_gen_tokens == full[:1]
    assert [t for o in outs for t in o.token_ids] == full[1:]
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 6
    bad = request("bad")
    bad.remote_prefill = RemotePrefill(first_token_id=1, engine_params_json="{}")
    with pytest.raises(InvalidRequest, match="ctx_request_id"):
        await anext(eng.generate(bad))


async def test_prefill_that_ends_the_request(adapter: Any) -> None:
    eng, _ = adapter
    eng.configure_disaggregation(DisaggSettings(role=Role.PREFILL))
    result = await eng.prefill_remote(request("one", max_tokens=1))
    assert result.finish_reason is FinishReason.LENGTH
    await eng.stop()
    with pytest.raises(Unavailable):
        await eng.prefill_remote(request("late"))


# --- `kvmesh worker --engine vllm|sglang|trtllm` ------------------------------------------


def test_worker_flags_build_the_adapters_without_importing_engines(tiny_model: Any) -> None:
    """The worker's factories build each adapter from its flags; no engine is imported until
    the adapter starts (run in a fresh interpreter, where nothing imported vLLM before)."""
    import subprocess
    import sys

    code = f"""
import json, sys
from kvmesh.apps.cli import build_parser
from kvmesh.runtime.config import from_args
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.main import build_engine
argv = [
    "worker", "--model", {str(tiny_model)!r},
    "--vllm-engine-args", json.dumps({{"tensor_parallel_size": 2}}),
    "--sglang-engine-args", json.dumps({{"tp_size": 2}}), "--no-sglang-kv-events",
    "--trtllm-engine-args", json.dumps({{"max_batch_size": 8}}), "--trtllm-kv-event-buffer", "99",
]
out = {{}}
for engine in ("vllm", "sglang", "trtllm"):
    ns = build_parser().parse_args(argv + ["--engine", engine])
    eng = build_engine(from_args(WorkerConfig, ns), ns)
    out[engine] = [type(eng).__name__, eng.info.served_model_name, eng.engine_kwargs()]
assert not {{"vllm", "sglang", "tensorrt_llm"}} & set(sys.modules), "an engine was imported"
print(json.dumps(out))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["vllm"][0] == "VllmEngine" and out["vllm"][2]["tensor_parallel_size"] == 2
    assert out["vllm"][2]["model"] == str(tiny_model) and out["vllm"][1] == tiny_model.name
    assert out["sglang"][0] == "SglangEngine" and out["sglang"][2]["tp_size"] == 2
    assert "kv_events_config" not in out["sglang"][2]
    assert out["trtllm"][0] == "TrtllmEngine" and out["trtllm"][2]["max_batch_size"] == 8
    assert out["trtllm"][2]["kv_cache_config"]["event_buffer_max_size"] == 99
