"""The SGLang adapter against SGLang's formats (from its source; SGLang itself needs a GPU).

The engine is tests/adapter_fakes/sglang_fake.py: sglang.Engine's async_generate signature and
output dicts in both streaming modes, SGLang's sampling-params rules, abort_request / get_loads
/ flush_cache (get_load of older versions: a manager of the test's own), and SGLang's KV event
protocol (ZMQ PUB + replay ROUTER, msgpack arrays).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from kvmesh.runtime.errors import InvalidRequest, Unavailable, Unimplemented
from kvmesh.runtime.kv_events import KvEventLog
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
from kvmesh.workers.adapters.config import SglangConfig
from kvmesh.workers.adapters.sglang_adapter import SglangDecoder, SglangEngine, sampling_dict
from kvmesh.workers.engine import DisaggSettings
from tests.adapter_fakes import sglang_fake

pytestmark = pytest.mark.unit

PROMPT = [10 + (i * 37) % 800 for i in range(70)]


def request(
    rid: str = "r1", prompt: list[int] | None = None, max_tokens: int | None = 8, **sampling: Any
) -> EngineRequest:
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(
        rid, list(prompt or PROMPT), KvSampling(**sampling), StopParams(max_tokens=max_tokens)
    )


async def collect(eng: SglangEngine, req: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(req)]


async def eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def make_engine(**overrides: Any) -> tuple[SglangEngine, Any]:
    build = sglang_fake.factory(**overrides)
    eng = SglangEngine(
        SglangConfig(sglang_load_interval_s=0.05),
        model_path="/models/m",
        served_model_name="m",
        engine_factory=build,
    )
    return eng, build


@pytest.fixture(params=[False, True], ids=["cumulative", "incremental"])
async def adapter(request: pytest.FixtureRequest) -> AsyncIterator[tuple[SglangEngine, Any]]:
    """The adapter over the fake, in both of SGLang's streaming modes."""
    eng, build = make_engine(incremental_streaming_output=request.param)
    await eng.start()
    fake = build.last
    try:
        yield eng, fake
    finally:
        await eng.stop()
        await fake.aclose()


# --- sampling options -> SGLang's sampling_params dict ------------------------------------


def test_sampling_dict_uses_sglang_names_and_rules() -> None:
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
            logit_bias={7: -100.0},
        ),
        StopParams(max_tokens=50, min_tokens=2, stop_token_ids=(5, 6), ignore_eos=True),
    )
    d = sampling_dict(req, 1024)
    assert d == {
        "max_new_tokens": 50,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_new_tokens": 2,
        "stop_token_ids": [5, 6],
        "ignore_eos": True,
        "logit_bias": {"7": -100.0},
        "sampling_seed": 1234,
    }
    sglang_fake.check_sampling(d)  # SGLang's SamplingParams(**d).verify() accepts it


def test_defaults_are_left_to_sglang() -> None:
    d = sampling_dict(request(max_tokens=None, temperature=1.0), 1024)
    assert d == {"max_new_tokens": 1024 - 70}  # SGLang's own default would be 128


@pytest.mark.parametrize(
    ("guided", "key", "value"),
    [
        (
            GuidedDecoding(GuidedKind.JSON_SCHEMA, '{"type": "array"}'),
            "json_schema",
            '{"type": "array"}',
        ),
        (GuidedDecoding(GuidedKind.JSON_OBJECT), "json_schema", '{"type": "object"}'),
        (GuidedDecoding(GuidedKind.REGEX, "[a-z]+"), "regex", "[a-z]+"),
        (GuidedDecoding(GuidedKind.GRAMMAR, 'root ::= "x"'), "ebnf", 'root ::= "x"'),
    ],
)
def test_guided_decoding(guided: GuidedDecoding, key: str, value: str) -> None:
    d = sampling_dict(request(guided=guided), 1024)
    assert d[key] == value
    sglang_fake.check_sampling(d)


def test_choice_becomes_an_exact_regex() -> None:
    choices = ("yes", "no", "a.b (c)")
    d = sampling_dict(request(guided=GuidedDecoding(GuidedKind.CHOICE, choices=choices)), 1024)
    pattern = re.compile(d["regex"])
    assert all(pattern.fullmatch(c) for c in choices)
    assert not pattern.fullmatch("aXb (c)") and not pattern.fullmatch("yesno")


@pytest.mark.parametrize(("backend", "guided"), [("llguidance", True), ("none", False)])
async def test_guided_decoding_follows_the_grammar_backend(backend: str, guided: bool) -> None:
    """SGLang's own option (`grammar_backend`, via --sglang-engine-args) decides whether the
    card advertises GUIDED_DECODING; "none" turns it off, so guided requests are refused."""
    eng, build = make_engine(grammar_backend=backend)
    await eng.start()
    try:
        assert ("GUIDED_DECODING" in eng.info.capabilities) is guided
    finally:
        await eng.stop()
        await build.last.aclose()


def test_what_sglang_cannot_do_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest) as e:
        sampling_dict(request(repetition_penalty=2.5), 1024)
    assert e.value.param == "repetition_penalty"


# --- engine arguments ---------------------------------------------------------------------


def test_engine_kwargs() -> None:
    eng = SglangEngine(
        SglangConfig(sglang_engine_args=json.dumps({"tp_size": 2, "mem_fraction_static": 0.8})),
        model_path="/models/m",
        served_model_name="served",
    )
    kw = eng.engine_kwargs()
    assert (kw["model_path"], kw["served_model_name"], kw["tp_size"]) == ("/models/m", "served", 2)
    events = json.loads(kw["kv_events_config"])  # SGLang parses the CLI JSON string
    assert events["publisher"] == "zmq" and events["topic"] == "kvmesh"
    assert events["endpoint"].startswith("ipc://") and events["replay_endpoint"].startswith(
        "ipc://"
    )
    mine = {"publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "t"}
    eng = SglangEngine(
        SglangConfig(sglang_engine_args=json.dumps({"kv_events_config": json.dumps(mine)})),
        model_path="/m",
        served_model_name="m",
    )
    assert json.loads(eng.engine_kwargs()["kv_events_config"]) == mine
    assert eng.kv_events_endpoint == "tcp://*:6000"
    for cfg in (
        SglangConfig(sglang_kv_events=False),
        SglangConfig(sglang_engine_args=json.dumps({"disable_radix_cache": True})),
    ):
        off = SglangEngine(cfg, model_path="/m", served_model_name="m")
        assert "kv_events_config" not in off.engine_kwargs() and off.kv_events_endpoint is None


# --- generation -------------------------------------------------------------------------


async def test_generate_in_both_streaming_modes(adapter: Any) -> None:
    eng, fake = adapter
    outs = await collect(eng, request(max_tokens=12, top_logprobs=2))
    tokens = [t for o in outs for t in o.token_ids]
    assert len(outs) > 1 and len(tokens) == 12
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 12
    lps = [lp for o in outs for lp in o.logprobs or []]
    assert [lp.token_id for lp in lps] == tokens and all(len(lp.top) == 2 for lp in lps)
    call = fake.calls["r1"]
    assert call["return_logprob"] is True and call["top_logprobs_num"] == 2
    assert call["sampling_params"]["max_new_tokens"] == 12
    # Same tokens whichever way SGLang streams.
    other, _ = make_engine(
        incremental_streaming_output=not fake.server_args.incremental_streaming_output
    )
    await other.start()
    try:
        assert [
            t for o in await collect(other, request(max_tokens=12)) for t in o.token_ids
        ] == tokens
    finally:
        await other.stop()


async def test_stop_token(adapter: Any) -> None:
    eng, _ = adapter
    ref = [t for o in await collect(eng, request("a", max_tokens=20)) for t in o.token_ids]
    stop = ref[4]
    k = ref.index(stop)
    req = request("b", max_tokens=20)
    req.stop.stop_token_ids = (stop,)
    outs = await collect(eng, req)
    assert [t for o in outs for t in o.token_ids] == ref[: k + 1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_token_id == stop


def test_decoder_finish_reasons() -> None:
    def chunk(ids: list[int], n: int, reason: Any) -> dict[str, Any]:
        return {
            "output_ids": ids,
            "meta_info": {"id": "x", "finish_reason": reason, "prompt_tokens": 3,
                          "completion_tokens": n, "cached_tokens": 0},
        }  # fmt: skip

    d = SglangDecoder(request("x"))
    assert d.feed(chunk([5], 1, None)) == EngineOutput([5])
    out = d.feed(chunk([6], 2, {"type": "stop", "matched": "</s>"}))  # a stop string
    assert out is not None and out.finish_reason is FinishReason.STOP and out.stop_token_id == 6
    with pytest.raises(InvalidRequest, match="too long"):
        SglangDecoder(request("x")).feed(
            chunk([], 0, {"type": "abort", "message": "input too long", "status_code": 400})
        )
    with pytest.raises(Unavailable):
        SglangDecoder(request("x")).feed(chunk([], 0, {"type": "abort", "message": "oom"}))


async def test_cancel_calls_abort_request() -> None:
    eng, build = make_engine(fake_speedup_ratio=10.0)  # slow enough to cancel mid-request
    await eng.start()
    fake = build.last
    try:
        gen = eng.generate(request("c", max_tokens=None))
        await anext(gen)
        await gen.aclose()
        assert eng.num_in_flight == 0
        await eventually(lambda: "c" in fake.tokenizer_manager.aborted)
        await eventually(lambda: fake.backend.load().kv_active_blocks == 0)
    finally:
        await eng.stop()
        await fake.aclose()


async def test_engine_refusal_is_invalid_request(adapter: Any) -> None:
    eng, _ = adapter
    # kvmesh does not know the vocabulary; SGLang's verify() refuses ids past it (ValueError).
    with pytest.raises(InvalidRequest, match="logit_bias"):
        await anext(eng.generate(request("v", logit_bias={5000: 1.0})))
    assert eng.num_in_flight == 0

    class HTTPException(Exception):  # what SGLang raises for some refusals (fastapi's)
        def __init__(self, status_code: int, detail: str) -> None:
            self.status_code, self.detail = status_code, detail

    assert isinstance(eng._translate_error(HTTPException(400, "bad image")), InvalidRequest)
    assert isinstance(eng._translate_error(HTTPException(503, "no encoder")), Unavailable)


async def test_load_from_get_loads(adapter: Any) -> None:
    eng, fake = adapter
    page = eng.info.kv_block_size
    eng.apply_load(  # get_loads(): LoadSnapshot per DP rank, running and waiting apart
        [
            sglang_fake.LoadSnapshot(
                dp_rank=0, num_running_reqs=3, num_waiting_reqs=2, num_used_tokens=30 * page
            ),
            {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 33},
        ]
    )
    assert eng.engine_load.num_running == 4 and eng.engine_load.num_waiting == 2
    assert eng.engine_load.kv_active_blocks == 30 + -(-33 // page)
    ref = fake.backend.load()
    before = eng.engine_load
    await eventually(lambda: eng.engine_load is not before)  # polled again: the fake's
    assert eng.engine_load.kv_active_blocks == ref.kv_active_blocks == 0
    assert eng.load().kv_active_blocks == 0 and eng.load().num_running == 0


async def test_load_polled_from_get_loads_while_requests_run() -> None:
    eng, build = make_engine(fake_speedup_ratio=10.0)  # slow enough to hold requests
    await eng.start()
    fake = build.last
    gens = [eng.generate(request(f"h{i}", max_tokens=None)) for i in range(3)]
    try:
        for gen in gens:
            await anext(gen)
        await eventually(lambda: eng.engine_load.num_running == 3)
        # the three share the prompt's blocks (prefix cache), each adds its own output's
        assert eng.engine_load.kv_active_blocks >= -(-len(PROMPT) // eng.info.kv_block_size)
        for gen in gens:
            await gen.aclose()
        await eventually(lambda: eng.engine_load.num_running == 0)
    finally:
        await eng.stop()
        await fake.aclose()


async def test_load_from_get_load_of_older_sglang(adapter: Any) -> None:
    """An SGLang from before get_loads(): get_load(), whose num_reqs counts the waiting
    requests too, with num_pages (or num_tokens in still older ones)."""
    eng, fake = adapter
    page = eng.info.kv_block_size
    eng.apply_load(
        [
            {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_pages": 30},
            {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 33},
        ]
    )
    assert eng.engine_load.num_running == 4 and eng.engine_load.num_waiting == 2
    assert eng.engine_load.kv_active_blocks == 30 + -(-33 // page)

    class OlderManager:  # what the adapter polls on such a version: get_load() only
        def __init__(self) -> None:
            self.calls = 0

        async def get_load(self) -> list[dict[str, int]]:
            self.calls += 1
            return [{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 1, "num_pages": 9}]

    older = OlderManager()
    fake.tokenizer_manager = older
    eng._requests_changed()  # wake the poll
    await eventually(lambda: older.calls > 0 and eng.engine_load.num_running == 6)
    assert eng.engine_load.num_waiting == 1 and eng.engine_load.kv_active_blocks == 9


# --- KV events: SGLang's wire format -----------------------------------------------------


def _stored(h: int, parent: int | None, tokens: list[Any], *extra: Any) -> list[Any]:
    return ["BlockStored", [h], parent, tokens, len(tokens), None, *extra]


@pytest.fixture
def fed() -> tuple[SglangEngine, KvEventLog]:
    """An adapter whose KV event path is fed payloads directly (page size 4)."""
    from kvmesh.workers.adapters.kv_translate import KvEventTranslator

    eng = SglangEngine(SglangConfig(), model_path="/m", served_model_name="m")
    eng._events = KvEventLog()
    eng._translator = KvEventTranslator(eng._events, 4)
    return eng, eng._events


def _payload(events: list[Any], dp_rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, dp_rank])


def test_sglang_events_old_and_new_layouts(fed: Any) -> None:
    eng, log = fed
    neg = -0x1234  # SGLang hashes are signed 64-bit ints
    u = neg & ((1 << 64) - 1)
    eng.apply_kv_payload(
        msgspec.msgpack.encode([0.0, [_stored(neg, None, [1, 2, 3, 4])]])  # no attn_dp_rank
    )
    eng.apply_kv_payload(_payload([_stored(77, neg, [5, 6, 7, 8], "GPU")]))  # with medium
    assert log.cached() == {u: (None, (1, 2, 3, 4), ""), 77: (u, (5, 6, 7, 8), "")}
    eng.apply_kv_payload(
        _payload(
            [
                _stored(88, 77, [9, 9, 9, 9], "CPU_PINNED"),  # host tier: not the GPU cache
                ["BlockRemoved", [neg], "CPU_PINNED"],
                ["BlockUpdated", [77], "GPU"],  # a kind kvmesh does not know: skipped
                ["BlockRemoved", [77]],  # old layout: no medium
            ]
        )
    )
    assert set(log.cached()) == {u}
    eng.apply_kv_payload(_payload([["AllBlocksCleared"]]))
    assert log.cached() == {}
    eng.apply_kv_payload(_payload([_stored(5, None, [1, 1, 1, 1])], dp_rank=1))  # other DP rank
    assert log.cached() == {}


def test_pages_the_router_cannot_reproduce_are_withheld(fed: Any) -> None:
    eng, log = fed
    eng.apply_kv_payload(
        _payload(
            [
                _stored(1, None, [1, 2, 3, 4], "GPU"),
                _stored(2, 1, [5, 6], "GPU"),  # a partial last page
                _stored(3, None, [7, 7, 7, 7], "GPU", {"cache_salt": "s"}),  # salted
                _stored(4, 3, [8, 8, 8, 8], "GPU"),  # after a salted page
                _stored(5, None, [[1, 2], [2, 3], [3, 4], [4, 5]], "GPU"),  # bigram pairs
            ]
        )
    )
    assert log.cached() == {1: (None, (1, 2, 3, 4), "")}
    assert eng._translator is not None and eng._translator.withheld_total == 4


async def test_generated_requests_mirror_the_engine_cache(adapter: Any) -> None:
    eng, fake = adapter
    shared = [100 + (i * 13) % 700 for i in range(64)]
    reqs = [request(f"m{i}", shared + [900 + i] * (5 + i), max_tokens=20) for i in range(6)]
    await asyncio.gather(*(collect(eng, r) for r in reqs))
    await eventually(lambda: eng.kv_events.cached() == fake.backend.cached_blocks())
    assert len(eng.kv_events.cached()) >= 4
    assert await eng.clear_kv_cache() > 0
    await eventually(lambda: eng.kv_events.cached() == fake.backend.cached_blocks() == {})


# --- disaggregation hooks ------------------------------------------------------------------


async def test_disaggregated_roles_are_refused_with_a_reason() -> None:
    eng, _ = make_engine()
    eng.configure_disaggregation(DisaggSettings(role=Role.AGGREGATED))
    with pytest.raises(Unimplemented, match="bootstrap room"):
        eng.configure_disaggregation(DisaggSettings(role=Role.PREFILL))


async def test_bootstrap_hooks(adapter: Any) -> None:
    eng, fake = adapter
    boot = eng.bootstrap_params()
    assert boot["bootstrap_host"] == "127.0.0.1" and boot["bootstrap_port"] == 8998
    assert 0 <= boot["bootstrap_room"] < 1 << 63
    # Prefill side: the request joins the room on this engine.
    sink_outs: list[EngineOutput] = []

    class Sink:
        def output(self, out: EngineOutput) -> None:
            sink_outs.append(out)

        def fail(self, exc: BaseException) -> None:
            raise AssertionError(exc)

    eng.start_prefill(request("pre", max_tokens=1), boot, Sink())
    await eventually(lambda: bool(sink_outs) and sink_outs[-1].finish_reason is not None)
    assert fake.calls["pre"]["bootstrap"] == (
        boot["bootstrap_host"],
        boot["bootstrap_port"],
        boot["bootstrap_room"],
    )
    # Decode side: the same room; SGLang's output starts with the prefill's token: dropped.
    full = [t for o in await collect(eng, request("full", max_tokens=6)) for t in o.token_ids]
    req = request("dec", max_tokens=6)
    req.remote_prefill = RemotePrefill(first_token_id=full[0], engine_params_json=json.dumps(boot))
    outs = await collect(eng, req)
    assert fake.calls["dec"]["bootstrap"][2] == boot["bootstrap_room"]
    assert [t for o in outs for t in o.token_ids] == full[1:]
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 6
    bad = request("bad")
    bad.remote_prefill = RemotePrefill(first_token_id=1, engine_params_json='{"bootstrap_room": 1}')
    with pytest.raises(InvalidRequest, match="bootstrap_host"):
        await anext(eng.generate(bad))
