"""Every OpenAI feature of the gateway through the official `openai` client.

A real aiohttp server on port 0 runs the gateway over FakeBackend, scripted per test to "say" a
given text (tool calls in each model format, `<think>` reasoning, JSON), so tool-call and
reasoning parsing, guided decoding pass-through and capability errors are exercised end to end.
Every request the backend sees went through the worker contract's protobuf conversion and back
(kvmesh.runtime.wire), as with real workers.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import DEFAULT_TEXT, FakeBackend, model_info
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime import wire
from kvmesh.runtime.tinymodel import create_tiny_model
from kvmesh.runtime.tracing import TraceContext
from kvmesh.runtime.types import EngineOutput, EngineRequest, GuidedDecoding, GuidedKind

pytestmark = pytest.mark.integration

PLAIN = "tiny"  # tool parser "auto" (the tiny template is Llama 3 JSON style)
GUIDED = "tiny-guided"  # advertises GUIDED_DECODING and EMBEDDINGS
HERMES, MISTRAL, PYTHONIC, THINK = "qwen-like", "mistral-like", "llama4-like", "r1-like"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What's the weather?"}]
WEATHER: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


class WireBackend(FakeBackend):
    """FakeBackend receiving requests as a worker would: through protobuf and back."""

    def generate(
        self, model: str, request: EngineRequest, trace: TraceContext | None
    ) -> AsyncGenerator[EngineOutput, None]:
        request = wire.request_from_pb(wire.request_to_pb(request), request.request_id)
        return super().generate(model, request, trace)


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

    def say(self, text: str) -> None:
        """Make every request generate exactly `text` (then EOS)."""
        self.backend.tokens = self.tok.encode(text)

    async def get(self, path: str) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as http, http.get(self.base + path) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def gw(tok: Tokenizer) -> AsyncIterator[Gateway]:
    guided = ("LOGPROBS", "GUIDED_DECODING", "EMBEDDINGS")
    names = [PLAIN, HERMES, MISTRAL, PYTHONIC, THINK]
    backend = WireBackend(
        [model_info(n) for n in names] + [model_info(GUIDED, capabilities=guided)],
        tokens=tok.encode(DEFAULT_TEXT),
        eos_token_id=tok.eos_token_ids[-1],
        embedding_dim=8,
    )
    config = FrontendConfig(
        tool_call_parser=f"{HERMES}=hermes,{MISTRAL}=mistral,{PYTHONIC}=pythonic,auto",
        reasoning_parser=f"{THINK}=deepseek_r1,{HERMES}=qwen3",
    )
    service = OpenAIService(backend, {n: tok for n in [*names, GUIDED]}, config)
    runner, port = await serve_http(build_app(service), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    try:
        yield Gateway(base, backend, service, tok, client)
    finally:
        await client.close()
        await runner.cleanup()


# -- request metadata, multi-turn, sampling options -----------------------------------------


async def test_id_created_and_system_fingerprint(gw: Gateway) -> None:
    before = int(time.time())
    unary = await gw.client.chat.completions.create(model=PLAIN, messages=USER, max_tokens=3)
    assert unary.id.startswith("chatcmpl-") and before <= unary.created <= time.time() + 1
    fingerprint = unary.system_fingerprint
    assert fingerprint is not None and fingerprint.startswith("fp_")
    stream = await gw.client.chat.completions.create(
        model=PLAIN, messages=USER, max_tokens=3, stream=True
    )
    chunks = [c async for c in stream]
    assert {c.system_fingerprint for c in chunks} == {fingerprint}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != unary.id
    text = await gw.client.completions.create(model=PLAIN, prompt="x", max_tokens=2)
    assert text.id.startswith("cmpl-") and text.system_fingerprint == fingerprint
    other = await gw.client.chat.completions.create(model=GUIDED, messages=USER, max_tokens=1)
    assert other.system_fingerprint != fingerprint  # another model (and engine config)


async def test_multi_turn_with_system_prompt_and_tool_results(gw: Gateway) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "21 °C."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    resp = await gw.client.chat.completions.create(
        model=PLAIN, messages=messages, tools=WEATHER, max_tokens=4, user="user-42"
    )
    assert resp.choices[0].message.content == gw.tok.decode(gw.tok.encode(DEFAULT_TEXT)[:4])
    prompt = gw.tok.decode(gw.backend.calls[-1].request.prompt, skip_special_tokens=False)
    for part in (
        "You are terse.",
        '"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"temp_c": 21}',
        "21 °C.",
        "And tomorrow?",
        "Environment: ipython",
    ):
        assert part in prompt


async def test_n_seed_penalties_logprobs_and_stop(gw: Gateway) -> None:
    stream = await gw.client.chat.completions.create(
        model=PLAIN,
        messages=USER,
        n=2,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logprobs=True,
        top_logprobs=3,
        stop=["Zürich", "nope", "never", "x y"],
        stream=True,
    )
    texts = ["", ""]
    logprobs: list[list[Any]] = [[], []]
    finishes = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs[choice.index] += choice.logprobs.content
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    head = DEFAULT_TEXT[: DEFAULT_TEXT.index("Zürich")]
    assert texts == [head, head] and finishes == {0: "stop", 1: "stop"}
    assert all(len(lp.top_logprobs) == 3 for lp in logprobs[0]) and logprobs[0]
    calls = list(gw.backend.calls)[-2:]
    assert sorted(c.request.sampling.seed or 0 for c in calls) == [7, 8]
    s = calls[0].request.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.top_logprobs) == (0.5, -0.25, 3)


async def test_unknown_fields_are_ignored(gw: Gateway) -> None:
    resp = await gw.client.chat.completions.create(
        model=PLAIN,
        messages=USER,
        max_tokens=2,
        extra_body={"some_future_field": {"x": 1}, "metadata": {"k": "v"}, "store": False},
    )
    assert resp.choices[0].finish_reason == "length"


# -- structured output ------------------------------------------------------------------------


async def test_structured_output_needs_the_engine_capability(gw: Gateway) -> None:
    for kwargs in (
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": {"type": "object"}},
            }
        },
        {"extra_body": {"guided_regex": "[a-z]+"}},
        {"extra_body": {"guided_choice": ["yes", "no"]}},
    ):
        with pytest.raises(openai.BadRequestError) as info:
            await gw.client.chat.completions.create(model=PLAIN, messages=USER, **kwargs)  # type: ignore[call-overload]
        assert "GUIDED_DECODING" in info.value.message
    with pytest.raises(openai.BadRequestError):
        await gw.client.completions.create(
            model=PLAIN, prompt="x", extra_body={"guided_json": {"type": "object"}}
        )
    assert not gw.backend.calls


class Weather(BaseModel):
    city: str
    temp_c: float


async def test_structured_output_reaches_a_capable_engine(gw: Gateway) -> None:
    gw.say('{"city": "Paris", "temp_c": 21.5}')
    parsed = await gw.client.chat.completions.parse(
        model=GUIDED, messages=USER, response_format=Weather
    )
    assert parsed.choices[0].message.parsed == Weather(city="Paris", temp_c=21.5)
    guided = gw.backend.calls[-1].request.sampling.guided
    assert guided is not None and guided.kind is GuidedKind.JSON_SCHEMA
    assert json.loads(guided.value)["properties"]["temp_c"]["type"] == "number"
    await gw.client.chat.completions.create(
        model=GUIDED, messages=USER, response_format={"type": "json_object"}
    )
    assert gw.backend.calls[-1].request.sampling.guided == GuidedDecoding(GuidedKind.JSON_OBJECT)
    await gw.client.completions.create(
        model=GUIDED, prompt="Is it?", extra_body={"guided_choice": ["yes", "no"]}
    )
    assert gw.backend.calls[-1].request.sampling.guided == GuidedDecoding(
        GuidedKind.CHOICE, choices=("yes", "no")
    )
    with pytest.raises(openai.BadRequestError):  # two constraints at once
        await gw.client.chat.completions.create(
            model=GUIDED,
            messages=USER,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a"},
        )


# -- tool calling -------------------------------------------------------------------------------

TOOL_OUTPUTS = [
    (PLAIN, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None),
    (
        HERMES,
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
        "Checking.",
    ),
    (
        MISTRAL,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]get_time[ARGS]{}',
        None,
    ),
    (PYTHONIC, '[get_weather(city="Paris", unit="c"), get_time()]', None),
]


@pytest.mark.parametrize(("model", "output", "content"), TOOL_OUTPUTS)
async def test_tool_calls_unary_and_streamed(
    gw: Gateway, model: str, output: str, content: str | None
) -> None:
    gw.say(output)
    names = ["get_weather"] + (["get_time"] if model != PLAIN else [])
    unary = await gw.client.chat.completions.create(model=model, messages=USER, tools=WEATHER)
    message = unary.choices[0].message
    assert unary.choices[0].finish_reason == "tool_calls"
    assert message.content == content
    assert message.tool_calls is not None
    assert [c.function.name for c in message.tool_calls] == names  # type: ignore[union-attr]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}  # type: ignore[union-attr]
    assert len({c.id for c in message.tool_calls}) == len(names)

    # The SDK's stream helper accumulates the deltas into the same message.
    async with gw.client.chat.completions.stream(
        model=model, messages=USER, tools=WEATHER
    ) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_completion()
    streamed = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.content or None) == content
    assert streamed.tool_calls is not None
    assert [c.function.name for c in streamed.tool_calls] == names  # type: ignore[union-attr]
    assert [c.function.arguments for c in streamed.tool_calls] == [  # type: ignore[union-attr]
        c.function.arguments  # type: ignore[union-attr]
        for c in message.tool_calls
    ]
    assert any(e.type == "tool_calls.function.arguments.delta" for e in events)


async def test_tool_choice_none_and_plain_answers(gw: Gateway) -> None:
    gw.say('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    resp = await gw.client.chat.completions.create(
        model=PLAIN, messages=USER, tools=WEATHER, tool_choice="none"
    )
    assert resp.choices[0].message.tool_calls is None
    assert (
        resp.choices[0].message.content
        == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    )
    prompt = gw.tok.decode(gw.backend.calls[-1].request.prompt, skip_special_tokens=False)
    assert "get_weather" not in prompt  # tools are not rendered with tool_choice none
    gw.say("It is sunny in Paris.")
    resp = await gw.client.chat.completions.create(model=HERMES, messages=USER, tools=WEATHER)
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content == "It is sunny in Paris."
    assert resp.choices[0].finish_reason == "stop"


async def test_parallel_tool_calls_false_and_legacy_functions(gw: Gateway) -> None:
    gw.say(TOOL_OUTPUTS[1][1])
    resp = await gw.client.chat.completions.create(
        model=HERMES, messages=USER, tools=WEATHER, parallel_tool_calls=False
    )
    assert [c.function.name for c in resp.choices[0].message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
    resp = await gw.client.chat.completions.create(
        model=HERMES,
        messages=USER,
        functions=[{"name": "get_weather", "parameters": {"type": "object"}}],
    )
    assert resp.choices[0].message.tool_calls is not None


async def test_forced_tool_choice_uses_guided_decoding(gw: Gateway) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as info:
            await gw.client.chat.completions.create(
                model=PLAIN,
                messages=USER,
                tools=WEATHER,
                tool_choice=choice,  # type: ignore[arg-type]
            )
        assert "guided decoding" in info.value.message

    gw.say('{"city": "Oslo"}')
    named = await gw.client.chat.completions.create(
        model=GUIDED,
        messages=USER,
        tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = (named.choices[0].message.tool_calls or [])[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')  # type: ignore[union-attr]
    assert named.choices[0].finish_reason == "stop"  # as OpenAI does for a forced function
    guided = gw.backend.calls[-1].request.sampling.guided
    assert guided is not None and json.loads(guided.value)["required"] == ["city"]

    gw.say('[{"name": "get_time", "parameters": {}}]')
    async with gw.client.chat.completions.stream(
        model=GUIDED, messages=USER, tools=WEATHER, tool_choice="required"
    ) as stream:
        final = await stream.get_final_completion()
    assert [c.function.name for c in final.choices[0].message.tool_calls or []] == ["get_time"]  # type: ignore[union-attr]
    guided = gw.backend.calls[-1].request.sampling.guided
    assert guided is not None
    schema = json.loads(guided.value)
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    assert all(v["additionalProperties"] is False for v in schema["items"]["anyOf"])
    assert "maxItems" not in schema

    gw.say('[{"name": "get_time", "parameters": {}}]')
    await gw.client.chat.completions.create(
        model=GUIDED,
        messages=USER,
        tools=WEATHER,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    guided = gw.backend.calls[-1].request.sampling.guided
    assert guided is not None and json.loads(guided.value)["maxItems"] == 1  # one call at most


async def test_tools_without_a_parser_are_refused(gw: Gateway, tok: Tokenizer) -> None:
    gw.service._tool_parsers[PLAIN] = None  # as for a model whose template names no format
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.chat.completions.create(model=PLAIN, messages=USER, tools=WEATHER)
    assert "--tool-call-parser" in info.value.message


# -- reasoning -----------------------------------------------------------------------------------


async def test_reasoning_content_unary_and_streamed(gw: Gateway) -> None:
    gw.say("Okay, the user wants weather.\nI lack data.\n</think>\n\nI can't know that.")
    unary = await gw.client.chat.completions.create(model=THINK, messages=USER)
    message = unary.choices[0].message
    assert message.content == "I can't know that."
    assert message.model_extra is not None
    assert message.model_extra["reasoning_content"] == "Okay, the user wants weather.\nI lack data."
    stream = await gw.client.chat.completions.create(model=THINK, messages=USER, stream=True)
    reasoning, content = "", ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)


async def test_reasoning_then_tool_call(gw: Gateway) -> None:
    gw.say(
        "<think>\nNeed the weather tool.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    for stream in (False, True):
        if stream:
            async with gw.client.chat.completions.stream(
                model=HERMES, messages=USER, tools=WEATHER
            ) as s:
                resp = await s.get_final_completion()
        else:
            resp = await gw.client.chat.completions.create(
                model=HERMES, messages=USER, tools=WEATHER
            )
        message = resp.choices[0].message
        assert (message.model_extra or {}).get("reasoning_content") == "Need the weather tool."
        assert not message.content
        assert [c.function.name for c in message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
        assert resp.choices[0].finish_reason == "tool_calls"


# -- embeddings, models, openapi ------------------------------------------------------------------


async def test_embeddings(gw: Gateway) -> None:
    resp = await gw.client.embeddings.create(model=GUIDED, input=["hello", "world"])
    assert [d.index for d in resp.data] == [0, 1] and len(resp.data[0].embedding) == 8
    assert abs(sum(x * x for x in resp.data[0].embedding) - 1.0) < 1e-5  # base64 decoded
    floats = await gw.client.embeddings.create(
        model=GUIDED, input=[[1, 2, 3]], encoding_format="float", dimensions=4
    )
    assert len(floats.data[0].embedding) == 4 and floats.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.embeddings.create(model=PLAIN, input="hello")
    assert "EMBEDDINGS" in info.value.message
    with pytest.raises(openai.BadRequestError):
        await gw.client.embeddings.create(model=GUIDED, input="x", dimensions=9)
    with pytest.raises(openai.NotFoundError):
        await gw.client.embeddings.create(model="nope", input="x")
    gw.backend.embedding_dim = 0
    with pytest.raises(openai.APIStatusError) as status:
        await gw.client.embeddings.create(model=GUIDED, input="hello")
    assert status.value.status_code == 501


async def test_openapi_document(gw: Gateway) -> None:
    status, doc = await gw.get("/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v2/models/{model}/infer",
        "/v2/health/ready",
    ):
        assert path in doc["paths"], path
    chat = doc["components"]["schemas"]["CreateChatCompletionRequest"]
    assert {"tools", "tool_choice", "response_format", "seed", "n"} <= set(chat["properties"])
