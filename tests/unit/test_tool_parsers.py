"""Tool-call parsers over real model output formats, unary and streamed at every boundary."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.frontend.dataplane import ToolCall
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.frontend.tool_parsers import (
    TOOL_PARSERS,
    JsonListParser,
    NamedToolCallStream,
    ToolCallStream,
    ToolParser,
    collect_calls,
    detect_tool_parser,
    get_tool_parser,
    parse_tool_calls,
)
from kvmesh.runtime.tinymodel import CHAT_TEMPLATE, create_tiny_model

pytestmark = pytest.mark.unit

TOOLS = [
    "get_weather",
    "get_time",
    "get_current_temperature",
    "get_temperature_date",
    "get_stock_fundamentals",
    "search",
    "f",
]

Expected = tuple[str, list[tuple[str, Any]]]
"""(content, [(name, arguments as JSON value)])"""

CASES: list[tuple[str, str, Expected]] = [
    # -- hermes (Hermes 2 Pro, Qwen 2.5, Qwen 3) ---------------------------------------------
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA"}}\n</tool_call>',
        ("", [("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
        '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
        (
            "",
            [
                (
                    "get_current_temperature",
                    {"location": "San Francisco, CA, USA", "unit": "celsius"},
                ),
                (
                    "get_temperature_date",
                    {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
                ),
            ],
        ),
    ),
    (
        "hermes",
        "I'll check the weather for you.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich 日本 😀", "q": "say \\"hi\\" {x}"}}'
        "\n</tool_call>",
        (
            "I'll check the weather for you.",
            [("get_weather", {"city": "Zürich 日本 😀", "q": 'say "hi" {x}'})],
        ),
    ),
    (  # Hermes 2 Pro writes the arguments before the name
        "hermes",
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
        "</tool_call>",
        ("", [("get_stock_fundamentals", {"symbol": "TSLA"})]),
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"filter": {"tags": ["a", "b"], '
        '"range": [1, 2.5]}, "note": "braces } and ] in strings", "n": null, "ok": true}}\n'
        "</tool_call>",
        (
            "",
            [
                (
                    "search",
                    {
                        "filter": {"tags": ["a", "b"], "range": [1, 2.5]},
                        "note": "braces } and ] in strings",
                        "n": None,
                        "ok": True,
                    },
                )
            ],
        ),
    ),
    (  # arguments given as a JSON string
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        ("", [("f", {"a": 1})]),
    ),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', ("", [("get_time", {})])),
    (
        "hermes",
        "The weather in Paris is sunny, 22 °C.",
        ("The weather in Paris is sunny, 22 °C.", []),
    ),
    ("hermes", "Use <b>bold</b> < tool_call >", ("Use <b>bold</b> < tool_call >", [])),
    (
        "hermes",
        "<tool_call>\nnot json at all\n</tool_call>",
        ("<tool_call>\nnot json at all\n</tool_call>", []),
    ),
    ("hermes", '<tool_call>\n{"na', ('<tool_call>\n{"na', [])),  # truncated before the name
    ("hermes", '<tool_call>\n{"name": 3}', ('<tool_call>\n{"name": 3}', [])),
    ("hermes", "Trailing space stays   ", ("Trailing space stays   ", [])),
    # -- llama3_json (Llama 3.1 / 3.2 / 3.3) -----------------------------------------------
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        ("", [("get_weather", {"city": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "search", "parameters": {"query": "kvmesh"}}',
        ("", [("search", {"query": "kvmesh"})]),
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        ("", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ),
    ("llama3_json", '{"answer": 42}', ('{"answer": 42}', [])),
    ("llama3_json", '{"name": "Bob", "age": 3}', ('{"name": "Bob", "age": 3}', [])),
    ("llama3_json", "  The capital is Paris.", ("  The capital is Paris.", [])),
    ("llama3_json", "<|python_ta", ("<|python_ta", [])),
    # -- mistral -------------------------------------------------------------------------------
    (  # v3 tokenizer (Mistral 7B v0.3, Mixtral): a JSON list
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}, {"name": "get_time", "arguments": {}}]',
        (
            "",
            [
                ("get_weather", {"location": "Paris, France", "format": "celsius"}),
                ("get_time", {}),
            ],
        ),
    ),
    (  # v11+ tokenizers (Mistral Small 3.2, Magistral, Devstral)
        "mistral",
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"location": "Paris, France"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        (
            "Let me check.",
            [("get_weather", {"location": "Paris, France"}), ("get_time", {"tz": "CET"})],
        ),
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"location": "Oslo"}',
        ("", [("get_weather", {"location": "Oslo"})]),
    ),
    ("mistral", "Bonjour ! [TOOL_CALL", ("Bonjour ! [TOOL_CALL", [])),
    ("mistral", "[TOOL_CALLS]not a name!", ("[TOOL_CALLS]not a name!", [])),
    # -- pythonic (Llama 3.2, Llama 4) -------------------------------------------------------
    (
        "pythonic",
        "[get_weather(city='San Francisco', metric='celsius'), get_time(timezone=\"PST\")]",
        (
            "",
            [
                ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
                ("get_time", {"timezone": "PST"}),
            ],
        ),
    ),
    (
        "pythonic",
        '<|python_start|>[search(query="a (b) [c]", limit=3, exact=True, tags=["x", "y"], '
        'opts={"k": None})]<|python_end|>',
        (
            "",
            [
                (
                    "search",
                    {
                        "query": "a (b) [c]",
                        "limit": 3,
                        "exact": True,
                        "tags": ["x", "y"],
                        "opts": {"k": None},
                    },
                )
            ],
        ),
    ),
    ("pythonic", "[get_weather(city=foo)]", ("[get_weather(city=foo)]", [])),
    ("pythonic", "[1, 2, 3] are numbers", ("[1, 2, 3] are numbers", [])),
    ("pythonic", "Sure! Here you go.", ("Sure! Here you go.", [])),
    ("pythonic", "[get_weather(city='Par", ("[get_weather(city='Par", [])),
    # -- qwen3_coder (Qwen3-Coder) --------------------------------------------------------------
    (
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=timezone>\nPST\n</parameter>\n"
        "</function>\n</tool_call>",
        (
            "I'll check.",
            [
                ("get_weather", {"city": "San Francisco", "days": 3}),
                ("get_time", {"timezone": "PST"}),
            ],
        ),
    ),
    (
        "qwen3_coder",
        '<tool_call>\n<function=search>\n<parameter=opts>\n{"k": [1, true]}\n</parameter>\n'
        "<parameter=query>\nline one\nline two\n</parameter>\n</function>\n</tool_call>",
        ("", [("search", {"opts": {"k": [1, True]}, "query": "line one\nline two"})]),
    ),
    ("qwen3_coder", "Plain answer.", ("Plain answer.", [])),
    ("qwen3_coder", "<tool_call>oops</tool_call>", ("<tool_call>oops</tool_call>", [])),
    # -- glm45 (GLM-4.5 / 4.6) ---------------------------------------------------------------
    (
        "glm45",
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
        "<tool_call>get_time\n</tool_call>",
        ("Checking.", [("get_weather", {"city": "Beijing", "days": 2}), ("get_time", {})]),
    ),
    ("glm45", "No tools needed.", ("No tools needed.", [])),
    # -- deepseek_v3 (DeepSeek V3 / R1) ----------------------------------------------------------
    (
        "deepseek_v3",
        "Let me look.<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin"
        "\uff5c>function<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<\uff5ctool\u2581call\u2581end\uff5c>'
        "<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>get_time\n"
        "```json\n{}\n```<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end"
        "\uff5c>",
        ("Let me look.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ),
    ("deepseek_v3", "Just text.", ("Just text.", [])),
    # -- deepseek_v31 (DeepSeek V3.1) ------------------------------------------------------------
    (
        "deepseek_v31",
        "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>"
        'get_weather<\uff5ctool\u2581sep\uff5c>{"city": "Paris"}<\uff5ctool\u2581call\u2581end'
        "\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>",
        ("", [("get_weather", {"city": "Paris"})]),
    ),
    # -- kimi_k2 -------------------------------------------------------------------------------
    (
        "kimi_k2",
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
        'functions.get_time:1<|tool_call_argument_begin|>{"timezone": "PST"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        ("Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "PST"})]),
    ),
    ("kimi_k2", "Nothing to call.", ("Nothing to call.", [])),
    # -- gpt_oss (harmony) ---------------------------------------------------------------------
    (
        "gpt_oss",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|>",
        ("", [("get_weather", {"city": "Paris"})]),
    ),
    (
        "gpt_oss",
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|><|call|>",
        ("", [("get_time", {})]),
    ),
    (
        "gpt_oss",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello there!<|return|>",
        ("Hello there!", []),
    ),
    ("gpt_oss", "Plain text.", ("Plain text.", [])),
]


def _parser(name: str) -> ToolParser:
    return get_tool_parser(name)(TOOLS)


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStream(parser, new_id=lambda: "call_x")
    content: list[str] = []
    deltas = []
    for piece in pieces:
        text, calls = stream.feed(piece)
        content.append(text)
        deltas += calls
    text, calls = stream.finish()
    content.append(text)
    deltas += calls
    # Every call's first delta carries id and name, later ones only arguments.
    seen: set[int] = set()
    for d in deltas:
        assert (d.index not in seen) == (d.name is not None) == (d.id is not None)
        seen.add(d.index)
    return "".join(content), collect_calls(deltas)


def _check(got: tuple[str, list[ToolCall]], expected: Expected) -> None:
    content, calls = got
    assert content == expected[0]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected[1]


@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_unary(name: str, text: str, expected: Expected) -> None:
    _check(parse_tool_calls(_parser(name), text), expected)


@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_every_split_gives_the_unary_result(name: str, text: str, expected: Expected) -> None:
    parser = _parser(name)
    unary = parse_tool_calls(parser, text)
    want = (unary[0], [(c.name, c.arguments) for c in unary[1]])

    def same(pieces: list[str]) -> None:
        content, calls = _stream(parser, pieces)
        assert (content, [(c.name, c.arguments) for c in calls]) == want, pieces

    same(list(text))  # one character at a time
    for k in range(len(text) + 1):
        same([text[:k], text[k:]])
    step = max(1, len(text) // 40)  # all three-piece splits on a grid
    for i, j in itertools.combinations(range(0, len(text) + 1, step), 2):
        same([text[:i], text[i:j], text[j:]])


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = create_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")
    return Tokenizer.from_pretrained(path)


@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_token_by_token(tok: Tokenizer, name: str, text: str, expected: Expected) -> None:
    """As the gateway sees it: detokenized pieces of a byte-level BPE tokenization."""
    detok = tok.detokenizer(skip_special_tokens=False)
    pieces = [detok.step([t]) for t in tok.encode(text)] + [detok.flush()]
    assert "".join(pieces) == text
    _check(_stream(_parser(name), pieces), expected)


def test_arguments_stream_incrementally() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    stream = ToolCallStream(_parser("hermes"), new_id=lambda: "call_1")
    fragments = []
    for ch in text:
        fragments += stream.feed(ch)[1]
    first, *rest = fragments
    assert (first.id, first.name, first.index) == ("call_1", "get_weather", 0)
    assert len(rest) > 5 and all(f.name is None and f.id is None for f in rest)
    assert first.arguments + "".join(f.arguments for f in rest) == '{"city": "Paris"}'
    assert stream.called


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"a": 1}[TOOL_CALLS]get_time[ARGS]{}'
    content, calls = parse_tool_calls(_parser("mistral"), text, parallel_tool_calls=False)
    assert content == "" and [c.name for c in calls] == ["get_weather"]


def test_ids() -> None:
    _, calls = parse_tool_calls(_parser("hermes"), '<tool_call>{"name": "f"}</tool_call>')
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    _, calls = parse_tool_calls(_parser("mistral"), "[TOOL_CALLS]f[ARGS]{}")
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()  # Mistral templates require it


def test_json_list_for_required_tool_choice() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "f", "parameters": {}}]'
    )
    _check(
        parse_tool_calls(JsonListParser(), text),
        ("", [("get_weather", {"city": "Oslo"}), ("f", {})]),
    )
    for k in range(len(text) + 1):
        assert _stream(JsonListParser(), [text[:k], text[k:]])[1] == [
            ToolCall("call_x", "get_weather", '{"city": "Oslo"}'),
            ToolCall("call_x", "f", "{}"),
        ]


def test_named_tool_choice_stream() -> None:
    stream = NamedToolCallStream("get_weather", new_id=lambda: "call_n")
    deltas = stream.feed('{"city": ')[1] + stream.feed('"Oslo"}')[1] + stream.finish()[1]
    assert collect_calls(deltas) == [ToolCall("call_n", "get_weather", '{"city": "Oslo"}')]
    empty = NamedToolCallStream("f", new_id=lambda: "c")
    assert collect_calls(empty.finish()[1]) == [ToolCall("c", "f", "")]


def test_lookup_and_detection() -> None:
    assert set(TOOL_PARSERS) == {
        "hermes",
        "llama3_json",
        "mistral",
        "pythonic",
        "qwen3_coder",
        "glm45",
        "deepseek_v3",
        "deepseek_v31",
        "kimi_k2",
        "gpt_oss",
    }
    assert get_tool_parser("qwen3") is get_tool_parser("hermes")
    assert get_tool_parser("glm4_moe") is get_tool_parser("glm45")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")
    assert detect_tool_parser(CHAT_TEMPLATE) == "llama3_json"  # the tiny model: Llama 3 style
    assert detect_tool_parser("... <tool_call>\\n{{ tool_call | tojson }} ...") == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("[func_name1(params_name1=params_value1...)]") == "pythonic"
    qwen3_coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>\n{{ v }}"
    assert detect_tool_parser(qwen3_coder) == "qwen3_coder"
    glm = "<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>"
    assert detect_tool_parser(glm) == "glm45"
    ds_begin = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
    assert detect_tool_parser(ds_begin + "function ... ```json") == "deepseek_v3"
    assert detect_tool_parser(ds_begin + "{{ name }}") == "deepseek_v31"
    assert detect_tool_parser("<|tool_calls_section_begin|>") == "kimi_k2"
    assert detect_tool_parser("<|start|>assistant<|channel|>final<|message|>") == "gpt_oss"
    assert detect_tool_parser("{{ messages }}") is None
    assert detect_tool_parser(None) is None
