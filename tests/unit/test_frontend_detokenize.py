"""Incremental detokenization (multi-byte characters at every split point) and stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from kvmesh.frontend.detokenize import HAS_DECODE_STREAM, IncrementalDetokenizer, StopStringMatcher
from kvmesh.runtime.tinymodel import create_tiny_model

pytestmark = pytest.mark.unit

TEXTS = [
    "🚀",
    "😀😂👍",
    "👍🏽 thumbs",
    "👨‍👩‍👧 family",
    "日本語のテキスト",
    "中文文本：你好",  # noqa: RUF001
    "café crème à Zürich",
    "Привет, мир",
    "a 🚀 b 日本 c é d",
    "plain ascii text only",
    "🇫🇷🤖✨ end",
]
MODES = [False, True] if HAS_DECODE_STREAM else [False]


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> tokenizers.Tokenizer:
    path: Path = create_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def _ids(raw: tokenizers.Tokenizer, text: str) -> list[int]:
    return list(raw.encode(text, add_special_tokens=False).ids)


def _run(
    raw: tokenizers.Tokenizer, steps: list[list[int]], fast: bool, prompt: list[int] | None = None
) -> list[str]:
    detok = IncrementalDetokenizer(raw, prompt_ids=prompt or (), use_decode_stream=fast)
    pieces = [detok.step(step) for step in steps]
    pieces.append(detok.flush())
    return pieces


def _check_pieces(pieces: list[str], text: str) -> None:
    assert "".join(pieces) == text
    for piece in pieces:
        assert "\ufffd" not in piece, pieces  # never half a character


@pytest.mark.parametrize("fast", MODES)
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(raw: tokenizers.Tokenizer, text: str, fast: bool) -> None:
    ids = _ids(raw, text)
    _check_pieces(_run(raw, [[i] for i in ids], fast), text)


@pytest.mark.parametrize("fast", MODES)
@pytest.mark.parametrize("text", TEXTS)
def test_every_split_point(raw: tokenizers.Tokenizer, text: str, fast: bool) -> None:
    """Two steps, split at every position, and three steps around every pair of positions."""
    ids = _ids(raw, text)
    for k in range(len(ids) + 1):
        _check_pieces(_run(raw, [ids[:k], ids[k:]], fast), text)
        for j in range(k, len(ids) + 1):
            _check_pieces(_run(raw, [ids[:k], ids[k:j], ids[j:]], fast), text)


@pytest.mark.parametrize("fast", MODES)
def test_multibyte_character_is_held_until_complete(raw: tokenizers.Tokenizer, fast: bool) -> None:
    ids = _ids(raw, "🚀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(raw, use_decode_stream=fast)
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == "🚀"
    assert detok.flush() == ""


@pytest.mark.parametrize("fast", MODES)
def test_unfinished_character_is_flushed_as_replacement(
    raw: tokenizers.Tokenizer, fast: bool
) -> None:
    emoji = _ids(raw, "😀")
    assert len(emoji) >= 2
    ids = _ids(raw, "ok") + emoji[:-1]
    detok = IncrementalDetokenizer(raw, use_decode_stream=fast)
    assert "".join(detok.step([i]) for i in ids) == "ok"
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


@pytest.mark.parametrize("fast", MODES)
def test_prompt_context_is_not_emitted(raw: tokenizers.Tokenizer, fast: bool) -> None:
    prompt = _ids(raw, "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = _ids(raw, "Hello 日本 world")
    pieces = _run(raw, [[i] for i in ids], fast, prompt)
    _check_pieces(pieces, "Hello 日本 world")


@pytest.mark.parametrize("fast", MODES)
def test_special_tokens_are_skipped(raw: tokenizers.Tokenizer, fast: bool) -> None:
    eot = raw.token_to_id("<|eot_id|>")
    assert eot is not None
    ids = [*_ids(raw, "hi"), eot, *_ids(raw, " there")]
    assert "".join(_run(raw, [[i] for i in ids], fast)) == "hi there"
    detok = IncrementalDetokenizer(raw, skip_special_tokens=False, use_decode_stream=fast)
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == "hi<|eot_id|> there"


# -- stop strings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunks", "stops", "emitted", "matched"),
    [
        (["Hello world"], ["world"], ["Hello "], True),
        (["Hel", "lo wo", "rld!"], ["world"], ["Hel", "lo ", ""], True),
        (["abc", "def"], ["xyz"], ["abc", "def"], False),
        (["ab", "ab", "c"], ["abc"], ["", "ab", ""], True),
        (["a", "b"], ["abc"], ["", ""], False),  # held back, released by flush
        (["x STOP y"], ["STOP", "x"], [""], True),  # earliest match wins
        (["one ", "two three"], ["three", "two"], ["one ", ""], True),
        (["日本", "語"], ["本語"], ["日", ""], True),
        (["", "end"], ["nd"], ["", "e"], True),
    ],
)
def test_stop_strings(
    chunks: list[str], stops: list[str], emitted: list[str], matched: bool
) -> None:
    matcher = StopStringMatcher(stops)
    out: list[str] = []
    hit = False
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit:
            break
    assert out == emitted
    assert hit is matched
    if not matched:
        assert "".join(out) + matcher.flush() == "".join(chunks)


def test_stop_string_never_emitted_at_any_split() -> None:
    text = "The quick brown fox jumps over the lazy dog"
    stop = "fox jumps"
    for k in range(1, len(text)):
        for j in range(k, len(text)):
            matcher = StopStringMatcher([stop, "unused"])
            out = ""
            for chunk in (text[:k], text[k:j], text[j:]):
                piece, hit = matcher.feed(chunk)
                out += piece
                if hit:
                    break
            assert hit and out == "The quick brown "


@pytest.mark.parametrize("fast", MODES)
def test_prompt_ending_inside_a_character_does_not_leak_prompt_text(
    raw: tokenizers.Tokenizer, fast: bool
) -> None:
    """Token-id prompts can end in the middle of a multi-byte character; the completion must
    not repeat prompt text (the orphaned continuation bytes decode as U+FFFD)."""
    ids = _ids(raw, "x 😀😂 señor niño")
    cuts = [c for c in range(1, len(ids)) if raw.decode(ids[:c]).endswith("\ufffd")]
    assert cuts, "the text must split a character somewhere"
    for cut in cuts:
        pieces = _run(raw, [[t] for t in ids[cut:]], fast, prompt=ids[:cut])
        text = "".join(pieces)
        assert text.endswith("señor niño")
        assert "x" not in text, (cut, text)  # no prompt text re-emitted
        full = raw.decode(ids)
        assert len(text) <= len(full) - len(raw.decode(ids[:cut]).rstrip("\ufffd")) + 1
