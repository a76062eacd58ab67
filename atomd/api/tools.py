"""Tool calling on /v1/chat/completions (issues 22, 34): what `tool_choice` does and the
grammar of a forced call; the parsers that turn model output into OpenAI `tool_calls` are
atomd/api/tool_parsers.py, chosen with `--tool-call-parser` (`hermes`, `llama3_json`).

The request's `tools` go to the chat template as its `tools` variable (OpenAI's tool dicts,
as transformers passes them); the model answers a call in its parser's format (Hermes:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, which the built-in
model's template asks for; Llama 3: `{"name": ..., "parameters": {...}}`). `tool_choice`:

- `none`: no tools in the prompt, nothing parsed.
- `auto`: tools in the prompt; the output is parsed, calls become `tool_calls`.
- `required`: a grammar (structured outputs) forces one call of any listed tool (one or
  more with `parallel_tool_calls`, the default), its arguments valid against that tool's
  `parameters` schema, written in the parser's format; so the call always parses.
- `{"type": "function", "function": {"name": ...}}`: the grammar forces one call of it.
"""
from __future__ import annotations

import json
from typing import Any

from atomd.api.tool_parsers import TOOL_CALL_PARSERS
from atomd.structured import JSON_OPTIONS


def call_schema(name: str, parameters: dict[str, Any] | None, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call of function `name` (its arguments under `arguments_key`)."""
    return {"type": "object", "properties": {"name": {"const": name},
                                             arguments_key: parameters if parameters else {"type": "object"}},
            "required": ["name", arguments_key], "additionalProperties": False}


def forced_grammar(functions: list[tuple[str, dict[str, Any] | None]], several: bool,
                   tool_call_parser: str = "hermes") -> str:
    """A Lark grammar (llguidance's dialect: `%json` embeds a JSON schema) for one call of
    one of `functions` ((name, parameters schema) pairs), or one or more calls if `several`,
    written the way `tool_call_parser` reads them."""
    fmt = TOOL_CALL_PARSERS[tool_call_parser]
    schemas = [call_schema(name, params, fmt.arguments_key) for name, params in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = dict(schema, **{"x-guidance": JSON_OPTIONS})
    start = f"start: call ({fmt.separator} call)*" if several else "start: call"
    return f"{start}\ncall: {fmt.call_rule}\ncall_json: %json {json.dumps(schema)}\n"


