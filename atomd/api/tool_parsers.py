"""Tool-call parsers (`--tool-call-parser`): a choice's output -> OpenAI `tool_calls` and
the content around them, streamed (`stream` per delta, then `finish`) or whole (`parse`),
the same either way. Each parser also says how a forced call is written, for the grammar
of atomd/api/tools.py (`call_rule`, `separator`, `arguments_key`).

- `hermes` (Hermes, Qwen2.5 and Qwen3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
  blocks anywhere in the text; text outside them is content (held back while it may be the
  start of `<tool_call>`); leading and trailing whitespace of the content is dropped.
- `llama3_json` (Llama 3.1-3.3's JSON tool calling): the output is one or more
  `{"name": ..., "parameters": {...}}` objects separated by `;` (`arguments` is taken too),
  optionally after `<|python_tag|>`; an output that starts with anything else is content.
  After the calls, text that is not one is content. A call goes out once its JSON closed.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def make_call(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON between the tags, or None when it is not a call."""
    try:
        return call_of(json.loads(body))
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep for the decoder
        return None


def call_of(obj: Any) -> dict[str, Any] | None:
    """An OpenAI tool call from a decoded `{"name", "arguments" or "parameters"}` object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    try:
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    except RecursionError:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


class HermesParser:
    """One choice's output: `<tool_call>` blocks become calls, the rest is content."""

    arguments_key = "arguments"  # the forced-call grammar's (atomd/api/tools.py)
    call_rule, separator = f'"{START}\\n" call_json "\\n{END}"', '"\\n"'

    def __init__(self) -> None:
        self.buffer = ""  # text not yet handed out
        self.in_call = False
        self.started = False  # some content went out (leading whitespace is dropped)
        self.held_space = ""  # whitespace after the last content sent: sent if more content follows
        self.num_calls = 0

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of a whole output."""
        parser = cls()
        content, calls = parser.stream(text)
        more, last = parser.finish()
        content += more
        return content or None, calls + last

    def stream(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Feed `delta`; return the content that can go out now and the calls completed."""
        self.buffer += delta
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(END)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(END):]
                self.in_call = False
                call = make_call(body)
                if call is None:  # not a call after all: it stays text
                    content.append(self._content(START + body + END))
                else:
                    calls.append(call)
                    self.num_calls += 1
                continue
            start = self.buffer.find(START)
            if start >= 0:
                content.append(self._content(self.buffer[:start]))
                self.buffer = self.buffer[start + len(START):]
                self.in_call = True
                continue
            keep = partial_suffix(self.buffer, START)  # may be the start of a tag
            content.append(self._content(self.buffer[:len(self.buffer) - keep]))
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the output: what was held back is content (an unclosed call too)."""
        rest = (START if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return self._content(rest.rstrip()), []

    def _content(self, text: str) -> str:
        """Content with the output's leading and trailing whitespace dropped (held back
        until more content shows it is not trailing)."""
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        stripped = text.rstrip()
        if not stripped:
            self.held_space += text
            return ""
        out = self.held_space + stripped
        self.held_space = text[len(stripped):]
        return out


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    if tag[0] not in text[-(len(tag) - 1):]:  # the common case (every such suffix starts with it)
        return 0
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Llama3JsonParser:
    """One choice's output: leading `{"name", "parameters"}` objects become calls."""

    arguments_key = "parameters"
    call_rule, separator = "call_json", '"; "'

    def __init__(self) -> None:
        self.buffer = ""  # the output so far (in calls mode; else what is not handed out)
        self.calls_mode: bool | None = None  # None: not known yet whether the output is calls
        self.pos = 0  # in calls mode: where the next call (or the trailing content) starts
        self.done = False  # in calls mode: something that is not a call came; the rest is content
        self.num_calls = 0
        # a scan of the text for where a top-level JSON value closes, so a call is decoded
        # once it is whole, not at every delta (a long call would be decoded over and over)
        self.scanned = 0
        self.depth = 0
        self.in_string = self.escaped = False

    @classmethod
    def parse(cls, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of a whole output."""
        parser = cls()
        content, calls = parser.stream(text)
        more, _ = parser.finish()
        return (content + more) or None, calls

    def stream(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Feed `delta`; return the content that can go out now and the calls completed."""
        self.buffer += delta
        if self.calls_mode is None:
            head = self.buffer.lstrip()
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self.calls_mode = True
                self.pos = len(self.buffer) - len(head) + (len(PYTHON_TAG) if head.startswith(PYTHON_TAG) else 0)
            elif not head or PYTHON_TAG.startswith(head):
                return "", []
            else:
                self.calls_mode = False
        if not self.calls_mode:
            out, self.buffer = self.buffer, ""
            return out, []
        if self.done or not self._value_closed():
            return "", []
        return "", self._closed_calls()

    def _value_closed(self) -> bool:
        """Scan the text not scanned yet: did a top-level JSON object or array close in it?"""
        closed = False
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for ch in self.buffer[max(self.scanned, self.pos):]:
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                closed = closed or depth <= 0
        self.depth, self.in_string, self.escaped = depth, in_string, escaped
        self.scanned = len(self.buffer)
        return closed

    def _closed_calls(self) -> list[dict[str, Any]]:
        """The calls whose JSON closed since the last look (decoded from `pos` on)."""
        calls = []
        while True:
            at = _skip_separator(self.buffer, self.pos, self.num_calls > 0)
            try:
                obj, end = _DECODER.raw_decode(self.buffer, at)
            except ValueError:  # not closed yet (or not JSON: content at the end)
                return calls
            except RecursionError:  # nested too deep to be a call: content
                self.done = True
                return calls
            call = call_of(obj)
            if call is None:
                self.done = True
                return calls
            calls.append(call)
            self.num_calls += 1
            self.pos = end

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the output: text after the last call is content (all of it when the
        output held no call)."""
        if not self.calls_mode:
            rest, self.buffer = self.buffer, ""
            return rest, []
        rest = self.buffer[_skip_separator(self.buffer, self.pos, self.num_calls > 0):] if self.num_calls else \
            self.buffer
        self.buffer, self.pos = "", 0
        return rest.strip(), []


_DECODER = json.JSONDecoder()


def _skip_separator(text: str, at: int, after_call: bool) -> int:
    """Past the whitespace (and, after a call, one `;`) at `at`."""
    while at < len(text) and text[at].isspace():
        at += 1
    if after_call and at < len(text) and text[at] == ";":
        at += 1
        while at < len(text) and text[at].isspace():
            at += 1
    return at


TOOL_CALL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser}
