"""Parsing OpenAI requests into typed messages, and encoding results and SSE chunks."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from kvmesh.frontend.dataplane import (
    ChoiceDelta,
    ChoiceResult,
    CompletionResult,
    TokenLogprobInfo,
    UsageInfo,
)
from kvmesh.frontend.protocol import (
    DONE_EVENT,
    ChatChunkEncoder,
    TextChunkEncoder,
    encode_error_event,
    encode_result,
    parse_chat_request,
    parse_completion_request,
)
from kvmesh.runtime.errors import InvalidRequest

pytestmark = pytest.mark.unit

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MSG, **fields}).encode()


def test_chat_defaults() -> None:
    req = parse_chat_request(chat())
    assert req.model == "m" and not req.stream and not req.include_usage
    assert [(m.role, m.content) for m in req.messages] == [("user", "hi")]
    o = req.options
    assert (o.max_tokens, o.temperature, o.top_p, o.n, o.logprobs, o.stop) == (
        None,
        1.0,
        1.0,
        1,
        None,
        (),
    )


def test_chat_all_options() -> None:
    req = parse_chat_request(
        chat(
            max_tokens=5,
            max_completion_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=-1,
            min_p=0.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            seed=42,
            stop="END",
            stop_token_ids=[3, 4],
            ignore_eos=True,
            min_tokens=2,
            n=2,
            logprobs=True,
            top_logprobs=3,
            logit_bias={"12": -100, "13": 5.5},
            stream=True,
            stream_options={"include_usage": True},
            some_unknown_field={"ignored": True},
            user="u1",
        )
    )
    o = req.options
    assert o.max_tokens == 7  # max_completion_tokens wins
    assert (o.temperature, o.top_p, o.top_k, o.min_p) == (0.5, 0.9, 0, 0.1)
    assert (o.presence_penalty, o.frequency_penalty, o.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (o.seed, o.stop, o.stop_token_ids, o.ignore_eos, o.min_tokens) == (
        42,
        ("END",),
        (3, 4),
        True,
        2,
    )
    assert (o.n, o.logprobs, o.logit_bias) == (2, 3, {12: -100.0, 13: 5.5})
    assert req.stream and req.include_usage and req.user == "u1"


def test_content_parts_and_tool_messages() -> None:
    messages = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}],
        },
        {"role": "tool", "content": "r", "tool_call_id": "1"},
    ]
    req = parse_chat_request(
        json.dumps({"model": "m", "messages": messages, "tools": [{"type": "function"}]}).encode()
    )
    assert req.messages[0].content == "a\nb"
    assert req.messages[2].to_template()["tool_calls"][0]["id"] == "1"
    assert req.messages[3].to_template() == {"role": "tool", "content": "r", "tool_call_id": "1"}
    assert req.tools == [{"type": "function"}]
    req = parse_chat_request(
        json.dumps({"model": "m", "messages": MSG, "tools": [{}], "tool_choice": "none"}).encode()
    )
    assert req.tools is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"messages": MSG}).encode(), "model"),
        (json.dumps({"model": 3, "messages": MSG}).encode(), "model"),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": "hi"}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": [{"content": "x"}]}).encode(), "messages"),
        (
            json.dumps({"model": "m", "messages": [{"role": "bot", "content": "x"}]}).encode(),
            "messages",
        ),
        (json.dumps({"model": "m", "messages": [{"role": "user"}]}).encode(), "messages"),
        (
            json.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}).encode(),
            "messages",
        ),
        (
            json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
            ).encode(),
            "messages",
        ),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_completion_tokens=-1), "max_completion_tokens"),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(temperature=2.5), "temperature"),
        (chat(temperature="hot"), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_p=1.5), "top_p"),
        (chat(n=0), "n"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (chat(stop=[1]), "stop"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(stream=True, stream_options=[]), "stream_options"),
        (chat(stream="yes"), "stream"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
        (chat(min_p=2), "min_p"),
        (chat(top_k=-2), "top_k"),
        (chat(min_tokens=5, max_tokens=2), "min_tokens"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(logit_bias={"x": 1}), "logit_bias"),
        (chat(logit_bias={"1": 101}), "logit_bias"),
        (chat(stop_token_ids=[-1]), "stop_token_ids"),
        (chat(response_format={"type": "xml"}), "response_format"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(best_of=3), "best_of"),
        (chat(seed=2**70), "seed"),
    ],
)
def test_chat_validation(body: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(body)
    assert info.value.param == param
    assert info.value.http_status == 400


def test_completion_prompts() -> None:
    def parse(prompt: Any, **fields: Any) -> Any:
        return parse_completion_request(
            json.dumps({"model": "m", "prompt": prompt, **fields}).encode()
        )

    assert parse("hi").prompts == ["hi"]
    assert parse(["a", "b"]).prompts == ["a", "b"]
    assert parse([1, 2, 3]).prompts == [[1, 2, 3]]
    assert parse([[1], [2, 3]]).prompts == [[1], [2, 3]]
    req = parse("x", echo=True, logprobs=None, max_tokens=3)
    assert req.echo and req.options.max_tokens == 3 and req.options.logprobs is None
    assert parse("x", logprobs=2).options.logprobs == 2
    for bad in ([], [1, "a"], [[1], []], [[-1]], 5, None, [True]):
        with pytest.raises(InvalidRequest) as info:
            parse(bad)
        assert info.value.param == "prompt"
    with pytest.raises(InvalidRequest):
        parse("x", echo=True, logprobs=1)
    with pytest.raises(InvalidRequest):
        parse("x", suffix="tail")


def _events(data: bytes) -> list[Any]:
    assert data.endswith(b"\n\n")
    out = []
    for block in data.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: ")
        payload = block[len(b"data: ") :]
        out.append(payload.decode() if payload == b"[DONE]" else orjson.loads(payload))
    return out


def test_chat_chunk_encoder() -> None:
    enc = ChatChunkEncoder("chatcmpl-1", 123, 'm"odel', include_usage=True)
    first, second, last = (
        _events(enc.delta(ChoiceDelta(0, 'He said "hi" 日本')))[0],
        _events(enc.delta(ChoiceDelta(0, "!")))[0],
        _events(enc.delta(ChoiceDelta(0, "", "length")))[0],
    )
    assert first["id"] == "chatcmpl-1" and first["model"] == 'm"odel'
    assert first["object"] == "chat.completion.chunk" and first["created"] == 123
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": 'He said "hi" 日本'}
    assert first["usage"] is None and first["choices"][0]["finish_reason"] is None
    assert second["choices"][0]["delta"] == {"content": "!"}
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    usage = _events(enc.usage(UsageInfo(3, 4, 2)))[0]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    lp = TokenLogprobInfo("a", b"a", -0.5, [("a", b"a", -0.5), ("b", b"b", -1.0)])
    event = _events(enc.delta(ChoiceDelta(1, "a", None, [lp])))[0]
    content = event["choices"][0]["logprobs"]["content"]
    assert content[0]["bytes"] == [97] and content[0]["top_logprobs"][1]["token"] == "b"
    no_usage = ChatChunkEncoder("c", 1, "m", include_usage=False)
    assert "usage" not in _events(no_usage.delta(ChoiceDelta(0, "x")))[0]


def test_text_chunk_encoder_and_results() -> None:
    enc = TextChunkEncoder("cmpl-1", 5, "m", include_usage=False)
    lp = TokenLogprobInfo("ab", b"ab", -0.1, [("ab", b"ab", -0.1)])
    ev = _events(enc.delta(ChoiceDelta(2, "ab", "stop", [lp, lp])))[0]
    assert ev["object"] == "text_completion"
    assert ev["choices"][0]["text"] == "ab" and ev["choices"][0]["index"] == 2
    assert ev["choices"][0]["logprobs"]["text_offset"] == [0, 2]
    assert ev["choices"][0]["logprobs"]["top_logprobs"] == [{"ab": -0.1}, {"ab": -0.1}]
    result = CompletionResult(
        "cmpl-1", 5, "m", "text", [ChoiceResult(0, "t", "stop")], UsageInfo(1, 1)
    )
    body = orjson.loads(encode_result(result))
    assert body["choices"][0] == {
        "index": 0,
        "text": "t",
        "logprobs": None,
        "finish_reason": "stop",
    }
    chat_result = CompletionResult(
        "c", 5, "m", "chat", [ChoiceResult(0, "t", "length", [lp])], UsageInfo(1, 1)
    )
    body = orjson.loads(encode_result(chat_result))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "t", "refusal": None}
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == "ab"
    error = _events(encode_error_event({"error": {"message": "x"}}))
    assert error == [{"error": {"message": "x"}}, "[DONE]"]
    assert DONE_EVENT == b"data: [DONE]\n\n"
