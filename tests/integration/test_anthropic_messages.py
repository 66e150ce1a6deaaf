"""The Anthropic Messages API door through the official `anthropic` client.

A real aiohttp gateway on port 0 over FakeBackend (requests through the worker contract's
protobuf conversion, as in test_openai_features), scripted to "say" a given text: plain
answers, hermes-style tool calls, reasoning. Checks unary and streamed messages, the prompt
the chat template received (system prompt, tool_use / tool_result turns, tools), stop
sequences, count_tokens, the client's exception types for bad input, and API keys (x-api-key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import anthropic
import pytest
from anthropic.types import MessageParam, ToolParam

from kvmesh.frontend.app import abort_streams, build_app, serve_http
from kvmesh.frontend.auth import GatewayAuth
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import DEFAULT_TEXT, FakeBackend, model_info
from kvmesh.frontend.tokenizer import Tokenizer
from tests.integration.test_openai_features import WireBackend

pytestmark = pytest.mark.integration

PLAIN, HERMES, THINK = "tiny", "qwen-like", "r1-like"
USER: list[MessageParam] = [{"role": "user", "content": "What's the weather in Paris?"}]
TOOLS: list[ToolParam] = [
    {
        "name": "get_weather",
        "description": "Current weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
    {"name": "get_time", "input_schema": {"type": "object"}},
]
HERMES_CALLS = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model)


@dataclass
class Gateway:
    base: str
    backend: FakeBackend
    tok: Tokenizer
    client: anthropic.AsyncAnthropic

    def say(self, text: str) -> None:
        """Make every request generate exactly `text` (then EOS)."""
        self.backend.tokens = self.tok.encode(text)

    def prompt(self) -> str:
        """The last prompt the backend received, as text."""
        return self.tok.decode(self.backend.calls[-1].request.prompt, skip_special_tokens=False)


async def _serve(tok: Tokenizer, auth: GatewayAuth | None) -> tuple[aiohttp.web.AppRunner, str,
                                                                     FakeBackend]:  # fmt: skip
    names = [PLAIN, HERMES, THINK]
    backend = WireBackend(
        [model_info(n, context_length=2048) for n in names],
        tokens=tok.encode(DEFAULT_TEXT),
        eos_token_id=tok.eos_token_ids[-1],
    )
    config = FrontendConfig(
        tool_call_parser=f"{HERMES}=hermes,auto", reasoning_parser=f"{THINK}=deepseek_r1"
    )
    service = OpenAIService(backend, dict.fromkeys(names, tok), config)
    runner, port = await serve_http(build_app(service, auth=auth), "127.0.0.1", 0)
    return runner, f"http://127.0.0.1:{port}", backend


@pytest.fixture
async def gw(tok: Tokenizer) -> AsyncIterator[Gateway]:
    runner, base, backend = await _serve(tok, None)
    client = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
    try:
        yield Gateway(base, backend, tok, client)
    finally:
        await client.close()
        await runner.cleanup()


async def test_unary_and_streamed_text(gw: Gateway) -> None:
    unary = await gw.client.messages.create(
        model=PLAIN, max_tokens=5, system="You are terse.", messages=USER
    )
    expected = gw.tok.decode(gw.tok.encode(DEFAULT_TEXT)[:5])
    assert unary.id.startswith("msg_") and unary.role == "assistant" and unary.model == PLAIN
    assert [b.type for b in unary.content] == ["text"]
    assert unary.content[0].text == expected  # type: ignore[union-attr]
    assert unary.stop_reason == "max_tokens" and unary.stop_sequence is None
    assert unary.usage.output_tokens == 5
    prompt = gw.prompt()
    assert "You are terse." in prompt and "What's the weather in Paris?" in prompt
    assert unary.usage.input_tokens == len(gw.backend.calls[-1].request.prompt)

    async with gw.client.messages.stream(model=PLAIN, max_tokens=5, messages=USER) as stream:
        events = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert final.content[0].text == expected  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    assert final.usage.input_tokens == len(gw.backend.calls[-1].request.prompt)

    gw.say("short answer")  # ends by itself (EOS)
    done = await gw.client.messages.create(model=PLAIN, max_tokens=50, messages=USER)
    assert done.stop_reason == "end_turn" and done.content[0].text == "short answer"  # type: ignore[union-attr]


async def test_stop_sequences(gw: Gateway) -> None:
    gw.say("one two three four")
    for stream in (False, True):
        if stream:
            async with gw.client.messages.stream(
                model=PLAIN, max_tokens=50, messages=USER, stop_sequences=["zzz", " three"]
            ) as s:
                msg = await s.get_final_message()
        else:
            msg = await gw.client.messages.create(
                model=PLAIN, max_tokens=50, messages=USER, stop_sequences=["zzz", " three"]
            )
        assert msg.content[0].text == "one two"  # type: ignore[union-attr]
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", " three")


async def test_tool_use_unary_and_streamed(gw: Gateway) -> None:
    gw.say(HERMES_CALLS)
    unary = await gw.client.messages.create(
        model=HERMES, max_tokens=200, messages=USER, tools=TOOLS
    )
    assert unary.stop_reason == "tool_use"
    assert [b.type for b in unary.content] == ["text", "tool_use", "tool_use"]
    text, weather, time_ = unary.content
    assert text.text == "Checking."  # type: ignore[union-attr]
    assert (weather.name, weather.input) == ("get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    assert (time_.name, time_.input) == ("get_time", {})  # type: ignore[union-attr]
    assert weather.id and weather.id != time_.id  # type: ignore[union-attr]
    assert '"name": "get_weather"' in gw.prompt()  # the tools reached the chat template

    async with gw.client.messages.stream(
        model=HERMES, max_tokens=200, messages=USER, tools=TOOLS
    ) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for input_json_delta
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert [b.input for b in final.content[1:]] == [{"city": "Paris"}, {}]  # type: ignore[union-attr]

    # disable_parallel_tool_use: only the first call
    single = await gw.client.messages.create(
        model=HERMES,
        max_tokens=200,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    assert [b.type for b in single.content] == ["text", "tool_use"]


async def test_multi_turn_with_tool_result(gw: Gateway) -> None:
    gw.say("It is 21 degrees.")
    messages: list[MessageParam] = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp_c": 21}'},
                {"type": "text", "text": "Thanks, and in Fahrenheit?"},
            ],
        },
    ]  # fmt: skip
    msg = await gw.client.messages.create(
        model=HERMES, max_tokens=50, messages=messages, tools=TOOLS
    )
    assert msg.content[0].text == "It is 21 degrees." and msg.stop_reason == "end_turn"  # type: ignore[union-attr]
    prompt = gw.prompt()
    for part in ("Let me look.", '"city": "Paris"', '{"temp_c": 21}', "in Fahrenheit?"):
        assert part in prompt
    assert prompt.index('{"temp_c": 21}') < prompt.index("in Fahrenheit?")


async def test_thinking_block(gw: Gateway) -> None:
    gw.say("The user asks weather.\n</think>\n\nNo data.")
    msg = await gw.client.messages.create(model=THINK, max_tokens=100, messages=USER)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user asks weather."  # type: ignore[union-attr]
    async with gw.client.messages.stream(model=THINK, max_tokens=100, messages=USER) as s:
        final = await s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "No data."  # type: ignore[union-attr]


async def test_count_tokens(gw: Gateway) -> None:
    count = await gw.client.messages.count_tokens(
        model=HERMES, system="Be brief.", messages=USER, tools=TOOLS
    )
    await gw.client.messages.create(
        model=HERMES, max_tokens=1, system="Be brief.", messages=USER, tools=TOOLS
    )
    assert count.input_tokens == len(gw.backend.calls[-1].request.prompt)
    plain = await gw.client.messages.count_tokens(model=HERMES, messages=USER)
    assert 0 < plain.input_tokens < count.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        await gw.client.messages.count_tokens(model="nope", messages=USER)


async def test_errors_are_anthropic_shaped(gw: Gateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        await gw.client.messages.create(model="nope", max_tokens=5, messages=USER)
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `nope` does not exist."},
    }
    with pytest.raises(anthropic.BadRequestError) as bad:
        await gw.client.messages.create(model=PLAIN, max_tokens=0, messages=USER)
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in bad.value.message
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        await gw.client.messages.create(
            model=PLAIN, max_tokens=5, messages=USER, tool_choice={"type": "any"}
        )
    with pytest.raises(anthropic.BadRequestError, match="not in 'tools'"):
        await gw.client.messages.create(
            model=HERMES, max_tokens=5, messages=USER, tools=TOOLS,
            tool_choice={"type": "tool", "name": "nope"},
        )  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="context length"):
        await gw.client.messages.create(model=PLAIN, max_tokens=4000, messages=USER)
    async with aiohttp.ClientSession() as http:
        for body in (
            b"{",
            b'{"model": "tiny", "max_tokens": 5}',
            b'{"model": "tiny", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}',
        ):
            async with http.post(gw.base + "/v1/messages", data=body) as resp:
                assert resp.status == 400
                payload = await resp.json()
                assert payload["type"] == "error"
                assert payload["error"]["type"] == "invalid_request_error"


async def test_api_keys_guard_the_messages_routes(tok: Tokenizer) -> None:
    auth = GatewayAuth(keys=(b"sk-good",))
    runner, base, _backend = await _serve(tok, auth)
    good = anthropic.AsyncAnthropic(base_url=base, api_key="sk-good", max_retries=0)
    bearer = anthropic.AsyncAnthropic(base_url=base, auth_token="sk-good", max_retries=0)
    wrong = anthropic.AsyncAnthropic(base_url=base, api_key="sk-bad", max_retries=0)
    try:
        for client in (good, bearer):
            msg = await client.messages.create(model=PLAIN, max_tokens=2, messages=USER)
            assert msg.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await wrong.messages.create(model=PLAIN, max_tokens=2, messages=USER)
        assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.count_tokens(model=PLAIN, messages=USER)
    finally:
        for client in (good, bearer, wrong):
            await client.close()
        await runner.cleanup()


async def test_forced_stop_ends_the_stream_with_an_anthropic_error_event(tok: Tokenizer) -> None:
    """A forced stop (abort_streams: a drain that timed out, a second Ctrl-C) ends a Messages
    stream with the door's own error event, which the official client raises."""
    runner, base, backend = await _serve(tok, None)
    backend.tokens = tok.encode(DEFAULT_TEXT) * 20
    backend.delay_s = 0.02
    client = anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0)
    seen: list[str] = []
    try:
        with pytest.raises(anthropic.APIStatusError) as cut:
            async with client.messages.stream(model=PLAIN, max_tokens=400, messages=USER) as s:
                async for event in s:
                    seen.append(event.type)
                    if event.type == "content_block_delta" and len(seen) == 5:
                        assert abort_streams(runner.app, "the gateway is shutting down") == 1
        assert cut.value.body == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "the gateway is shutting down"},
        }
        assert seen[0] == "message_start" and "message_stop" not in seen
    finally:
        await client.close()
        await runner.cleanup()
