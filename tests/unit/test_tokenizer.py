"""Tokenizer loading, chat templates, the prefix-chunk cache and the registry."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.frontend.tokencache import ChunkedEncoder, supports_chunking
from kvmesh.frontend.tokenizer import Tokenizer, TokenizerRegistry
from kvmesh.runtime.errors import InvalidRequest, Unavailable
from kvmesh.runtime.tinymodel import BOS_TOKEN, create_tiny_model
from kvmesh.runtime.types import ModelInfo

pytestmark = pytest.mark.unit

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def spec(model_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((model_dir / "tokenizer.json").read_text())
    return data


def _variant(spec: dict[str, Any], **changes: Any) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(json.dumps({**spec, **changes}))


def _llama3_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        **spec,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": LLAMA3_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
    }


def test_loads_model_metadata(tok: Tokenizer) -> None:
    assert tok.context_length == 4096
    assert tok.vocab_size == 4096
    raw = tok.raw
    assert tok.eos_token_ids == (raw.token_to_id("<|end_of_text|>"), raw.token_to_id("<|eot_id|>"))
    assert tok.bos_token_id == raw.token_to_id(BOS_TOKEN)
    assert tok.special_tokens["bos_token"] == BOS_TOKEN
    assert tok.has_chat_template
    assert tok.chunk_cache_enabled


def test_chat_prompt_has_exactly_one_bos(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode(text)
    assert tok.bos_token_id is not None
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    # Completions prompts get BOS from the post-processor instead.
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id
    assert tok.bos_token_id not in tok.encode("hi")


def test_template_errors_are_invalid_requests(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="Unsupported role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def _copy_model(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    return dest


def test_separate_template_files_and_named_templates(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_model(model_dir, tmp_path / "m")
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
        "{{ strftime_now('%Y')[:0] }}{{ {'k': 'é'} | tojson }}"
    )
    tok = Tokenizer.from_pretrained(path)
    out = tok.apply_chat_template([{"role": "user", "content": " hi "}])
    assert out == '[user]hi[assistant]{"k": "é"}'

    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function"}]) == "T1"

    (path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert Tokenizer.from_pretrained(path).apply_chat_template(msgs) == "J"


def test_sandbox_blocks_unsafe_templates(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_model(model_dir, tmp_path / "m")
    (path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    tok = Tokenizer.from_pretrained(path)
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_metadata_fallbacks(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_model(model_dir, tmp_path / "m")
    (path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = 7
    del config["max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(path)
    assert tok.eos_token_ids == (7,)
    assert tok.context_length == 4096  # tokenizer_config model_max_length
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(path)


def test_no_template(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_model(model_dir, tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(path)
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_token_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")
    assert b"".join(tok.token_bytes(i) for i in ids) == "🚀".encode()
    assert tok.token_str(tok.encode("Hello")[0]) == "Hello"
    assert tok.token_bytes(tok.bos_token_id or 0) == BOS_TOKEN.encode()
    assert "\ufffd" in tok.token_str(ids[0])  # a partial character


# -- exact prefix-chunk cache --------------------------------------------------------------

_ALPHABET = st.sampled_from(
    [*"abcdefghijXYZ      0123'.,!?-\n\t_", "é", "日本", "😀", "  ", "'s", "<|eot_id|>"]
)
_TEXTS = st.lists(_ALPHABET, min_size=0, max_size=300).map("".join)


@pytest.fixture(scope="module")
def byte_level_tokenizers(spec: dict[str, Any]) -> list[tokenizers.Tokenizer]:
    """The tiny model's tokenizer (GPT-2 regex) and a Llama-3-regex variant of it."""
    return [_variant(spec), tokenizers.Tokenizer.from_str(json.dumps(_llama3_spec(spec)))]


@settings(max_examples=150, deadline=None)
@given(text=_TEXTS, chunk=st.integers(min_value=1, max_value=24))
def test_chunked_encoding_is_exact(
    byte_level_tokenizers: list[tokenizers.Tokenizer], text: str, chunk: int
) -> None:
    for tokenizer in byte_level_tokenizers:

        def plain(s: str, t: tokenizers.Tokenizer = tokenizer) -> list[int]:
            return list(t.encode(s, add_special_tokens=False).ids)

        encoder = ChunkedEncoder(plain, chunk_chars=chunk)
        assert encoder.enabled
        assert encoder.encode(text) == plain(text)
        assert encoder.encode(text) == plain(text)  # again, from the cache


def test_chunk_cache_is_used_and_bounded(tok: Tokenizer) -> None:
    calls: list[str] = []

    def plain(s: str) -> list[int]:
        calls.append(s)
        return tok.encode(s, add_special_tokens=False)

    encoder = ChunkedEncoder(plain, chunk_chars=16, max_entries=4, self_test=False)
    prefix = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi"
    first = encoder.encode(prefix + " question one")
    assert len(calls) > 2
    calls.clear()
    second = encoder.encode(prefix + " question two")
    head = plain(prefix)
    calls.clear()
    assert first[: len(head)] == second[: len(head)] == head
    encoder.encode(prefix + " question three")
    assert len(calls) == 1 and len(calls[0]) < 40  # only the tail was tokenized
    assert len(encoder) <= 4
    assert second == plain(prefix + " question two")


def test_chunking_refused_when_not_provably_exact(spec: dict[str, Any]) -> None:
    assert supports_chunking(spec)
    assert supports_chunking(_llama3_spec(spec))
    assert not supports_chunking({**spec, "normalizer": {"type": "NFC"}})
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}
    assert not supports_chunking({**spec, "pre_tokenizer": metaspace})
    other_split = _llama3_spec(spec)
    other_split["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"
    assert not supports_chunking(other_split)
    added = dict(spec["added_tokens"][0], content="hello world", id=9999)
    assert not supports_chunking({**spec, "added_tokens": [*spec["added_tokens"], added]})
    stripping = dict(spec["added_tokens"][0], rstrip=True)
    assert not supports_chunking({**spec, "added_tokens": [stripping]})
    assert not supports_chunking({**spec, "model": {**spec["model"], "type": "WordPiece"}})


def test_tokenizer_without_cache_gives_same_ids(model_dir: Path, tok: Tokenizer) -> None:
    plain = Tokenizer.from_pretrained(model_dir, chunk_cache_entries=0)
    assert not plain.chunk_cache_enabled
    text = tok.apply_chat_template(
        [{"role": "user", "content": "lorem ipsum dolor sit amet " * 40 + "question?"}]
    )
    assert tok.encode(text) == plain.encode(text) == tok.encode(text)


# -- registry ------------------------------------------------------------------------------


def _info(name: str, path: str) -> ModelInfo:
    return ModelInfo(name, "fake", 16, 100, 4096, model_path=path)


async def test_registry_loads_once_from_model_path(model_dir: Path, tok: Tokenizer) -> None:
    registry = TokenizerRegistry({"pre": tok})
    assert registry.lookup("pre") is tok
    assert registry.lookup("lazy") is None
    loaded = await registry.load(_info("lazy", str(model_dir)))
    assert registry.lookup("lazy") is loaded
    assert await registry.load(_info("lazy", "/nonexistent")) is loaded
    with pytest.raises(Unavailable):
        await registry.load(_info("nopath", ""))
    with pytest.raises(Unavailable, match="cannot load"):
        await registry.load(_info("broken", "/nonexistent"))
