"""Reasoning parsers: separate a `<think>`-style model's reasoning from its answer.

Models such as DeepSeek-R1, QwQ and Qwen 3 write their chain of thought between `<think>` and
`</think>` before the answer. The gateway returns it as `reasoning_content` (the name DeepSeek,
SGLang and most clients read), and only the rest as `content`, streamed and unary alike.

Where the output starts depends on the chat template, so the rendered prompt decides the
initial state: a prompt ending in `<think>` (DeepSeek-R1's template opens the block itself)
means the output starts inside the reasoning; one ending in `</think>` (Qwen 3 with
`enable_thinking: false` renders an empty block) means there is no reasoning at all; otherwise
the output is inspected: it starts with `<think>` or it is all content. The `deepseek_r1`
parser instead treats output without an opening tag as reasoning until `</think>` (and all of
it when the tag never comes), as DeepSeek-R1 behaves.

gpt-oss writes OpenAI's harmony format instead (`gpt_oss`): messages
`<|channel|>analysis<|message|>...<|end|>`, `<|start|>assistant<|channel|>final<|message|>...`,
each ending in `<|end|>`, `<|call|>` or `<|return|>`. The `analysis` channel is the reasoning;
`final` (and `commentary` addressed to nobody) is the content; a message addressed to a tool
(`to=functions.NAME`) is passed on, markers and all, for the `gpt_oss` tool-call parser. Its
markers are special tokens, so the gateway keeps special tokens when detokenizing for it.

Whitespace around the tags is dropped (reasoning and content are stripped at the boundaries);
a tail that could be the start of `</think>` is held back until resolved, so the tags never
leak into either field, however the text is split into pieces.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = [
    "REASONING_PARSERS",
    "HarmonyMessage",
    "ReasoningParser",
    "ReasoningStream",
    "detect_reasoning_parser",
    "get_reasoning_parser",
    "harmony_messages",
    "split_reasoning",
]

_WS = " \t\r\n"


class _State(enum.Enum):
    UNDECIDED = 0
    """Waiting for the first non-whitespace text: is it the opening tag?"""
    REASONING = 1
    CONTENT_START = 2
    """After the closing tag: dropping whitespace before the answer."""
    CONTENT = 3


class ReasoningParser:
    """A `<think>`-style reasoning format (see the module docstring)."""

    needs_special_tokens = False
    """Detokenize with special tokens kept (the markers are special tokens: harmony)."""

    def __init__(
        self, name: str, *, start: str = "<think>", end: str = "</think>", implicit: bool
    ) -> None:
        """`implicit`: output without the opening tag is reasoning (DeepSeek-R1)."""
        self.name = name
        self.start = start
        self.end = end
        self.implicit = implicit

    def stream(self, prompt: str = "") -> ReasoningStream:
        """A parser for one output of `prompt` (the rendered chat prompt)."""
        tail = prompt.rstrip(_WS)
        if tail.endswith(self.start):  # the template opened the block: the output is inside
            return ReasoningStream(self, _State.UNDECIDED, implicit=True)
        if tail.endswith(self.end):  # the template closed an empty block: no reasoning
            return ReasoningStream(self, _State.CONTENT, implicit=False)
        return ReasoningStream(self, _State.UNDECIDED, implicit=self.implicit)


class ReasoningStream:
    """Splits one output, fed in pieces, into (reasoning delta, content delta) pairs."""

    __slots__ = ("_emitted", "_end", "_held", "_implicit", "_start", "_state")

    def __init__(self, parser: ReasoningParser, state: _State, *, implicit: bool) -> None:
        self._start = parser.start
        self._end = parser.end
        self._implicit = implicit
        self._state = state
        self._held = ""
        """UNDECIDED: everything so far; REASONING: a held-back tail."""
        self._emitted = False
        """Whether any reasoning text was emitted (leading whitespace is dropped)."""

    @property
    def in_reasoning(self) -> bool:
        """Whether the output is (still, or possibly) inside the reasoning."""
        return self._state in (_State.UNDECIDED, _State.REASONING)

    def feed(self, text: str) -> tuple[str, str]:
        """Add output text; return (reasoning, content) that can be sent now."""
        state = self._state
        if state is _State.CONTENT:
            return "", text
        if not text:
            return "", ""
        if state is _State.UNDECIDED:
            return self._undecided(text, final=False)
        if state is _State.REASONING:
            return self._reasoning(text, final=False)
        stripped = text.lstrip(_WS)
        if stripped:
            self._state = _State.CONTENT
        return "", stripped

    def finish(self) -> tuple[str, str]:
        """The output ended: return what is still held back."""
        state = self._state
        if state is _State.UNDECIDED:
            return self._undecided("", final=True)
        if state is _State.REASONING:
            return self._reasoning("", final=True)
        return "", ""

    def _undecided(self, text: str, *, final: bool) -> tuple[str, str]:
        buf = self._held + text
        head = buf.lstrip(_WS)
        start = self._start
        if head.startswith(start):
            self._held = ""
            self._state = _State.REASONING
            return self._reasoning(head[len(start) :], final=final)
        if (head and not start.startswith(head)) or final:
            self._held = ""
            if self._implicit:
                self._state = _State.REASONING
                return self._reasoning(buf, final=final)
            self._state = _State.CONTENT
            return "", buf
        self._held = buf
        return "", ""

    def _reasoning(self, text: str, *, final: bool) -> tuple[str, str]:
        buf = self._held + text
        if not self._emitted:
            buf = buf.lstrip(_WS)
            if not buf:
                self._held = ""
                return "", ""
        end = self._end
        pos = buf.find(end)
        if pos != -1:
            reasoning = buf[:pos].rstrip(_WS)
            self._held = ""
            self._state = _State.CONTENT_START
            rest = buf[pos + len(end) :].lstrip(_WS)
            if rest:
                self._state = _State.CONTENT
            if reasoning:
                self._emitted = True
            return reasoning, rest
        if final:
            self._held = ""
            reasoning = buf.rstrip(_WS)
        else:
            keep = _marker_prefix_len(buf, end)
            reasoning = buf[: len(buf) - keep].rstrip(_WS)
            self._held = buf[len(reasoning) :]
        if reasoning:
            self._emitted = True
        return reasoning, ""


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# --------------------------------------------------------------------------------------------
# Harmony (gpt-oss)

_H_START = "<|start|>"
_H_CHANNEL = "<|channel|>"
_H_MESSAGE = "<|message|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_RECIPIENT = re.compile(r"to=([^\s<]+)")
_H_WORD = re.compile(r"[^\s<]*")


@dataclass(slots=True)
class HarmonyMessage:
    """One message of a harmony output, as far as the text goes."""

    channel: str
    """"analysis", "commentary", "final"; "" for text outside any message."""
    recipient: str | None
    """e.g. "functions.get_weather" (a tool call); None for the user."""
    body: str
    """The text so far (a tail that could start an end marker is held back)."""
    end: str | None
    """The end marker, once the message is complete."""
    header: str = ""
    """The header text before `<|message|>` (markers included)."""


def _held(text: str, final: bool) -> str:
    """`text` without a tail that could start an end marker (unless `final`)."""
    if final:
        return text
    keep = max(_marker_prefix_len(text, m) for m in (*_H_ENDS, _H_START, _H_CHANNEL))
    return text[: len(text) - keep]


def harmony_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages a prefix of a harmony output determines (the last may be incomplete;
    a header that is not complete yet is left out). Monotone: a longer prefix only extends the
    last message or adds messages. Text that is not inside a message (no header) comes as
    messages with channel "" up to the next marker."""
    out: list[HarmonyMessage] = []
    n = len(text)
    i = 0
    while i < n:
        rest = text[i:]
        if not (rest.startswith((_H_START, _H_CHANNEL))):
            if not final and (_H_START.startswith(rest) or _H_CHANNEL.startswith(rest)):
                break
            nxt = min(
                (k for m in (_H_START, _H_CHANNEL) if (k := text.find(m, i)) != -1), default=n
            )
            body = text[i:nxt] if nxt < n else _held(rest, final)
            if body:
                out.append(HarmonyMessage("", None, body, None))
            if nxt == n:
                break
            i = nxt
            continue
        m = text.find(_H_MESSAGE, i)
        if m == -1:
            if final:
                out.append(HarmonyMessage("", None, rest, None))
            break
        header = text[i:m]
        c = header.find(_H_CHANNEL)
        word = _H_WORD.match(header, c + len(_H_CHANNEL)) if c != -1 else None
        channel = word.group() if word is not None else ""
        to = _H_RECIPIENT.search(header)
        start = m + len(_H_MESSAGE)
        ends = [(k, e) for e in _H_ENDS if (k := text.find(e, start)) != -1]
        if not ends:
            out.append(
                HarmonyMessage(
                    channel, to and to.group(1), _held(text[start:], final), None, header
                )
            )
            break
        k, e = min(ends)
        out.append(HarmonyMessage(channel, to and to.group(1), text[start:k], e, header))
        i = k + len(e)
    return out


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony format (see the module docstring)."""

    needs_special_tokens = True

    def __init__(self, name: str) -> None:
        super().__init__(name, implicit=False)

    def stream(self, prompt: str = "") -> ReasoningStream:
        return HarmonyReasoningStream()


def harmony_split(text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of a harmony output prefix: analysis bodies (one per line), then
    final / unaddressed bodies, and tool-addressed messages as their own text."""
    reasoning: list[str] = []
    content: list[str] = []
    for msg in harmony_messages(text, final):
        if msg.channel == "analysis":
            reasoning.append(msg.body)
        elif msg.recipient is not None:
            content.append(f"{msg.header}{_H_MESSAGE}{msg.body}{msg.end or ''}")
        else:
            content.append(msg.body)
    return "\n".join(reasoning), "".join(content)


class HarmonyReasoningStream(ReasoningStream):
    """Splits a harmony output fed in pieces (re-scans it and sends what is new)."""

    __slots__ = ("_sent_content", "_sent_reasoning", "_text")

    def __init__(self) -> None:
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    @property
    def in_reasoning(self) -> bool:
        messages = harmony_messages(self._text, False)
        return not messages or messages[-1].channel == "analysis"

    def _diff(self, final: bool) -> tuple[str, str]:
        reasoning, content = harmony_split(self._text, final)
        r, c = reasoning[self._sent_reasoning :], content[self._sent_content :]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        return r, c

    def feed(self, text: str) -> tuple[str, str]:
        self._text += text
        return self._diff(False)

    def finish(self) -> tuple[str, str]:
        return self._diff(True)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", implicit=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit=True),
    "gpt_oss": HarmonyReasoningParser("gpt_oss"),
}
"""Reasoning parsers by name (the values of --reasoning-parser)."""
_ALIASES = {
    "think": "qwen3",
    "qwq": "qwen3",
    "deepseek": "deepseek_r1",
    "openai_gptoss": "gpt_oss",
    "harmony": "gpt_oss",
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name` (or an alias). Raises ValueError for unknown names."""
    parser = REASONING_PARSERS.get(_ALIASES.get(name, name))
    if parser is None:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r} (known: {known})")
    return parser


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The parser a chat template implies (`<think>` blocks, harmony channels), or None."""
    if chat_template and "<|channel|>" in chat_template:
        return "gpt_oss"
    if chat_template and "<think>" in chat_template and "</think>" in chat_template:
        return "qwen3"
    return None


def split_reasoning(parser: ReasoningParser, text: str, prompt: str = "") -> tuple[str, str]:
    """Unary split of a whole output: (reasoning, content). Identical to streaming it."""
    stream = parser.stream(prompt)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return r1 + r2, c1 + c2
