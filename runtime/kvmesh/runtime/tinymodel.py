"""A tiny, offline, Hugging Face-format Llama model directory (tokenizer + config, no weights).

`create_tiny_model(path)` trains a byte-level BPE tokenizer on a small built-in corpus (English,
accented Latin, Cyrillic, Greek, CJK, Korean, emoji, code) with the `tokenizers` library only,
and writes what `transformers.AutoTokenizer` / `AutoConfig` and the kvmesh gateway read:

- tokenizer.json: byte-level BPE, Llama-3 special tokens at the end of the vocabulary, a
  post-processor that prepends `<|begin_of_text|>` (like Llama 3), `<|reserved_special_token_N|>`
  fillers so that the vocabulary has exactly `vocab_size` entries;
- tokenizer_config.json: bos/eos/pad tokens, added_tokens_decoder, a Llama-3-style Jinja
  chat template (system/developer, user, assistant with tool calls, tool results, tools list,
  add_generation_prompt), model_max_length;
- config.json: a LlamaForCausalLM config (hidden 64, 2 layers, 4 heads, 2 KV heads, context
  4096, float32), consistent enough that transformers can instantiate random weights for it;
- generation_config.json: bos/eos ids.

The output is byte-for-byte deterministic. If `path` already holds all four files, nothing is
written (idempotent); files are written atomically so concurrent creators do not see halves.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "EOT_TOKEN",
    "IMAGE_CHAT_TEMPLATE",
    "IMAGE_TOKEN",
    "MODEL_FILES",
    "SPECIAL_TOKENS",
    "create_tiny_model",
]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
"""End of a document (also the pad token)."""
EOT_TOKEN = "<|eot_id|>"
"""End of a chat turn: the chat model's EOS."""
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
    "<|python_tag|>",
)
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")
"""The files a complete tiny model directory holds (config.json is written last)."""

CONTEXT_LENGTH = 4096

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools is not none and tools | length > 0 %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Environment: ipython\\nYou can call these functions. To call one, reply with a JSON'"
    ' + \' object {"name": function name, "parameters": arguments}.\\n\\n\' }}\n'
    "{%- for tool in tools %}\n"
    "{{- tool | tojson }}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- set role = message['role'] %}\n"
    "{%- if role == 'developer' %}{%- set role = 'system' %}{%- endif %}\n"
    "{%- if role not in ['system', 'user', 'assistant', 'tool', 'ipython'] %}\n"
    "{{- raise_exception('Unsupported role: ' + role) }}\n"
    "{%- endif %}\n"
    "{%- if role == 'tool' %}{%- set role = 'ipython' %}{%- endif %}\n"
    "{%- set content = message['content'] if message['content'] is string else '' %}\n"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}\n"
    "{%- if role == 'assistant' and message.tool_calls is defined and message.tool_calls %}\n"
    "{{- content }}\n"
    "{%- for call in message.tool_calls %}\n"
    "{%- set fn = call.function if call.function is defined else call %}\n"
    '{{- \'<|python_tag|>{"name": "\' + fn.name + \'", "parameters": \' }}\n'
    "{%- if fn.arguments is string %}{{- fn.arguments }}"
    "{%- else %}{{- fn.arguments | tojson }}{%- endif %}\n"
    "{{- '}' }}\n"
    "{%- endfor %}\n"
    "{%- else %}\n"
    "{{- content | trim }}\n"
    "{%- endif %}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
"""Llama-3-style chat template (the `tool` role is rendered as Llama 3.1's `ipython`)."""

IMAGE_TOKEN = "<image>"
"""The image placeholder of IMAGE_CHAT_TEMPLATE (a LLaVA-style model's image token)."""

_TEXT_CONTENT = "{%- set content = message['content'] if message['content'] is string else '' %}\n"
IMAGE_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    _TEXT_CONTENT,
    "{%- set ns = namespace(content='') %}\n"
    "{%- if message['content'] is string %}{%- set ns.content = message['content'] %}\n"
    "{%- elif message['content'] is not none %}{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'text' %}{%- set ns.content = ns.content + part['text'] %}\n"
    "{%- elif part['type'] in ['image', 'image_url'] %}"
    "{%- set ns.content = ns.content + '" + IMAGE_TOKEN + "' %}\n"
    "{%- endif %}{%- endfor %}{%- endif %}\n"
    "{%- set content = ns.content %}\n",
)
"""CHAT_TEMPLATE rendering content parts: text as is, each image part as IMAGE_TOKEN (which
the gateway expands to the model's number of placeholder tokens per image, as LLaVA's
processor does)."""

_SENTENCES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am a helpful assistant that answers questions.",
    "kvmesh is a distributed serving mesh with a KV-aware router and simulated workers.",
    "Tokens stream from the worker to the gateway, which detokenizes them and sends events.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "!?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    "Un café crème à Zürich, s'il vous plaît. Der Bär aß Müsli. ¿Qué tal, señor Núñez?",
    "Ça va très bien, merci ! Les élèves étudient l'œuvre de Molière à l'école.",
    "Привет, как дела? Москва — столица России.",
    "Γεια σου κόσμε. Η γλώσσα είναι ελληνική.",  # noqa: RUF001
    "日本語のテキストです。東京は日本の首都です。こんにちは世界。",
    "中文文本：你好，世界！北京是中国的首都。我们喜欢学习。",  # noqa: RUF001
    "한국어 문장입니다. 안녕하세요, 세계!",
    "Emoji: 😀 😂 👍 🚀 🎉 ❤️ 👍🏽 👨‍👩‍👧 🇫🇷 🤖 ✨",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(2, 3))",
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    "User: what is 2 + 2?\nAssistant: 2 + 2 = 4.\n",
)
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ven", "dar", "el", "os", "qu", "ix",
    "bra", "tor", "ing", "er", "an", "th", "é", "ü", "ñ", "ø",
)  # fmt: skip


def _corpus() -> list[str]:
    rng = random.Random(1234)
    lines = list(_SENTENCES) * 20
    for _ in range(3000):
        words = (
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(8, 40))
        )
        lines.append(" ".join(words))
    return lines


def _build_tokenizer(vocab_size: int, extra_tokens: tuple[str, ...] = ()) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 512:
        raise ValueError(f"vocab_size must be >= 512, got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(extra_tokens),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens([*SPECIAL_TOKENS, *extra_tokens])
    fillers = vocab_size - tok.get_vocab_size()
    if fillers > 0:
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(fillers)])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def create_tiny_model(
    path: Path,
    *,
    vocab_size: int = 4096,
    name: str = "tiny-llama",
    extra_tokens: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write a tiny Llama model directory at `path` (see the module docstring); return `path`.

    Deterministic and offline. Leaves an existing complete model directory untouched.
    `name` is recorded as `_name_or_path` in the configs (the served model name defaults to
    the directory name, not this). `extra_tokens`: more special tokens after SPECIAL_TOKENS
    (e.g. a multimodal model's `<image>`); `chat_template`: the template to write.
    """
    path = Path(path)
    if all((path / f).is_file() for f in MODEL_FILES):
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(vocab_size, extra_tokens)
    ids = {t: int(tok.token_to_id(t)) for t in SPECIAL_TOKENS}
    bos_id, eos_id, eot_id = ids[BOS_TOKEN], ids[EOS_TOKEN], ids[EOT_TOKEN]
    added = {
        str(token_id): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, t in sorted(tok.get_added_tokens_decoder().items())
    }
    tokenizer_config = {
        "_name_or_path": name,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": EOS_TOKEN,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": CONTEXT_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    config = {
        "_name_or_path": name,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, eot_id],
        "pad_token_id": eos_id,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": CONTEXT_LENGTH,
        "mlp_bias": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": tok.get_vocab_size(),
    }
    generation_config = {
        "_from_model_config": True,
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, eot_id],
        "pad_token_id": eos_id,
    }
    _write_atomic(path / "tokenizer.json", tok.to_str(pretty=True).encode())
    _write_atomic(path / "tokenizer_config.json", _json_bytes(tokenizer_config))
    _write_atomic(path / "generation_config.json", _json_bytes(generation_config))
    _write_atomic(path / "config.json", _json_bytes(config))
    return path
