"""Incremental detokenization and stop-string detection for streamed output.

`IncrementalDetokenizer` turns token ids, as they arrive, into text pieces that never split a
multi-byte UTF-8 character (byte-level BPE spreads one emoji over several tokens). It uses
`tokenizers.decoders.DecodeStream` (Rust) when the installed `tokenizers` has it, and a
prefix/read-offset algorithm over `Tokenizer.decode` otherwise; both give the same text.

`StopStringMatcher` finds stop strings in that text, holding back any tail that could be the
start of a stop string, so a stop string is never emitted even when it is split over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers.decoders

_DecodeStream: Any = getattr(tokenizers.decoders, "DecodeStream", None)  # tokenizers >= 0.21

__all__ = ["HAS_DECODE_STREAM", "IncrementalDetokenizer", "StopStringMatcher"]

HAS_DECODE_STREAM = _DecodeStream is not None
"""Whether the fast Rust streaming decoder is available."""

_REPLACEMENT = "\ufffd"
_PRIME_TOKENS = 6
"""Prompt tokens fed to the decoder first, so word-boundary spaces decode as in context."""


class IncrementalDetokenizer:
    """Streaming detokenizer for one sequence.

    Contract: the concatenation of every `step()` result followed by `flush()` equals
    `tokenizer.decode(all_ids)` (for byte-level tokenizers; for tokenizers whose decoder strips
    a leading space at the start of a text, the text is decoded in the context of the last
    prompt tokens instead). `step()` returns "" while the tokens so far end inside a multi-byte
    character; `flush()` returns whatever is still held back (incomplete bytes become U+FFFD).
    Not thread-safe; one instance per sequence.
    """

    __slots__ = ("_ids", "_pending", "_prefix", "_read", "_skip", "_stream", "_tok")

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        use_decode_stream: bool | None = None,
    ) -> None:
        """`tokenizer` is a `tokenizers.Tokenizer`; `prompt_ids` give decoding context.

        `use_decode_stream`: None picks DecodeStream when available; False forces the
        pure-Python fallback (tests).
        """
        self._tok = tokenizer
        self._skip = skip_special_tokens
        prime = list(prompt_ids[-_PRIME_TOKENS:]) if prompt_ids else []
        # A prompt given as token ids may end inside a multi-byte character; context that
        # ends there would make the first output re-emit prompt text. Prime only up to the
        # last complete character (the orphaned continuation bytes then decode as U+FFFD).
        while prime and tokenizer.decode(prime, skip_special_tokens=False).endswith(_REPLACEMENT):
            prime.pop()
        if use_decode_stream is None:
            use_decode_stream = HAS_DECODE_STREAM
        if use_decode_stream:
            if _DecodeStream is None:
                raise RuntimeError("tokenizers.decoders.DecodeStream is not available")
            self._stream: Any = _DecodeStream(ids=prime or None, skip_special_tokens=self._skip)
            self._pending: list[int] = []
            self._ids: list[int] = []
        else:
            self._stream = None
            self._pending = []
            self._ids = prime
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, ids: list[int]) -> str:
        """Add generated token ids; return the newly completed text ("" if none yet)."""
        stream = self._stream
        if stream is not None:
            if len(ids) == 1:
                text = stream.step(self._tok, ids[0])
            else:
                text = stream.step(self._tok, ids)
            if text is None:
                self._pending.extend(ids)
                return ""
            if self._pending:
                self._pending.clear()
            return str(text)
        return self._step_offsets(ids)

    def flush(self) -> str:
        """Text of tokens still held back (an unfinished character decodes as U+FFFD)."""
        if self._stream is not None:
            if not self._pending:
                return ""
            text = str(self._tok.decode(self._pending, skip_special_tokens=self._skip))
            self._pending.clear()
            return text
        if self._read >= len(self._ids):
            return ""
        decode = self._tok.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        if full_text.startswith(prefix_text):
            return str(full_text[len(prefix_text) :])
        return str(full_text)

    def _step_offsets(self, ids: list[int]) -> str:
        all_ids = self._ids
        all_ids.extend(ids)
        decode = self._tok.decode
        prefix_text = decode(all_ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full_text = decode(all_ids[self._prefix :], skip_special_tokens=self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            text = full_text[len(prefix_text) :]
            # Keep only the context the next step needs.
            del all_ids[: self._read]
            self._prefix = 0
            self._read = len(all_ids)
            return str(text)
        return ""


class StopStringMatcher:
    """Finds the first stop string in streamed text without ever emitting any part of it.

    `feed(text)` returns `(safe, matched)`: `safe` is the text that can be sent now (held-back
    text from earlier calls included); when `matched` is True, `safe` ends right before the
    stop string and the caller must stop (nothing after the match is ever returned). A tail
    that is a prefix of some stop string is held back until it is resolved; `flush()` returns
    it at the end of the sequence.
    """

    __slots__ = ("_held", "_max_hold", "_stops", "matched")

    def __init__(self, stops: Sequence[str]) -> None:
        """`stops`: non-empty stop strings (empty strings are ignored)."""
        self._stops = tuple(s for s in stops if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None
        """The stop string found (None until one is)."""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add detokenized text; see the class docstring."""
        if not text:
            return "", False
        buf = self._held + text
        first = -1
        for stop in self._stops:
            pos = buf.find(stop)
            if pos != -1 and (first == -1 or pos < first):
                first = pos
                self.matched = stop
        if first != -1:
            self._held = ""
            return buf[:first], True
        hold = self._hold_length(buf)
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], False
        self._held = ""
        return buf, False

    def flush(self) -> str:
        """Held-back text, released at the end of the sequence."""
        held, self._held = self._held, ""
        return held

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            for stop in self._stops:
                if stop.startswith(tail):
                    return k
        return 0
