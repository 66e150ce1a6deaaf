"""The offline tiny Llama model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime.tinymodel import BOS_TOKEN, EOS_TOKEN, EOT_TOKEN, MODEL_FILES, create_tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


def test_files_and_config(model_dir: Path) -> None:
    for name in MODEL_FILES:
        assert (model_dir / name).is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"]) == (64, 128)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (2, 4)
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
    assert config["max_position_embeddings"] == 4096
    assert config["torch_dtype"] == "float32"

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"] == 4096
    assert config["bos_token_id"] == tok.token_to_id(BOS_TOKEN)
    assert config["eos_token_id"] == [tok.token_to_id(EOS_TOKEN), tok.token_to_id(EOT_TOKEN)]
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]

    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == BOS_TOKEN
    assert tok_config["eos_token"] == EOT_TOKEN
    assert tok_config["pad_token"] == EOS_TOKEN
    assert "<|start_header_id|>" in tok_config["chat_template"]
    for token_id, added in tok_config["added_tokens_decoder"].items():
        assert tok.id_to_token(int(token_id)) == added["content"]


def test_tokenizer_roundtrips_multibyte_text(model_dir: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "Un café à Zürich 😀, 日本語のテキスト and 🚀 emoji 👍🏽."
    ids = tok.encode(text).ids
    assert ids[0] == tok.token_to_id(BOS_TOKEN)  # the post-processor adds BOS, like Llama 3
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Some emoji must be spread over several byte-level tokens (exercises detokenization).
    emoji_ids = tok.encode("🚀", add_special_tokens=False).ids
    assert len(emoji_ids) >= 2


def test_chat_template_renders_all_roles(model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(model_dir)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    assert text.startswith(BOS_TOKEN) and text.count(BOS_TOKEN) == 1
    assert "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" in text
    assert '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18C<|eot_id|>" in text
    assert '"name": "weather"' in text  # tools listed
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=False)
    assert no_prompt.endswith("<|eot_id|>")


def test_deterministic_and_idempotent(model_dir: Path, tmp_path: Path) -> None:
    other = create_tiny_model(tmp_path / "again")
    for name in MODEL_FILES:
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name
    stamps = {name: (other / name).stat().st_mtime_ns for name in MODEL_FILES}
    assert create_tiny_model(other) == other  # a complete directory is left as it is
    assert {name: (other / name).stat().st_mtime_ns for name in MODEL_FILES} == stamps


def test_other_vocab_size(tmp_path: Path) -> None:
    path = create_tiny_model(tmp_path / "m", vocab_size=1024)
    config = json.loads((path / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert config["vocab_size"] == tok.get_vocab_size() == 1024
    with pytest.raises(ValueError, match="vocab_size"):
        create_tiny_model(tmp_path / "small", vocab_size=100)
