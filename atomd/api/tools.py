"""Tool calling on /v1/chat/completions (issue 22): the grammar of a forced call and the
parser that turns model output into OpenAI `tool_calls`.

The request's `tools` go to the chat template as its `tools` variable (OpenAI's tool dicts,
as transformers passes them); the model answers a call in the Hermes format,
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the built-in model's
template asks for it). `tool_choice`:

- `none`: no tools in the prompt, nothing parsed.
- `auto`: tools in the prompt; the output is parsed, calls become `tool_calls`.
- `required`: a grammar (structured outputs) forces one call of any listed tool (one or
  more with `parallel_tool_calls`, the default), its arguments valid against that tool's
  `parameters` schema; so the call always parses.
- `{"type": "function", "function": {"name": ...}}`: the grammar forces one call of it.

The parser is chosen with `--tool-call-parser` (`hermes`). `HermesParser.parse` splits a
whole text; `HermesParser.stream` feeds deltas and returns what can be sent so far: text
outside calls (held back while it may be the start of `<tool_call>`) and each call once its
`</tool_call>` arrived. Content is the text outside calls with surrounding whitespace
removed (None when empty), the same text streamed or not.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from atomd.structured import JSON_OPTIONS

TOOL_CALL_PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one Hermes call of function `name`."""
    return {"type": "object", "properties": {"name": {"const": name},
                                             "arguments": parameters if parameters else {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_grammar(functions: list[tuple[str, dict[str, Any] | None]], several: bool) -> str:
    """A Lark grammar (llguidance's dialect: `%json` embeds a JSON schema) for one call of
    one of `functions` ((name, parameters schema) pairs), or one or more calls if `several`."""
    schemas = [call_schema(name, params) for name, params in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = dict(schema, **{"x-guidance": JSON_OPTIONS})
    call = f'"{START}\\n" call_json "\\n{END}"'
    start = 'start: call ("\\n" call)*' if several else "start: call"
    return f"{start}\ncall: {call}\ncall_json: %json {json.dumps(schema)}\n"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def make_call(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON between the tags, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


class HermesParser:
    """One choice's output: `<tool_call>` blocks become calls, the rest is content."""

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
            keep = _partial_suffix(self.buffer, START)  # may be the start of a tag
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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
