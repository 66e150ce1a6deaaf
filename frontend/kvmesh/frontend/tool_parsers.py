"""Tool-call parsers: model output text -> content plus OpenAI `tool_calls`, unary and streamed.

Formats (selected per model with `--tool-call-parser`, or detected from its chat template):

- `hermes` (Hermes 2 Pro, Qwen 2.5 / Qwen 3, many fine-tunes): `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks after optional content.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole output is
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several calls
  separated by `;`.
- `mistral`: `[TOOL_CALLS]` then either a JSON list of `{"name", "arguments"}` objects (v3
  tokenizers) or `name[ARGS]{...}` per call (v11+ tokenizers, optionally `name[CALL_ID]id[ARGS]`).
- `pythonic` (Llama 3.2 / Llama 4, Toolace): the whole output is a Python list of calls,
  `[get_weather(city="Paris"), f()]`, optionally inside `<|python_start|>...<|python_end|>`.
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  ...</function></tool_call>`; `glm45` (GLM-4.5 / 4.6): `<tool_call>NAME<arg_key>KEY</arg_key>
  <arg_value>VALUE</arg_value>...</tool_call>`. Arguments become a JSON object that grows one
  complete parameter at a time; a value is JSON when it reads as a JSON number, boolean, null,
  object or list, else a string (the tool's schema is not consulted).
- `deepseek_v3` (DeepSeek V3 / R1; its markers are written with fullwidth bars and U+2581):
  `<|tool▁calls▁begin|><|tool▁call▁begin|>function<|tool▁sep|>` NAME, then the
  arguments in a ```json fence, `<|tool▁call▁end|>`; `deepseek_v31` (V3.1):
  `<|tool▁call▁begin|>NAME<|tool▁sep|>{...}<|tool▁call▁end|>`; `kimi_k2`:
  `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>`
  `{...}<|tool_call_end|>`. JSON arguments stream as written.
- `gpt_oss` (harmony): messages addressed `to=functions.NAME`, their body the JSON arguments
  (kvmesh.frontend.reasoning reads the format and takes the `analysis` channel as reasoning).

How parsing works. Each parser is a pure function `scan(text, final)` of the output so far that
returns the content and the calls (name, arguments text) that this prefix already determines.
It is written to be monotone: scanning a longer prefix never changes what a shorter one
returned, it only appends (more content, a call's name once its string is complete, more of its
arguments). `ToolCallStream` feeds growing text, re-scans, and emits the difference, so the
concatenated deltas are identical however the text was split into pieces, and the unary result
is the same stream fed the whole text at once. Arguments stream as the raw JSON the model
writes (so they concatenate to exactly the arguments of the unary result); pythonic calls are
emitted whole, when their closing parenthesis arrives, with their keyword arguments as JSON.

Content before the first call streams as it arrives, except a tail that could be the start of
a marker (held back until resolved) and trailing whitespace (dropped if a call follows).
Text after the first call is dropped, as vLLM does, unless a call is malformed before its name
is known: then the rest of the output is content. Only re-scanning the text since the first
marker keeps this linear in practice: outputs are short once a call has started.
"""

from __future__ import annotations

import abc
import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvmesh.frontend.dataplane import ToolCall, ToolCallDelta
from kvmesh.frontend.reasoning import harmony_messages

__all__ = [
    "TOOL_PARSERS",
    "PartialCall",
    "ScanResult",
    "ToolCallStream",
    "ToolParser",
    "detect_tool_parser",
    "get_tool_parser",
    "parse_tool_calls",
]


@dataclass(slots=True)
class PartialCall:
    """A call as far as a prefix of the output determines it."""

    name: str | None = None
    """None until the name is complete (nothing of the call is emitted before)."""
    arguments: str = ""
    """JSON text so far; only ever grows."""


@dataclass(slots=True)
class ScanResult:
    """What a prefix of the output determines: content so far and calls so far."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(abc.ABC):
    """One output format. Subclasses implement `scan`; see the module docstring."""

    name: str = ""
    needs_special_tokens: bool = False
    """Detokenize with special tokens kept (the markers are special tokens, e.g. mistral)."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        """`tool_names`: names of the tools offered (formats without a marker only accept
        calls to these); None accepts any name."""
        self.tool_names = None if tool_names is None else frozenset(tool_names)

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> ScanResult:
        """Content and calls determined by `text` (all of the output if `final`)."""

    def new_id(self) -> str:
        """A fresh tool call id."""
        return "call_" + secrets.token_hex(12)


# --------------------------------------------------------------------------------------------
# Scanning helpers

_WS = " \t\r\n"
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)
"""The rest of a JSON string after its opening quote, closing quote included."""
_BRACKETS = re.compile(r'[{}\[\]"]')
_SCALAR = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")
_SCALAR_PREFIX = re.compile(r"-|t(?:r(?:ue?)?)?|f(?:a(?:l(?:se?)?)?)?|n(?:u(?:ll?)?)?")


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


class _Bad(Exception):
    """Malformed JSON at a position."""


def _value_end(text: str, i: int) -> int | None:
    """End of the JSON value starting at text[i] (not whitespace); None if it is incomplete.

    Raises _Bad if the text cannot be a JSON value. Brackets are matched by depth only.
    """
    n = len(text)
    c = text[i]
    if c == '"':
        m = _STRING_REST.match(text, i + 1)
        return m.end() if m else None
    if c in "{[":
        depth = 0
        j = i
        while True:
            m = _BRACKETS.search(text, j)
            if m is None:
                return None
            j = m.end()
            ch = m.group()
            if ch == '"':
                s = _STRING_REST.match(text, j)
                if s is None:
                    return None
                j = s.end()
            elif ch in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return j
    m = _SCALAR.match(text, i)
    if m is None:
        if _SCALAR_PREFIX.fullmatch(text, i):
            return None
        raise _Bad
    return m.end() if m.end() < n else None


@dataclass(slots=True)
class _Field:
    key: str
    start: int
    end: int | None
    """None: the value is still incomplete (it runs to the end of the text)."""


@dataclass(slots=True)
class _Object:
    fields: list[_Field]
    end: int | None
    """Index after the closing brace; None while incomplete."""
    bad: bool = False


def _scan_object(text: str, i: int) -> _Object:
    """Top-level fields of the JSON object starting at text[i] == "{", as far as they go."""
    n = len(text)
    fields: list[_Field] = []
    j = _skip_ws(text, i + 1)
    expect_key = True
    try:
        while j < n:
            c = text[j]
            if c == "}" and (not fields or not expect_key):
                return _Object(fields, j + 1)
            if not expect_key:
                if c != ",":
                    raise _Bad
                j = _skip_ws(text, j + 1)
                expect_key = True
                continue
            if c != '"':
                raise _Bad
            m = _STRING_REST.match(text, j + 1)
            if m is None:
                break
            key = json.loads(text[j : m.end()])
            j = _skip_ws(text, m.end())
            if j >= n:
                break
            if text[j] != ":":
                raise _Bad
            j = _skip_ws(text, j + 1)
            if j >= n:
                fields.append(_Field(key, j, None))
                break
            end = _value_end(text, j)
            fields.append(_Field(key, j, end))
            if end is None:
                break
            j = _skip_ws(text, end)
            expect_key = False
    except (_Bad, ValueError):
        return _Object(fields, None, bad=True)
    return _Object(fields, None)


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


_ARG_KEYS = ("arguments", "parameters")


def _call_from_object(text: str, obj: _Object, final: bool) -> PartialCall | None:
    """The call a `{"name": ..., "arguments": ...}` object determines so far.

    None when the object cannot be a call (the name is not a string). The arguments stream as
    raw JSON once the name is known; a string-valued `arguments` (JSON encoded as a string) is
    emitted decoded when complete; a missing one becomes "{}" when the object closes.
    """
    name: str | None = None
    args_field: _Field | None = None
    for f in obj.fields:
        if f.key == "name":
            if f.end is None:
                continue
            name = _json_string(text[f.start : f.end])
            if name is None:
                return None
        elif f.key in _ARG_KEYS and args_field is None:
            args_field = f
    call = PartialCall(name)
    if name is None:
        return call
    if args_field is None:
        if obj.end is not None or (final and not obj.bad):
            call.arguments = "{}"
        return call
    start, end = args_field.start, args_field.end
    if start >= len(text):
        return call
    first = text[start]
    if end is None:
        if first in "{[":
            call.arguments = text[start:]
        return call
    raw = text[start:end]
    if first == '"':
        decoded = _json_string(raw)
        call.arguments = decoded if decoded is not None else raw
    elif raw == "null":
        call.arguments = "{}"
    else:
        call.arguments = raw
    return call


def _not_a_call(call: PartialCall | None, obj: _Object, final: bool) -> bool:
    """Whether an object can no longer become a call whose name is emitted."""
    return call is None or (call.name is None and (obj.bad or obj.end is not None or final))


def _scan_call_list(text: str, j: int, final: bool, out: ScanResult) -> bool:
    """Calls of a JSON list of call objects whose "[" is at text[j]; False if it is not one
    (before any call was found)."""
    n = len(text)
    j = _skip_ws(text, j + 1)
    while j < n:
        if text[j] != "{":
            return bool(out.calls)
        obj = _scan_object(text, j)
        call = _call_from_object(text, obj, final)
        if _not_a_call(call, obj, final):
            return bool(out.calls)
        assert call is not None
        out.calls.append(call)
        if obj.end is None:
            return True
        j = _skip_ws(text, obj.end)
        if j < n and text[j] == ",":
            j = _skip_ws(text, j + 1)
        else:
            return True
    return bool(out.calls) or not final


def _hold_back(text: str, markers: Sequence[str]) -> str:
    """`text` without a tail that could start a marker, and without trailing whitespace."""
    n = len(text)
    longest = max(len(m) for m in markers) - 1
    for k in range(min(n, longest), 0, -1):
        tail = text[n - k :]
        if any(m.startswith(tail) for m in markers):
            return text[: n - k].rstrip(_WS)
    return text.rstrip(_WS)


def _content_until(text: str, markers: Sequence[str], final: bool) -> tuple[int, str]:
    """(index of the first marker or -1, the content before it that can be sent)."""
    best = -1
    for m in markers:
        pos = text.find(m)
        if pos != -1 and (best == -1 or pos < best):
            best = pos
    if best != -1:
        return best, text[:best].rstrip(_WS)
    return -1, text if final else _hold_back(text, markers)


def _starts(text: str, marker: str) -> bool | None:
    """Whether `text` starts with `marker`: True, False, or None (too short to tell)."""
    if text.startswith(marker):
        return True
    if marker.startswith(text):
        return None
    return False


# --------------------------------------------------------------------------------------------
# Parsers


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after optional content."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def scan(self, text: str, final: bool) -> ScanResult:
        pos, content = _content_until(text, (self.START,), final)
        out = ScanResult(content)
        if pos == -1:
            return out
        i = pos
        n = len(text)
        while True:
            j = _skip_ws(text, i + len(self.START))
            if j >= n:
                break
            if text[j] != "{":
                out.content = text if not out.calls else out.content + text[i:]
                break
            obj = _scan_object(text, j)
            call = _call_from_object(text, obj, final)
            if _not_a_call(call, obj, final):
                out.content = text if not out.calls else out.content + text[i:]
                break
            assert call is not None
            out.calls.append(call)
            if obj.end is None:
                break
            k = text.find(self.START, obj.end)
            if k == -1:
                break
            i = k
        return out


class Llama3JsonParser(ToolParser):
    """The whole output is `{"name": ..., "parameters": {...}}` (`;`-separated for several),
    optionally after `<|python_tag|>`. Names must be offered tools when tools are known."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> ScanResult:
        j = _skip_ws(text, 0)
        if j >= len(text):
            return ScanResult(text if final else "")
        tagged = _starts(text[j:], self.TAG)
        if tagged is None and not final:
            return ScanResult()
        if tagged:
            j = _skip_ws(text, j + len(self.TAG))
        elif text[j] != "{":
            return ScanResult(text)
        out = ScanResult()
        n = len(text)
        while j < n:
            if text[j] != "{":
                break
            obj = _scan_object(text, j)
            call = _call_from_object(text, obj, final)
            if call is not None and call.name is not None and self.tool_names is not None:
                if call.name not in self.tool_names:
                    call = None
            if _not_a_call(call, obj, final):
                if not out.calls:
                    out.content = text
                break
            assert call is not None
            if call.name is None:
                break
            out.calls.append(call)
            if obj.end is None:
                break
            j = _skip_ws(text, obj.end)
            if j < n and text[j] == ";":
                j = _skip_ws(text, j + 1)
                if text.startswith(self.TAG, j):
                    j = _skip_ws(text, j + len(self.TAG))
            else:
                break
        if not out.calls and final and not out.content:
            out.content = text
        return out


_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` + a JSON list of calls (v3), or `name[ARGS]{...}` per call (v11+)."""

    name = "mistral"
    needs_special_tokens = True
    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def new_id(self) -> str:
        """Mistral's templates require 9 alphanumeric characters."""
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def scan(self, text: str, final: bool) -> ScanResult:
        pos, content = _content_until(text, (self.START,), final)
        out = ScanResult(content)
        if pos == -1:
            return out
        j = _skip_ws(text, pos + len(self.START))
        if j >= len(text):
            if final:
                out.content = text
            return out
        if text[j] == "[":
            self._scan_list(text, j, final, out)
        elif text[j] == "{":
            self._scan_objects(text, j, final, out)
        else:
            self._scan_named(text, pos, final, out)
        if not out.calls and final and out.content != text:
            out.content = text
        return out

    def _invalid(self, text: str, out: ScanResult) -> None:
        if not out.calls:
            out.content = text

    def _scan_list(self, text: str, j: int, final: bool, out: ScanResult) -> None:
        if not _scan_call_list(text, j, final, out):
            self._invalid(text, out)

    def _scan_objects(self, text: str, j: int, final: bool, out: ScanResult) -> None:
        obj = _scan_object(text, j)
        call = _call_from_object(text, obj, final)
        if _not_a_call(call, obj, final):
            self._invalid(text, out)
            return
        assert call is not None
        if call.name is not None:
            out.calls.append(call)

    def _scan_named(self, text: str, pos: int, final: bool, out: ScanResult) -> None:
        n = len(text)
        i = pos
        while True:
            j = _skip_ws(text, i + len(self.START))
            args = text.find(self.ARGS, j)
            call_id = text.find(self.CALL_ID, j)
            stop = args if call_id == -1 or (args != -1 and args < call_id) else call_id
            head = text[j:] if stop == -1 else text[j:stop]
            name = head.strip()
            if any(c not in _NAME_CHARS for c in name) or (stop != -1 and not name):
                # Not a name (yet a marker-free tail may still be a partial [ARGS]).
                partial = stop == -1 and not final and _tail_is_marker_prefix(head)
                if not partial:
                    self._invalid(text, out)
                return
            if stop == -1:
                if final:
                    self._invalid(text, out)
                return
            if stop == call_id:
                args = text.find(self.ARGS, call_id + len(self.CALL_ID))
                if args == -1:
                    if final:
                        self._invalid(text, out)
                    return
            k = _skip_ws(text, args + len(self.ARGS))
            call = PartialCall(name)
            out.calls.append(call)
            if k >= n:
                if final:
                    call.arguments = "{}"
                return
            try:
                end = _value_end(text, k)
            except _Bad:
                call.arguments = "{}"
                return
            if end is None:
                if text[k] in "{[":
                    call.arguments = text[k:]
                return
            call.arguments = text[k:end]
            nxt = text.find(self.START, end)
            if nxt == -1:
                return
            i = nxt


def _tail_is_marker_prefix(head: str) -> bool:
    stripped = head.rstrip(_WS)
    for marker in (MistralParser.ARGS, MistralParser.CALL_ID):
        for k in range(min(len(stripped), len(marker)), 0, -1):
            if marker.startswith(stripped[-k:]):
                name = stripped[:-k].strip()
                return all(c in _NAME_CHARS for c in name)
    return False


class PythonicParser(ToolParser):
    """The whole output is a Python list of calls with literal keyword arguments, optionally
    inside `<|python_start|>` ... `<|python_end|>` (Llama 4)."""

    name = "pythonic"
    START = "<|python_start|>"

    def scan(self, text: str, final: bool) -> ScanResult:
        j = _skip_ws(text, 0)
        if j >= len(text):
            return ScanResult(text if final else "")
        tagged = _starts(text[j:], self.START)
        if tagged is None and not final:
            return ScanResult()
        if tagged:
            j = _skip_ws(text, j + len(self.START))
            if j >= len(text):
                return ScanResult(text if final else "")
        if text[j] != "[":
            return ScanResult(text)
        out = ScanResult()
        if not self._scan_list(text, j + 1, out) and not out.calls:
            out.content = text
        elif final and not out.calls:
            out.content = text
        return out

    def _scan_list(self, text: str, j: int, out: ScanResult) -> bool:
        """Append complete calls; False once the text cannot be a list of calls."""
        n = len(text)
        j = _skip_ws(text, j)
        while True:
            if j >= n:
                return True
            m = _IDENT.match(text, j)
            if m is None:
                return False
            k = m.end()
            if k < n and text[k] == "." and k + 1 >= n:
                return True  # a dotted name continues
            k = _skip_ws(text, k)
            if k >= n:
                return True
            if text[k] != "(":
                return False
            close = _py_call_end(text, k)
            if close is None:
                return True
            if close < 0:
                return False
            call = _py_call(text[j:close])
            if call is None:
                return False
            out.calls.append(call)
            j = _skip_ws(text, close)
            if j >= n or text[j] == "]":
                return True
            if text[j] != ",":
                return False
            j = _skip_ws(text, j + 1)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_PY_TOKENS = re.compile(r"""[()\[\]{}'"#]""")


def _py_call_end(text: str, i: int) -> int | None:
    """Index after the parenthesis closing the one at text[i]; None if not there yet, -1 if
    the text cannot be a literal call (a comment)."""
    depth = 0
    j = i
    n = len(text)
    while True:
        m = _PY_TOKENS.search(text, j)
        if m is None:
            return None
        ch = m.group()
        j = m.end()
        if ch in "'\"":
            k = j
            while True:
                if k >= n:
                    return None
                c = text[k]
                if c == "\\":
                    k += 2
                    continue
                k += 1
                if c == ch:
                    break
            j = k
        elif ch == "#":
            return -1
        elif ch in "([{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return j


def _py_call(source: str) -> PartialCall | None:
    """Name and JSON arguments of `f(a=1, b="x")`; None unless it is such a call with literal
    keyword arguments that JSON can represent."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    try:
        name = ast.unparse(node.func)
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        if None in args:
            return None
        return PartialCall(name, json.dumps(args, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def _name_until(text: str, j: int, stop: str) -> tuple[str, int] | None:
    """(the stripped name at text[j] up to `stop`, the index of `stop`); None until `stop`
    arrives. Raises _Bad for an empty name."""
    k = text.find(stop, j)
    if k == -1:
        return None
    name = text[j:k].strip()
    if not name:
        raise _Bad
    return name, k


class _MarkedJsonParser(ToolParser):
    """Calls inside a section of marker tokens, each `CALL header ARGS CALL_END` with JSON
    arguments (DeepSeek V3 / V3.1, Kimi K2). Subclasses set the markers and `_header`, which
    reads a call's header at text[j] (the name and where the arguments start)."""

    needs_special_tokens = True
    SECTION = ""
    CALL = ""
    CALL_END = ""
    ARGS_CLOSE = ""
    """Text expected between the arguments and CALL_END (besides whitespace)."""

    @abc.abstractmethod
    def _header(self, text: str, j: int) -> tuple[str, int] | None:
        """(name, index where the JSON arguments start) for the header at text[j]; None while
        it is incomplete. Raises _Bad if it is malformed."""

    def scan(self, text: str, final: bool) -> ScanResult:
        pos, content = _content_until(text, (self.SECTION,), final)
        out = ScanResult(content)
        if pos == -1:
            return out
        n = len(text)
        i = pos + len(self.SECTION)
        try:
            while True:
                j = _skip_ws(text, i)
                started = _starts(text[j:], self.CALL)
                if not started:
                    if (started is False and not out.calls) or final:
                        raise _Bad
                    break
                header = self._header(text, j + len(self.CALL))
                if header is None:
                    if final:
                        raise _Bad
                    break
                name, k = header
                call = PartialCall(name)
                out.calls.append(call)
                k = _skip_ws(text, k)
                if k >= n:
                    break
                if text[k] != "{":
                    raise _Bad
                end = _value_end(text, k)
                if end is None:
                    call.arguments = text[k:]
                    break
                call.arguments = text[k:end]
                closers = (self.ARGS_CLOSE, self.CALL_END) if self.ARGS_CLOSE else (self.CALL_END,)
                after = _expect(text, end, closers)
                if after is None:
                    break
                i = after
        except _Bad:
            if not out.calls:
                out.content = text
        return out


class DeepSeekV3Parser(_MarkedJsonParser):
    """DeepSeek V3 / R1: `<|tool▁calls▁begin|><|tool▁call▁begin|>function<|tool▁sep|>NAME`,
    a newline, the arguments in a ```json fence, `<|tool▁call▁end|>`, ...,
    `<|tool▁calls▁end|>`."""

    name = "deepseek_v3"
    SECTION = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
    CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>"
    SEP = "<\uff5ctool\u2581sep\uff5c>"
    CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
    ARGS_CLOSE = "```"
    FENCE = "```json"

    def _header(self, text: str, j: int) -> tuple[str, int] | None:
        k = _expect(text, j, ("function" + self.SEP,))
        named = None if k is None else _name_until(text, k, "\n")
        if named is None:
            return None
        k = _expect(text, named[1], (self.FENCE,))
        return None if k is None else (named[0], k)


class DeepSeekV31Parser(_MarkedJsonParser):
    """DeepSeek V3.1: `<|tool▁calls▁begin|><|tool▁call▁begin|>NAME<|tool▁sep|>{...}`
    `<|tool▁call▁end|>`, ..., `<|tool▁calls▁end|>`."""

    name = "deepseek_v31"
    SECTION = DeepSeekV3Parser.SECTION
    CALL = DeepSeekV3Parser.CALL
    CALL_END = DeepSeekV3Parser.CALL_END

    def _header(self, text: str, j: int) -> tuple[str, int] | None:
        named = _name_until(text, j, DeepSeekV3Parser.SEP)
        return None if named is None else (named[0], named[1] + len(DeepSeekV3Parser.SEP))


class KimiK2Parser(_MarkedJsonParser):
    """Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX`
    `<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`."""

    name = "kimi_k2"
    SECTION = "<|tool_calls_section_begin|>"
    CALL = "<|tool_call_begin|>"
    ARGS = "<|tool_call_argument_begin|>"
    CALL_END = "<|tool_call_end|>"

    def _header(self, text: str, j: int) -> tuple[str, int] | None:
        named = _name_until(text, j, self.ARGS)  # functions.get_weather:0
        if named is None:
            return None
        ident, k = named
        name = ident.removeprefix("functions.").rsplit(":", 1)[0]
        if not name:
            raise _Bad
        return name, k + len(self.ARGS)


def _xml_value(raw: str) -> object:
    """A parameter's value from an XML format: JSON when it is a JSON number, boolean, null,
    object or list, else the text itself (without the newline that wraps it)."""
    text = raw.removeprefix("\n").removesuffix("\n")
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if not isinstance(value, str) else text


def _expect(text: str, j: int, markers: Sequence[str]) -> int | None:
    """Index after `markers` (each after optional whitespace) at text[j]; None while the text
    ends inside them. Raises _Bad if something else is there."""
    for marker in markers:
        j = _skip_ws(text, j)
        started = _starts(text[j:], marker)
        if started is False:
            raise _Bad
        if started is None:
            return None
        j += len(marker)
    return j


class _XmlParser(ToolParser):
    """Calls with one element per argument (Qwen3-Coder, GLM-4.5). Arguments are emitted as a
    JSON object that grows one complete `"key": value` at a time and closes with the call."""

    START = "<tool_call>"
    END = "</tool_call>"
    CLOSE: tuple[str, ...] = (END,)
    """What ends a call's parameters."""

    @abc.abstractmethod
    def _name(self, text: str, j: int) -> tuple[str, int] | None:
        """(name, index after it) for the call body at text[j]; None while incomplete. Raises
        _Bad if malformed."""

    @abc.abstractmethod
    def _param(self, text: str, j: int) -> tuple[str, str, int] | bool | None:
        """(key, raw value, index after it) for the parameter at text[j]; None while it is
        incomplete; False if text[j:] is not (the start of) a parameter."""

    def scan(self, text: str, final: bool) -> ScanResult:
        pos, content = _content_until(text, (self.START,), final)
        out = ScanResult(content)
        if pos == -1:
            return out
        i = pos
        try:
            while True:
                named = self._name(text, i + len(self.START))
                if named is None:
                    if final:
                        raise _Bad
                    break
                name, j = named
                call = PartialCall(name, "{")
                out.calls.append(call)
                params: list[str] = []
                end: int | None = None
                while True:
                    j = _skip_ws(text, j)
                    p = self._param(text, j)
                    if p is None:
                        break
                    if p is False:
                        end = _expect(text, j, self.CLOSE)
                        break
                    assert not isinstance(p, bool)
                    key, raw, j = p
                    value = json.dumps(_xml_value(raw), ensure_ascii=False)
                    params.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
                    call.arguments = "{" + ", ".join(params)
                if end is None:
                    if final:
                        call.arguments += "}"
                    break
                call.arguments += "}"
                k = text.find(self.START, end)
                if k == -1:
                    break
                i = k
        except _Bad:
            if not out.calls:
                out.content = text
            elif final and not out.calls[-1].arguments.endswith("}"):
                out.calls[-1].arguments += "}"
        return out


class Qwen3CoderParser(_XmlParser):
    """Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>`
    ... `</function>\\n</tool_call>`."""

    name = "qwen3_coder"
    CLOSE = ("</function>", _XmlParser.END)
    _FUNC = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def _name(self, text: str, j: int) -> tuple[str, int] | None:
        m = self._FUNC.match(text, j)
        if m is None:
            rest = text[j:].lstrip(_WS)
            if "<function=".startswith(rest) or (rest.startswith("<function=") and ">" not in rest):
                return None
            raise _Bad
        return m.group(1).strip(), m.end()

    def _param(self, text: str, j: int) -> tuple[str, str, int] | bool | None:
        m = self._PARAM.match(text, j)
        if m is not None:
            return m.group(1).strip(), m.group(2), m.end()
        rest = text[j:]
        if rest.startswith("<parameter=") or (rest and "<parameter=".startswith(rest)):
            return None
        if not rest:
            return None
        return False


class Glm45Parser(_XmlParser):
    """GLM-4.5 / 4.6: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>`
    ... `</tool_call>`."""

    name = "glm45"
    _PARAM = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _name(self, text: str, j: int) -> tuple[str, int] | None:
        k = j
        n = len(text)
        while k < n and text[k] not in "\n<":
            k += 1
        if k >= n:
            return None
        name = text[j:k].strip()
        if not name:
            raise _Bad
        return name, k

    def _param(self, text: str, j: int) -> tuple[str, str, int] | bool | None:
        m = self._PARAM.match(text, j)
        if m is not None:
            return m.group(1).strip(), m.group(2), m.end()
        rest = text[j:]
        if not rest or rest.startswith("<arg_key>") or "<arg_key>".startswith(rest):
            return None
        return False


class HarmonyParser(ToolParser):
    """gpt-oss (harmony): a message addressed `to=functions.NAME` is a call whose body is the
    JSON arguments (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`
    `<|call|>`); `final` and unaddressed messages are content; `analysis` (the reasoning, which
    the `gpt_oss` reasoning parser takes first) is dropped here."""

    name = "gpt_oss"
    needs_special_tokens = True
    PREFIX = "functions."

    def scan(self, text: str, final: bool) -> ScanResult:
        out = ScanResult()
        for msg in harmony_messages(text, final):
            if msg.recipient is None:
                if msg.channel != "analysis" and not out.calls:
                    out.content += msg.body
                continue
            name = msg.recipient.removeprefix(self.PREFIX)
            arguments = msg.body.strip(_WS)
            if not arguments and (msg.end is not None or final):
                arguments = "{}"
            out.calls.append(PartialCall(name, arguments))
        if out.calls or not final:
            out.content = out.content.rstrip(_WS)
        return out


class JsonListParser(ToolParser):
    """The output is a JSON list of `{"name", "parameters"}` objects: what guided decoding
    produces for tool_choice "required" (not a model format, so not selectable by name)."""

    name = "json_list"

    def scan(self, text: str, final: bool) -> ScanResult:
        j = _skip_ws(text, 0)
        if j >= len(text):
            return ScanResult(text if final else "")
        if text[j] != "[":
            return ScanResult(text)
        out = ScanResult()
        if not _scan_call_list(text, j, final, out) and not out.calls:
            out.content = text
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        PythonicParser,
        Qwen3CoderParser,
        Glm45Parser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        KimiK2Parser,
        HarmonyParser,
    )
}
"""Parser classes by name (the values of --tool-call-parser)."""
_ALIASES = {
    "qwen": "hermes",
    "qwen2_5": "hermes",
    "qwen3": "hermes",
    "llama3": "llama3_json",
    "glm4_moe": "glm45",
    "deepseek_r1": "deepseek_v3",
    "openai": "gpt_oss",
    "harmony": "gpt_oss",
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class called `name` (or an alias). Raises ValueError for unknown names."""
    cls = TOOL_PARSERS.get(_ALIASES.get(name, name))
    if cls is None:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})")
    return cls


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format implies, or None."""
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return "gpt_oss"
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<arg_key>" in chat_template:
        return "glm45"
    if DeepSeekV3Parser.SECTION in chat_template:
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if "<|tool_calls_section_begin|>" in chat_template:
        return "kimi_k2"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_start|>" in chat_template or "[func_name1(" in chat_template:
        return "pythonic"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3_json"
    return None


# --------------------------------------------------------------------------------------------
# Streaming


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    arguments: int


class ToolCallStream:
    """Turns output text, fed in pieces, into content and tool-call deltas (module docstring).

    `feed(text)` and `finish()` return (content delta, tool call deltas). With
    `parallel_tool_calls=False` only the first call is reported. Not thread-safe.
    """

    __slots__ = ("_content", "_limit", "_new_id", "_parser", "_sent", "_text")

    def __init__(
        self,
        parser: ToolParser,
        *,
        parallel_tool_calls: bool = True,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self._parser = parser
        self._limit = None if parallel_tool_calls else 1
        self._new_id = new_id if new_id is not None else parser.new_id
        self._text = ""
        self._content = 0
        self._sent: list[_Sent] = []

    @property
    def called(self) -> bool:
        """Whether any tool call was emitted."""
        return bool(self._sent)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add output text; return what can be sent now."""
        if not text:
            return "", []
        self._text += text
        return self._diff(self._parser.scan(self._text, False))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: return whatever is still held back."""
        return self._diff(self._parser.scan(self._text, True))

    def _diff(self, result: ScanResult) -> tuple[str, list[ToolCallDelta]]:
        content = result.content[self._content :]
        self._content = max(self._content, len(result.content))
        deltas: list[ToolCallDelta] = []
        calls = result.calls if self._limit is None else result.calls[: self._limit]
        sent = self._sent
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(sent):
                entry = _Sent(self._new_id(), call.name, len(call.arguments))
                sent.append(entry)
                deltas.append(ToolCallDelta(index, entry.id, call.name, call.arguments))
                continue
            entry = sent[index]
            if len(call.arguments) > entry.arguments:
                deltas.append(ToolCallDelta(index, arguments=call.arguments[entry.arguments :]))
                entry.arguments = len(call.arguments)
        return content, deltas


class NamedToolCallStream:
    """tool_choice naming one function: the (guided) output is that call's arguments JSON."""

    __slots__ = ("_id", "_name", "_started")

    def __init__(self, name: str, new_id: Callable[[], str] | None = None) -> None:
        self._name = name
        self._id = (new_id or (lambda: "call_" + secrets.token_hex(12)))()
        self._started = False

    @property
    def called(self) -> bool:
        """Whether the call was emitted (always, once the stream finished)."""
        return self._started

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Output text is arguments text."""
        if not self._started:
            self._started = True
            return "", [ToolCallDelta(0, self._id, self._name, text)]
        return "", [ToolCallDelta(0, arguments=text)] if text else []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Emit the call even if the output was empty."""
        return self.feed("") if not self._started else ("", [])


def collect_calls(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """Merge streamed tool call deltas into complete calls, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            calls[d.index] = ToolCall(d.id or "", d.name or "", d.arguments)
        else:
            call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def parse_tool_calls(
    parser: ToolParser, text: str, *, parallel_tool_calls: bool = True
) -> tuple[str, list[ToolCall]]:
    """Unary parse of a whole output: (content, calls). Identical to streaming it."""
    stream = ToolCallStream(parser, parallel_tool_calls=parallel_tool_calls)
    content, deltas = stream.feed(text)
    more, rest = stream.finish()
    return content + more, collect_calls([*deltas, *rest])
