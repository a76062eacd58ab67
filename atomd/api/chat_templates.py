"""Which chat template renders a chat request, and with what (issue 34), as vLLM does:

- the checkpoint's (tokenizer_config.json or chat_template.jinja; contracts/chat_template.py
  renders it the way transformers.apply_chat_template does), unless
- `--chat-template` replaces it for every request: a file path, or the template itself
  inline (a value that is no file and contains a jinja tag); a bad one stops the server at
  start with the template's syntax error;
- a request's `chat_template` replaces it for that request, only when the server runs with
  `--trust-request-chat-template` (vLLM's flag: a template is code the server runs; jinja's
  sandbox and contracts/chat_template.py bound what `range` and `*` build, but loops over the
  request's own lists still multiply), at most --max-chat-template-chars long;
- a request's `chat_template_kwargs` (e.g. `{"enable_thinking": false}` for Qwen3) become
  more variables of the template, next to `messages`, `tools`, `add_generation_prompt` and
  the special tokens, which they may not replace.

A template that does not compile, or raises on the request (`raise_exception`, an undefined
call, a size bound), is a 400 naming the field; so is a rendered prompt longer than
--max-prompt-chars (checked before it is tokenized) or one with no tokens.
"""
from __future__ import annotations

import pathlib
from typing import Any

import jinja2

from atomd.api import protocol, validation
from contracts.chat_template import compiled_template

# the variables the server passes itself (contracts/chat_template.py render), which chat_template_kwargs may not replace
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token", "unk_token",
                   "chat_template", "range")


def load_chat_template(value: str) -> str:
    """`--chat-template`'s value -> the template's text; ValueError when it is neither a
    readable file nor an inline template, or does not compile."""
    path = pathlib.Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a name too long for a path: an inline template
        is_file = False
    if is_file:
        source = path.read_text()
    elif any(tag in value for tag in ("{{", "{%")):
        source = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not an inline jinja template")
    error = compile_error(source)
    if error is not None:
        raise ValueError(f"--chat-template: {error}")
    return source


def compile_error(source: str) -> str | None:
    """Why `source` does not compile (None: it does)."""
    try:
        compiled_template(source)
    except jinja2.TemplateSyntaxError as e:
        return f"the template does not compile: {e.message} (line {e.lineno})"
    except RecursionError:  # jinja's parser recurses per nesting level
        return "the template does not compile: nested too deeply"
    return None


def prompt_ids(tokenizer: Any, req: protocol.ChatCompletionRequest, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None, trust_request_template: bool, max_prompt_chars: int,
               add_special_tokens: bool = False) -> list[int]:
    """The chat request's prompt token ids, or a 400 naming what is wrong. The template
    writes the special tokens itself; `add_special_tokens` adds the tokenizer's too (vLLM's
    /tokenize field)."""
    template = req.chat_template
    if template is not None:
        if not trust_request_template:
            raise protocol.APIError(400, "chat_template: this server does not run templates sent with a request "
                                  "(start it with --trust-request-chat-template)",
                             param="chat_template", code="unsupported_field")
        error = compile_error(template)
        if error is not None:
            raise protocol.invalid("chat_template", f"chat_template: {error}")
    kwargs = dict(req.chat_template_kwargs or {})
    clash = next((k for k in kwargs if k in RESERVED_KWARGS), None)
    if clash is not None:
        raise protocol.invalid("chat_template_kwargs", f"chat_template_kwargs may not set {clash!r} (the server passes it)")
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(messages, req.add_generation_prompt, chat_template=template, **kwargs)
    except Exception as e:  # a template that raises on this conversation (raise_exception, a bad call, ...)
        param = "chat_template" if template is not None else "messages"
        raise protocol.invalid(param, f"chat template failed: {e}") from None
    if len(text) > max_prompt_chars:
        raise validation.too_large("messages", f"the rendered chat prompt has {len(text)} characters", max_prompt_chars,
                          "max-prompt-chars")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise protocol.invalid("chat_template" if template is not None else "messages",
                        "the chat template rendered an empty prompt")
    return ids
