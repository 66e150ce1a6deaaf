"""Tokenizers, chat templates and special tokens, loaded from local Hugging Face model dirs.

`Tokenizer.from_pretrained(path)` reads, without importing transformers:

- `tokenizer.json` with `tokenizers.Tokenizer.from_file`;
- special tokens and `chat_template` from `tokenizer_config.json`, overridden by a separate
  `chat_template.jinja` or `chat_template.json` as newer transformers versions write them
  (a list of named templates is supported: "default", and "tool_use" when tools are given);
- EOS ids from `generation_config.json`, else `config.json`, else the tokenizer's EOS token;
- the context length from `config.json` (`max_position_embeddings` and friends), else
  `tokenizer_config.json`'s `model_max_length`.

Chat templates render in a sandboxed Jinja environment set up like transformers'
(`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `tojson`, `strftime_now`);
each template is compiled once. A template that raises or is unsafe gives InvalidRequest.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils
import tokenizers

from kvmesh.frontend.detokenize import IncrementalDetokenizer
from kvmesh.frontend.tokencache import ChunkedEncoder, supports_chunking
from kvmesh.runtime.errors import InvalidRequest, Unavailable
from kvmesh.runtime.types import ModelInfo

__all__ = ["ChatTemplate", "Tokenizer", "TokenizerRegistry", "compile_chat_template"]

_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "n_positions",
    "seq_length",
    "max_seq_len",
)
_NO_LIMIT = 10**9
"""model_max_length at or above this means "not set" (transformers writes 1e30)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template and the sandboxed environment it renders in.

    `render` builds the Jinja context directly from a globals dict prepared once, instead of
    `Template.render`, which rebuilds it from a ChainMap on every call (3x slower for a short
    chat). Exceptions propagate unwrapped (TemplateError, SecurityError, ...).
    """

    __slots__ = ("_globals", "template")

    def __init__(self, template: jinja2.Template) -> None:
        self.template = template
        self._globals = dict(template.globals)

    def render(self, variables: Mapping[str, Any]) -> str:
        """Render with `variables` (they shadow the globals)."""
        template = self.template
        context = jinja2.runtime.Context(
            template.environment,
            {**self._globals, **variables},
            template.name,
            template.blocks,
            self._globals,
        )
        return str(jinja2.utils.concat(template.root_render_func(context)))


@lru_cache(maxsize=64)
def compile_chat_template(source: str) -> ChatTemplate:
    """Compile a chat template once (cached by source) in a sandboxed environment set up like
    transformers': trim_blocks, lstrip_blocks, loop controls, raise_exception, tojson,
    strftime_now."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        autoescape=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return ChatTemplate(env.from_string(source))


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _templates_from(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        out: dict[str, str] = {}
        for item in value:
            if isinstance(item, dict):
                name, template = item.get("name"), item.get("template")
                if isinstance(name, str) and isinstance(template, str):
                    out[name] = template
        return out
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
    return {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable stand-in character -> byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _uses_byte_level(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in node.get("decoders") or ())


class Tokenizer:
    """A model's tokenizer plus what serving needs around it.

    Thread-safety: encoding, decoding and template rendering may be called from any thread;
    instances are immutable after construction apart from internal caches.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        context_length: int = 0,
        byte_level: bool = False,
        chunk_cache_entries: int = 32768,
        tokenizer_json: Mapping[str, Any] | None = None,
    ) -> None:
        """Wrap a loaded `tokenizers.Tokenizer` (prefer `from_pretrained`).

        `chat_templates`: name -> Jinja source ("default" is used unless tools are given and
        "tool_use" exists). `special_tokens`: e.g. {"bos_token": "<s>", "eos_token": "</s>"},
        passed to templates. `eos_token_ids`: ids that end generation (empty: the EOS token's).
        `context_length`: max prompt + output tokens, 0 if unknown. `byte_level`: the
        decoder is GPT-2 byte-level (lets logprobs report exact token bytes).
        `chunk_cache_entries`: size of the exact prefix-chunk tokenization cache
        (kvmesh.frontend.tokencache; 0 disables it; it also stays off for tokenizers it cannot
        prove exact for). `tokenizer_json`: the parsed tokenizer.json, if already at hand.
        """
        self._tok = tokenizer
        self._chunked: ChunkedEncoder | None = None
        if chunk_cache_entries > 0:
            spec = (
                dict(tokenizer_json)
                if tokenizer_json is not None
                else json.loads(tokenizer.to_str())
            )
            if supports_chunking(spec):
                chunked = ChunkedEncoder(self._encode_plain, max_entries=chunk_cache_entries)
                self._chunked = chunked if chunked.enabled else None
        self._templates = dict(chat_templates or {})
        self._special = dict(special_tokens or {})
        self._byte_level = byte_level
        self._byte_decoder = _byte_decoder() if byte_level else {}
        self._token_bytes: dict[int, bytes] = {}
        eos = self._special.get("eos_token")
        eos_id = tokenizer.token_to_id(eos) if eos else None
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids) or (
            (int(eos_id),) if eos_id is not None else ()
        )
        """Token ids that end a sequence."""
        self.context_length = int(context_length)
        """Maximum prompt plus output tokens (0: unknown)."""
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        """Number of token ids, added tokens included."""
        bos = self._special.get("bos_token")
        bos_id = tokenizer.token_to_id(bos) if bos else None
        self.bos_token_id: int | None = int(bos_id) if bos_id is not None else None
        """Id of the BOS token, if the model has one."""

    @classmethod
    def from_pretrained(cls, path: str | Path, *, chunk_cache_entries: int = 32768) -> Tokenizer:
        """Load from a local Hugging Face model directory (see the module docstring).

        Raises FileNotFoundError when there is no tokenizer.json.
        """
        base = Path(path)
        tok_file = base / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {base}")
        tokenizer = tokenizers.Tokenizer.from_file(str(tok_file))
        tok_json = json.loads(tok_file.read_text(encoding="utf-8"))
        tok_config = _read_json(base / "tokenizer_config.json")
        config = _read_json(base / "config.json")
        gen_config = _read_json(base / "generation_config.json")

        templates = _templates_from(tok_config.get("chat_template"))
        template_json = _read_json(base / "chat_template.json")
        if "chat_template" in template_json:
            templates.update(_templates_from(template_json["chat_template"]))
        jinja_file = base / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra_dir = base / "additional_chat_templates"
        if extra_dir.is_dir():
            for file in sorted(extra_dir.glob("*.jinja")):
                templates[file.stem] = file.read_text(encoding="utf-8")

        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(tok_config.get(key))
            if content is not None:
                special[key] = content

        text_config = config.get("text_config")
        sources = [config, text_config] if isinstance(text_config, dict) else [config]
        eos_ids = _ids(gen_config.get("eos_token_id"))
        for src in sources:
            eos_ids = eos_ids or _ids(src.get("eos_token_id"))
        context = 0
        for src in sources:
            for key in _CONTEXT_KEYS:
                value = src.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    context = value
                    break
            if context:
                break
        if not context:
            value = tok_config.get("model_max_length")
            if isinstance(value, (int, float)) and 0 < value < _NO_LIMIT:
                context = int(value)
        return cls(
            tokenizer,
            chat_templates=templates,
            special_tokens=special,
            eos_token_ids=eos_ids,
            context_length=context,
            byte_level=_uses_byte_level(tok_json.get("decoder")),
            chunk_cache_entries=chunk_cache_entries,
            tokenizer_json=tok_json,
        )

    @property
    def raw(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token/eos_token/unk_token/pad_token strings that the model defines."""
        return dict(self._special)

    @property
    def has_chat_template(self) -> bool:
        """Whether a chat template was found."""
        return bool(self._templates)

    def chat_template(self, name: str = "default") -> str | None:
        """The source of a named chat template, or None."""
        return self._templates.get(name)

    @property
    def chunk_cache_enabled(self) -> bool:
        """Whether encode() uses the exact prefix-chunk cache."""
        return self._chunked is not None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token string in the vocabulary (at least 1)."""
        return max(1, max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. `add_special_tokens` applies the post-processor (e.g. BOS)."""
        if add_special_tokens:
            ids: list[int] = self._tok.encode_batch_fast([text], add_special_tokens=True)[0].ids
            return ids
        chunked = self._chunked
        if chunked is not None:
            return chunked.encode(text)
        return self._encode_plain(text)

    def _encode_plain(self, text: str) -> list[int]:
        # encode_batch_fast skips offset tracking: about 30 % cheaper than encode().
        ids: list[int] = self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render the chat template. Raises InvalidRequest if the template refuses the input
        (or the model has no template)."""
        source = None
        if tools:
            source = self._templates.get("tool_use")
        if source is None:
            source = self._templates.get("default")
        if source is None:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        template = compile_chat_template(source)
        context: dict[str, Any] = dict(self._special)
        if template_kwargs:
            context.update(template_kwargs)
        context["messages"] = messages
        context["tools"] = tools
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(context)
        except jinja2.exceptions.SecurityError as exc:
            raise InvalidRequest(f"chat template refused: {exc}", param="messages") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template error: {exc}", param="messages") from exc
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one output sequence of the prompt `prompt_ids`."""
        return IncrementalDetokenizer(
            self._tok, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (exact for byte-level tokenizers)."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._tok.id_to_token(token_id)
        data: bytes
        if piece is None:
            data = b""
        elif self._byte_level and all(c in self._byte_decoder for c in piece):
            data = bytes(self._byte_decoder[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                data = bytes([int(piece[3:5], 16)])
            except ValueError:
                data = piece.encode()
        else:
            data = self.decode([token_id], skip_special_tokens=False).encode()
        self._token_bytes[token_id] = data
        return data

    def token_str(self, token_id: int) -> str:
        """A printable form of a token (invalid UTF-8 fragments become U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class TokenizerRegistry:
    """Tokenizers by served model name, loaded on first use from the model card's path.

    `lookup` is a dict access (hot path); `load` reads the files in a worker thread so the
    event loop is not blocked, and runs at most once per model.
    """

    def __init__(
        self,
        tokenizers: Mapping[str, Tokenizer] | None = None,
        *,
        chunk_cache_entries: int = 32768,
    ) -> None:
        """Start with preloaded `tokenizers` (served model name -> Tokenizer); tokenizers
        loaded later get a prefix-chunk cache of `chunk_cache_entries` pieces."""
        self._by_name: dict[str, Tokenizer] = dict(tokenizers or {})
        self._chunk_cache_entries = chunk_cache_entries
        self._lock = threading.Lock()

    def add(self, name: str, tokenizer: Tokenizer) -> None:
        """Register (or replace) the tokenizer of served model `name`."""
        self._by_name[name] = tokenizer

    def lookup(self, name: str) -> Tokenizer | None:
        """The tokenizer of `name` if it is loaded."""
        return self._by_name.get(name)

    async def load(self, info: ModelInfo) -> Tokenizer:
        """The tokenizer of `info.served_model_name`, loading it from `info.model_path`.

        Raises Unavailable when the model card names no readable tokenizer.
        """
        tok = self._by_name.get(info.served_model_name)
        if tok is not None:
            return tok
        if not info.model_path:
            raise Unavailable(f"no tokenizer is known for model {info.served_model_name!r}")
        return await asyncio.to_thread(self._load_sync, info)

    def _load_sync(self, info: ModelInfo) -> Tokenizer:
        with self._lock:
            tok = self._by_name.get(info.served_model_name)
            if tok is not None:
                return tok
            try:
                tok = Tokenizer.from_pretrained(
                    info.model_path, chunk_cache_entries=self._chunk_cache_entries
                )
            except Exception as exc:
                raise Unavailable(
                    f"cannot load the tokenizer of model {info.served_model_name!r} from "
                    f"{info.model_path!r}: {exc}"
                ) from exc
            self._by_name[info.served_model_name] = tok
            return tok
