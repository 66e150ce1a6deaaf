"""Reasoning parsers over real `<think>` model outputs, unary and streamed at every boundary."""

from __future__ import annotations

import itertools

import pytest

from kvmesh.frontend.reasoning import (
    REASONING_PARSERS,
    detect_reasoning_parser,
    get_reasoning_parser,
    split_reasoning,
)
from kvmesh.runtime.tinymodel import CHAT_TEMPLATE

pytestmark = pytest.mark.unit

QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
BAR = "\uff5c"  # DeepSeek's special tokens use a fullwidth vertical line
R1_PROMPT = f"<{BAR}User{BAR}>What is 2+2?<{BAR}Assistant{BAR}><think>\n"
R1_BARE = f"<{BAR}Assistant{BAR}>"

CASES: list[tuple[str, str, str, tuple[str, str]]] = [
    # (parser, rendered prompt, model output, (reasoning, content))
    (
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
        ("The user asks 2+2. That is 4.", "The answer is **4**."),
    ),
    ("qwen3", QWEN3_NO_THINK, "The answer is 4.", ("", "The answer is 4.")),
    ("qwen3", QWEN3_NO_THINK, "<think> is a tag.", ("", "<think> is a tag.")),
    ("qwen3", QWEN3_PROMPT, "Plain answer, no thinking.", ("", "Plain answer, no thinking.")),
    (
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nStill thinking when max_tokens hit",
        ("Still thinking when max_tokens hit", ""),
    ),
    ("qwen3", QWEN3_PROMPT, "<think></think>Direct.", ("", "Direct.")),
    ("qwen3", QWEN3_PROMPT, "  <thi", ("", "  <thi")),
    (
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nCompare a</b and x < y </thinking> no.\n</think>\nDone </think> twice.",
        ("Compare a</b and x < y </thinking> no.", "Done </think> twice."),
    ),
    (  # DeepSeek-R1's template opens the block in the prompt
        "deepseek_r1",
        R1_PROMPT,
        "Okay, 2+2 is basic arithmetic.\n</think>\n\n2 + 2 = 4 😀",
        ("Okay, 2+2 is basic arithmetic.", "2 + 2 = 4 😀"),
    ),
    (  # older R1 templates: the model writes the opening tag itself
        "deepseek_r1",
        R1_BARE,
        "<think>\nHmm.\n</think>\n\n4",
        ("Hmm.", "4"),
    ),
    (  # R1 without any opening tag: reasoning until </think>
        "deepseek_r1",
        R1_BARE,
        "Hmm, 日本語で考える.</think>4",
        ("Hmm, 日本語で考える.", "4"),
    ),
    ("deepseek_r1", "", "Never closed", ("Never closed", "")),
    (
        "qwen3",
        R1_PROMPT,
        "Reasoning from the prompt's tag</think>Answer",
        ("Reasoning from the prompt's tag", "Answer"),
    ),
    # gpt-oss (harmony): the analysis channel is the reasoning, final the content; a message
    # to a tool goes on to the gpt_oss tool parser as it is.
    (
        "gpt_oss",
        "",
        "<|channel|>analysis<|message|>User says hi. Reply.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello! <How> are you?<|return|>",
        ("User says hi. Reply.", "Hello! <How> are you?"),
    ),
    (
        "gpt_oss",
        "",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"c": 1}'
        "<|call|>",
        (
            "Need the weather.",
            "<|start|>assistant<|channel|>commentary to=functions.get_weather "
            '<|constrain|>json<|message|>{"c": 1}<|call|>',
        ),
    ),
    (
        "gpt_oss",
        "",
        "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis"
        "<|message|>Two, cut off",
        ("One.\nTwo, cut off", ""),
    ),
]


@pytest.mark.parametrize(("name", "prompt", "text", "expected"), CASES)
def test_unary(name: str, prompt: str, text: str, expected: tuple[str, str]) -> None:
    assert split_reasoning(get_reasoning_parser(name), text, prompt) == expected


@pytest.mark.parametrize(("name", "prompt", "text", "expected"), CASES)
def test_every_split(name: str, prompt: str, text: str, expected: tuple[str, str]) -> None:
    parser = get_reasoning_parser(name)

    def run(pieces: list[str]) -> tuple[str, str]:
        stream = parser.stream(prompt)
        out = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert all("</think>" not in reasoning for reasoning, _ in out)
        return "".join(r for r, _ in out), "".join(c for _, c in out)

    assert run(list(text)) == expected
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert run([text[:i], text[i:j], text[j:]]) == expected, (i, j)


def test_streaming_is_incremental() -> None:
    stream = get_reasoning_parser("qwen3").stream(QWEN3_PROMPT)
    assert stream.feed("<think>\nStep one") == ("Step one", "")
    assert stream.in_reasoning
    assert stream.feed(", step two\n</thi") == (", step two", "")
    assert stream.feed("nk>\n\nAns") == ("", "Ans")
    assert not stream.in_reasoning
    assert stream.feed("wer") == ("", "wer")
    assert stream.finish() == ("", "")


def test_lookup_and_detection() -> None:
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "gpt_oss"}
    assert REASONING_PARSERS["gpt_oss"].needs_special_tokens
    assert detect_reasoning_parser("{{ '<|channel|>analysis<|message|>' }}") == "gpt_oss"
    assert get_reasoning_parser("deepseek") is REASONING_PARSERS["deepseek_r1"]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")
    assert detect_reasoning_parser("{% if x %}<think>\n{{ r }}\n</think>{% endif %}") == "qwen3"
    assert detect_reasoning_parser(CHAT_TEMPLATE) is None
    assert detect_reasoning_parser(None) is None
