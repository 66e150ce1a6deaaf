"""The OpenAI HTTP gateway end to end: a real aiohttp server on port 0 over FakeBackend,
exercised with the official `openai` client and with raw aiohttp requests."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import DEFAULT_TEXT, FakeBackend, model_info
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime.errors import InvalidRequest, NotFound, ResourceExhausted, Unavailable
from kvmesh.runtime.process import JsonFormatter
from kvmesh.runtime.tinymodel import create_tiny_model
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import FinishReason
from tests.integration.test_worker_observability import promtool_check

pytestmark = pytest.mark.unit

MODEL = "tiny"
CONTEXT = 512
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = create_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")
    return Tokenizer.from_pretrained(path)


@dataclass
class Gateway:
    base: str
    backend: FakeBackend
    service: OpenAIService
    tok: Tokenizer
    client: openai.AsyncOpenAI
    http: aiohttp.ClientSession

    def text(self, n: int | None = None) -> str:
        """What the fake generates (its first n tokens), detokenized."""
        ids = self.tok.encode(DEFAULT_TEXT)
        return self.tok.decode(ids if n is None else ids[:n])

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(self.base + path, data=data, **kw) as resp:
            raw = await resp.read()
            return resp.status, json.loads(raw) if raw else None


@pytest.fixture
async def gw(tok: Tokenizer) -> AsyncIterator[Gateway]:
    backend = FakeBackend(
        [model_info(MODEL, context_length=CONTEXT)],
        tokens=tok.encode(DEFAULT_TEXT),
        eos_token_id=tok.eos_token_ids[-1],
    )
    config = FrontendConfig(max_request_bytes=64 * 1024, max_n=8)
    service = OpenAIService(backend, {MODEL: tok}, config)
    runner, port = await serve_http(build_app(service), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    http = aiohttp.ClientSession()
    try:
        yield Gateway(base, backend, service, tok, client, http)
    finally:
        await http.close()
        await client.close()
        await runner.cleanup()


async def _sse(gw: Gateway, path: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming request and return the parsed events ("[DONE]" kept as a string)."""
    events: list[Any] = []
    async with gw.http.post(gw.base + path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        async for line in resp.content:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


async def _until(predicate: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# -- the openai client -----------------------------------------------------------------------


async def test_chat_unary(gw: Gateway) -> None:
    gw.backend.cached_tokens = 5
    resp = await gw.client.chat.completions.create(model=MODEL, messages=USER)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == DEFAULT_TEXT
    assert choice.finish_reason == "stop"
    prompt = gw.tok.encode(gw.tok.apply_chat_template(USER))
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(gw.tok.encode(DEFAULT_TEXT)) + 1  # + EOS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 5
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL
    sent = gw.backend.calls[-1].request
    assert sent.prompt == prompt and sent.stop.max_tokens is None  # chat: until context end


async def test_chat_stream_with_usage(gw: Gateway) -> None:
    stream = await gw.client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == gw.text(8)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


async def test_completions_unary_and_stream(gw: Gateway) -> None:
    resp = await gw.client.completions.create(model=MODEL, prompt="Once upon a time")
    assert resp.choices[0].text == gw.text(16)  # OpenAI's default max_tokens
    assert resp.choices[0].finish_reason == "length"
    assert gw.backend.calls[-1].request.prompt[0] == gw.tok.bos_token_id
    assert resp.usage is not None and resp.usage.completion_tokens == 16

    stream = await gw.client.completions.create(
        model=MODEL, prompt="Once", max_tokens=5, stream=True, echo=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "Once" + gw.text(5)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_completions_batch_prompts(gw: Gateway) -> None:
    ids = gw.tok.encode("Hello there")
    resp = await gw.client.completions.create(model=MODEL, prompt=[ids, ids[:1]], max_tokens=3, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert all(c.text == gw.text(3) for c in resp.choices)
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(ids) + 1  # each prompt counted once
    assert resp.usage.completion_tokens == 12
    prompts = [call.request.prompt for call in list(gw.backend.calls)[-4:]]
    assert prompts == [ids, ids, ids[:1], ids[:1]]
    resp = await gw.client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=1)
    assert len(resp.choices) == 2


async def test_n_choices_stream_interleaved_with_seeds(gw: Gateway) -> None:
    gw.backend.delay_s = 0.001
    stream = await gw.client.chat.completions.create(
        model=MODEL,
        messages=USER,
        n=3,
        seed=100,
        max_tokens=6,
        stream=True,
    )
    texts = ["", "", ""]
    finishes: dict[int, str | None] = {}
    order = []
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            order.append(choice.index)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == [gw.text(6)] * 3
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)  # interleaved, not one choice after the other
    calls = list(gw.backend.calls)[-3:]
    assert sorted(c.request.sampling.seed or 0 for c in calls) == [100, 101, 102]
    assert len({c.request.request_id for c in calls}) == 3


@pytest.mark.parametrize("tokens_per_output", [1, 3])
async def test_stop_strings_never_emitted(gw: Gateway, tokens_per_output: int) -> None:
    gw.backend.tokens_per_output = tokens_per_output
    # "😀" spans several byte-level tokens; "Zürich 😀" spans several words and tokens.
    for stop in ["😀", "Zürich 😀", "é à", "end."]:
        head = DEFAULT_TEXT[: DEFAULT_TEXT.index(stop)]
        resp = await gw.client.chat.completions.create(
            model=MODEL, messages=USER, stop=[stop, "zzz"]
        )
        assert resp.choices[0].message.content == head
        assert resp.choices[0].finish_reason == "stop"
        stream = await gw.client.chat.completions.create(
            model=MODEL,
            messages=USER,
            stop=stop,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == head
        request_id = gw.backend.calls[-1].request.request_id
        if stop != "end.":  # matched before the script's end: the worker request is cancelled
            await _until(lambda rid=request_id: rid in gw.backend.cancelled)


async def test_logprobs(gw: Gateway) -> None:
    resp = await gw.client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    ids = gw.tok.encode(DEFAULT_TEXT)[:4]
    assert [c.token for c in content] == [gw.tok.token_str(i) for i in ids]
    assert all(c.logprob == -0.5 and len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(gw.tok.token_bytes(ids[0]))
    assert gw.backend.calls[-1].request.sampling.top_logprobs == 2
    text = await gw.client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=1)
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.top_logprobs is not None and len(lp.top_logprobs[0]) == 1


async def test_sampling_options_reach_the_backend(gw: Gateway) -> None:
    status, _ = await gw.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": USER,
            "max_tokens": 50,
            "max_completion_tokens": 4,
            "temperature": 0.2,
            "top_p": 0.8,
            "top_k": 5,
            "min_p": 0.05,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.2,
            "repetition_penalty": 1.3,
            "ignore_eos": True,
            "min_tokens": 2,
            "stop_token_ids": [7],
            "logit_bias": {"9": 3},
            "seed": 7,
            "an_unknown_field": [1, 2],
        },
    )
    assert status == 200
    req = gw.backend.calls[-1].request
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.2, 0.8, 5, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.1, 0.2, 1.3)
    assert (s.seed, s.logit_bias, s.top_logprobs) == (7, {9: 3.0}, None)
    assert (req.stop.max_tokens, req.stop.min_tokens, req.stop.stop_token_ids) == (4, 2, (7,))
    assert req.stop.ignore_eos


# -- errors ----------------------------------------------------------------------------------


def _is_error(body: Any, type_: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if type_ is not None:
        assert body["error"]["type"] == type_


CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, b"{bad json", 400, None),
        (CHAT, {"model": MODEL}, 400, "messages"),
        (CHAT, {"messages": USER}, 400, "model"),
        (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
        (CHAT, _chat(max_tokens=0), 400, "max_tokens"),
        (CHAT, _chat(temperature="x"), 400, "temperature"),
        (CHAT, _chat(n=9), 400, "n"),
        (CHAT, _chat(stop=list("abcde")), 400, "stop"),
        (CHAT, _chat(stream_options={}), 400, "stream_options"),
        (CHAT, _chat(stop_token_ids=[99999]), 400, "stop_token_ids"),
        (CHAT, _chat(model="nope"), 404, "model"),
        (TEXT, {"model": MODEL, "prompt": [[5, 99999]]}, 400, "prompt"),
        (TEXT, {"model": MODEL}, 400, "prompt"),
    ],
)
async def test_bad_requests(
    gw: Gateway, path: str, body: Any, status: int, param: str | None
) -> None:
    got, payload = await gw.post(path, body)
    assert got == status, payload
    _is_error(payload)
    assert payload["error"]["param"] == param
    assert payload["error"]["code"] == ("model_not_found" if status == 404 else None)
    assert not gw.backend.calls  # refused before reaching a worker


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, _chat(messages=[{"role": "user", "content": "word " * 600}]), "messages"),
        (CHAT, _chat(max_tokens=500), "max_tokens"),
        (TEXT, {"model": MODEL, "prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),
    ],
)
async def test_over_the_context_length_is_400_context_length_exceeded(
    gw: Gateway, path: str, body: Any, param: str
) -> None:
    """As OpenAI and vLLM answer: 400, type invalid_request_error, code context_length_exceeded
    (not 413, which the official client does not map to BadRequestError)."""
    got, payload = await gw.post(path, body)
    assert got == 400, payload
    error = payload["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        param,
    )
    assert "context length" in error["message"]
    assert not gw.backend.calls
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=500)
    assert info.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ],
)
async def test_image_and_audio_parts_are_refused_not_dropped(
    gw: Gateway, part: dict[str, Any]
) -> None:
    """A chat with an audio part, or an image the engine cannot take (this one does not even
    decode), gets a 400 that names the part or the image, instead of being served as its text
    alone."""
    content = [{"type": "text", "text": "What is in this picture?"}, part]
    got, payload = await gw.post(CHAT, _chat(messages=[{"role": "user", "content": content}]))
    assert got == 400, payload
    assert payload["error"]["param"] == "messages"
    named = "image 0" if part["type"] == "image_url" else part["type"]
    assert named in payload["error"]["message"]
    assert not gw.backend.calls


async def test_openai_client_sees_errors(gw: Gateway) -> None:
    with pytest.raises(openai.NotFoundError):
        await gw.client.chat.completions.create(model="nope", messages=USER)
    with pytest.raises(openai.BadRequestError):
        await gw.client.chat.completions.create(model=MODEL, messages=[])


async def test_body_too_large_wrong_method_unknown_path(gw: Gateway) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
    status, body = await gw.post("/v1/chat/completions", big)
    assert status == 413
    _is_error(body)
    assert "too large" in body["error"]["message"]
    async with gw.http.get(gw.base + "/v1/chat/completions") as resp:
        assert resp.status == 405 and "POST" in resp.headers["Allow"]
        _is_error(await resp.json())
    async with gw.http.delete(gw.base + "/v1/models") as resp:
        assert resp.status == 405
        _is_error(await resp.json())
    async with gw.http.get(gw.base + "/v2/nothing") as resp:
        assert resp.status == 404
        _is_error(await resp.json(), "not_found_error")


@pytest.mark.parametrize(
    ("error", "status", "type_"),
    [
        (Unavailable("no worker"), 503, "service_unavailable"),
        (ResourceExhausted("busy"), 429, "rate_limit_error"),
        (InvalidRequest("bad adapter", param="model"), 400, "invalid_request_error"),
        (NotFound("no adapter"), 404, "not_found_error"),
        (RuntimeError("secret internal detail"), 500, "internal_error"),
    ],
)
async def test_backend_errors_before_streaming(
    gw: Gateway, error: Exception, status: int, type_: str
) -> None:
    gw.backend.error_before = error  # type: ignore[assignment]
    for stream in (False, True):
        body = {"model": MODEL, "messages": USER, "stream": stream}
        async with gw.http.post(gw.base + "/v1/chat/completions", json=body) as resp:
            assert resp.status == status
            payload = await resp.json()
            _is_error(payload, type_)
            assert "secret" not in json.dumps(payload) and "Traceback" not in json.dumps(payload)
            if status in (429, 503):
                assert resp.headers["Retry-After"] == "1"
    assert gw.service.in_flight == 0


async def test_error_mid_stream(gw: Gateway) -> None:
    gw.backend.error_after = 3
    events = await _sse(
        gw, "/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True}
    )
    assert events[-1] == "[DONE]"
    _is_error(events[-2], "service_unavailable")
    assert len(events) == 5 and all("choices" in e for e in events[:3])
    gw.backend.error_mid = RuntimeError("hidden")
    events = await _sse(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
    _is_error(events[-2], "internal_error")
    assert "hidden" not in json.dumps(events)
    # a unary request that fails after its first token is a plain error response
    status, body = await gw.post("/v1/chat/completions", {"model": MODEL, "messages": USER})
    assert status == 500
    _is_error(body)
    assert gw.service.in_flight == 0


async def test_worker_cancellation_is_an_error(gw: Gateway) -> None:
    gw.backend.finish_reason = FinishReason.CANCELLED
    status, body = await gw.post("/v1/chat/completions", {"model": MODEL, "messages": USER})
    assert status == 503
    _is_error(body)


# -- cancellation, health, draining, metrics, tracing -------------------------------------


async def test_client_disconnect_cancels_the_backend(gw: Gateway) -> None:
    gw.backend.delay_s = 0.05
    body = {"model": MODEL, "messages": USER, "stream": True}
    async with gw.http.post(gw.base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()
        request_id = gw.backend.calls[-1].request.request_id
        assert request_id not in gw.backend.cancelled
    # leaving the block closes the connection mid-stream
    await _until(lambda: request_id in gw.backend.cancelled)
    await _until(lambda: gw.service.in_flight == 0)
    assert request_id not in gw.backend.completed


async def test_health_live_models(gw: Gateway) -> None:
    async with gw.http.get(gw.base + "/health") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ok"
    gw.backend.is_ready = False
    async with gw.http.get(gw.base + "/health") as resp:
        assert resp.status == 503
    async with gw.http.get(gw.base + "/live") as resp:
        assert resp.status == 200
    models = await gw.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    model = await gw.client.models.retrieve(MODEL)
    assert model.id == MODEL
    with pytest.raises(openai.NotFoundError):
        await gw.client.models.retrieve("nope")


async def test_draining(gw: Gateway) -> None:
    gw.backend.delay_s = 0.02
    body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 10}
    async with gw.http.post(gw.base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        gw.service.start_drain()
        async with gw.http.get(gw.base + "/health") as health:
            assert health.status == 503 and (await health.json())["status"] == "draining"
        status, error = await gw.post("/v1/chat/completions", {"model": MODEL, "messages": USER})
        assert status == 503
        _is_error(error)
        rest = await resp.read()  # the in-flight stream still completes
        assert rest.endswith(b"data: [DONE]\n\n")
    assert await gw.service.wait_idle(1.0)


async def test_metrics(gw: Gateway) -> None:
    await gw.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    await gw.post("/v1/chat/completions", {"model": "nope", "messages": USER})
    async with gw.http.get(gw.base + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for name in (
        "kvmesh_frontend_requests_total",
        "kvmesh_frontend_requests_started_total",
        "kvmesh_frontend_inflight_requests",
        "kvmesh_frontend_queued_requests",
        "kvmesh_frontend_disconnected_clients",
        "kvmesh_frontend_time_to_first_token_seconds_bucket",
        "kvmesh_frontend_inter_token_latency_seconds_bucket",
        "kvmesh_frontend_input_sequence_tokens_bucket",
        "kvmesh_frontend_output_sequence_tokens_bucket",
        "kvmesh_frontend_request_duration_seconds_bucket",
        "kvmesh_frontend_output_tokens_total",
    ):
        assert name in text, name
    assert (
        'kvmesh_frontend_requests_total{endpoint="chat_completions",error_type="",'
        'model="tiny",request_type="unary",status="success"} 1.0' in text
    )
    assert (
        'kvmesh_frontend_requests_total{endpoint="chat_completions",error_type="not_found",'
        'model="unknown_model",request_type="unary",status="error"} 1.0' in text
    )
    assert 'kvmesh_frontend_output_sequence_tokens_count{model="tiny"} 1.0' in text
    assert 'kvmesh_frontend_output_tokens_total{model="tiny"} 3.0' in text


async def test_request_itl_is_each_sequence_s_mean_token_gap(gw: Gateway) -> None:
    """request_itl_seconds: one observation per finished sequence of two or more tokens, its
    (last token - first token) / (tokens - 1); a one-token sequence has no gap to observe."""
    gw.backend.delay_s = 0.02
    await gw.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
    await gw.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    async with gw.http.get(gw.base + "/metrics") as resp:
        text = await resp.text()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvmesh_frontend_request_itl_seconds_")
        and 'model="tiny"' in line
        and "_bucket" not in line
    }
    assert values["kvmesh_frontend_request_itl_seconds_count"] == 1
    # 4 gaps of one 20 ms sleep each (and whatever a loaded machine adds)
    assert 0.015 <= values["kvmesh_frontend_request_itl_seconds_sum"] < 0.5


async def test_metrics_pass_promtool(gw: Gateway) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 3}
    await gw.post("/v1/chat/completions", body)
    async with gw.http.post(gw.base + "/v1/chat/completions", json={**body, "stream": True}) as r:
        await r.read()
    await gw.post("/v1/chat/completions", {**body, "model": "nope"})
    async with gw.http.get(gw.base + "/metrics") as resp:
        text = await resp.text()
    await asyncio.to_thread(promtool_check, text)


async def test_json_logs_carry_the_request_and_content_only_when_asked(gw: Gateway) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("kvmesh.frontend.service")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    client = TraceContext.new()
    headers = {"traceparent": client.traceparent, "x-request-id": "req-7"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "secret words"}]}
    try:
        status, _ = await gw.post("/v1/chat/completions", body, headers=headers)
        assert status == 200
        assert "secret words" not in stream.getvalue()  # off by default
        gw.service.log_content = True
        status, _ = await gw.post("/v1/chat/completions", body, headers=headers)
        assert status == 200
        url = gw.base + "/v1/chat/completions"
        async with gw.http.post(url, json={**body, "stream": True}, headers=headers) as r:
            assert r.status == 200
            await r.read()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert any("secret words" in line["message"] for line in lines)
    outputs = [line["message"] for line in lines if "output" in line["message"]]
    assert len(outputs) == 2 and all("(stop)" in m for m in outputs), outputs
    for line in lines:
        assert line["request_id"] == "req-7", line
        assert line["trace_id"] == client.trace_id and line["span_id"] != client.span_id, line


async def test_x_request_id_is_returned(gw: Gateway) -> None:
    headers = {"x-request-id": "req-42"}
    body = {"model": MODEL, "messages": USER, "max_tokens": 2}
    async with gw.http.post(gw.base + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200 and r.headers["x-request-id"] == "req-42"
    stream = {**body, "stream": True}
    async with gw.http.post(gw.base + "/v1/chat/completions", json=stream, headers=headers) as r:
        await r.read()
        assert r.status == 200 and r.headers["x-request-id"] == "req-42"
    bad = {"model": "nope", "messages": USER}
    async with gw.http.post(gw.base + "/v1/chat/completions", json=bad, headers=headers) as r:
        assert r.status == 404 and r.headers["x-request-id"] == "req-42"
    async with gw.http.post(gw.base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200 and "x-request-id" not in r.headers


async def test_traceparent_is_forwarded_as_a_child(gw: Gateway) -> None:
    parent = TraceContext.new()
    headers = {"traceparent": parent.traceparent, "tracestate": "vendor=1"}
    status, _ = await gw.post(
        "/v1/chat/completions", {"model": MODEL, "messages": USER}, headers=headers
    )
    assert status == 200
    trace = gw.backend.calls[-1].trace
    assert trace is not None
    assert trace.trace_id == parent.trace_id and trace.span_id != parent.span_id
    assert trace.tracestate == "vendor=1"
    status, _ = await gw.post(
        "/v1/chat/completions", {"model": MODEL, "messages": USER}, headers={"traceparent": "bad"}
    )
    fresh = gw.backend.calls[-1].trace
    assert fresh is not None and fresh.trace_id != parent.trace_id


async def test_sequential_keepalive_streams_do_not_stall(gw: Gateway) -> None:
    """Nagle + delayed ACK would add ~40 ms per streamed request on a keep-alive connection."""
    body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 8}
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        latencies = []
        for _ in range(15):
            start = time.perf_counter()
            async with session.post(gw.base + "/v1/chat/completions", json=body) as resp:
                await resp.read()
            latencies.append(time.perf_counter() - start)
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.02, latencies


async def test_tokens_are_sent_as_they_arrive(gw: Gateway) -> None:
    """Write coalescing must never hold back a token that arrived on its own."""
    gw.backend.delay_s = 0.03
    body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 5}
    arrivals = []
    async with gw.http.post(gw.base + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
    assert len(arrivals) == 5
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) > 0.015, gaps
