"""Every validation error of the OpenAI request bodies, with its exact message, `param` and status.

The expected values (openai_validation_errors.jsonl) were recorded from the hand-written parser
these bodies were validated by before they became msgspec Structs (kvmesh.frontend.protocol), so
they pin the contract clients see: the same message for the same mistake. Bodies with several
mistakes report the first one the checks meet (kvmesh.frontend.decoding); a few lines of the
corpus have several and pin that order. Fields a request does not use stay unchecked, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmesh.frontend.protocol import (
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
)
from kvmesh.runtime.errors import InvalidRequest

pytestmark = pytest.mark.unit

PARSERS: dict[str, Callable[[bytes], Any]] = {
    "chat": parse_chat_request,
    "completions": parse_completion_request,
    "embeddings": parse_embedding_request,
}
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]

CORPUS = Path(__file__).with_name("openai_validation_errors.jsonl")
ERRORS = [json.loads(line) for line in CORPUS.read_text().splitlines()]
"""{endpoint, body, status, param, message}: one bad request per line."""


@pytest.mark.parametrize("case", ERRORS, ids=lambda c: f"{c['endpoint']}:{c['message'][:40]}")
def test_error_message(case: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        PARSERS[case["endpoint"]](json.dumps(case["body"]).encode())
    error = info.value
    assert (error.http_status, error.param, error.message) == (
        case["status"],
        case["param"],
        case["message"],
    )


def chat(**fields: Any) -> Any:
    return parse_chat_request(json.dumps({"model": "m", "messages": MSG, **fields}).encode())


def test_fields_a_request_does_not_use_stay_unchecked() -> None:
    assert chat(tools=TOOLS, functions=5).tools == TOOLS
    assert chat(tools=TOOLS, tool_choice="auto", function_call=5).tool_choice.mode == "auto"
    assert chat(response_format={"type": "text", "json_schema": 5}).options.guided is None
    assert chat(max_tokens=0, max_completion_tokens=3).options.max_tokens == 3
    message = {"role": "assistant", "content": "x", "reasoning_content": 5, "reasoning": "r"}
    assert chat(messages=[message]).messages[0].reasoning_content is None
    part = {"type": "text", "text": "t", "refusal": 5}
    assert chat(messages=[{"role": "user", "content": [part]}]).messages[0].content == "t"
    embed = parse_embedding_request(b'{"model": "m", "input": "x", "encoding_format": ""}')
    assert embed.encoding_format == "float"
