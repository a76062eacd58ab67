"""`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` of `atomd serve`, in vLLM's
request and response shapes (what lm-eval's `local-completions` probes for and its remote
tokenizer uses, and what vLLM clients count tokens with):

  /tokenize        {"prompt", "add_special_tokens": true, "return_token_strs": false}, or chat:
                   {"messages", "add_generation_prompt": true, "add_special_tokens": false,
                    "chat_template", "chat_template_kwargs", "tools", "return_token_strs"}
                   -> {"count", "max_model_len", "tokens", "token_strs"}
  /detokenize      {"tokens"} -> {"prompt"}
  /tokenizer_info  the tokenizer's config (tokenizer_config.json) with its special tokens as
                   strings, `tokenizer_class` and the chat template this server renders

The chat form renders exactly as /v1/chat/completions does (atomd/api/chat_templates.py), so
its `tokens` are the prompt a chat request with the same messages gets. Bounded as the
generation routes are (atomd/api/limits.py): the prompt's characters, the messages and tools,
JSON nesting, the number of token ids; every token id must be in the vocabulary.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from atomd.api import chat_templates, protocol, validation
from atomd.api import limits as L
from atomd.api.http import json_response


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    messages: list[protocol.ChatMessage]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's; not implemented: only false
    add_special_tokens: bool = False  # the template writes them
    return_token_strs: bool = False
    chat_template: str | None = None  # with --trust-request-chat-template, as on chat completions
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[protocol.ToolDefinition] | None = None


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def request_type(body: bytes) -> type[msgspec.Struct]:
    """The chat form when the body has `messages`, else the prompt form (whose decoding
    names whatever else is wrong)."""
    try:
        peek = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return TokenizeCompletionRequest
    return TokenizeChatRequest if isinstance(peek, dict) and "messages" in peek else TokenizeCompletionRequest


def check_limits(req: msgspec.Struct, limits: L.RequestLimits) -> None:
    too_large = validation.too_large
    if isinstance(req, TokenizeCompletionRequest):
        if len(req.prompt) > limits.max_prompt_chars:
            raise too_large("prompt", f"a prompt of {len(req.prompt)} characters", limits.max_prompt_chars,
                            "max-prompt-chars")
        return
    for name in ("messages", "tools", "chat_template_kwargs"):
        value = getattr(req, name)
        if value is not None and len(value) > limits.max_list_items:
            raise too_large(name, f"{len(value)} items", limits.max_list_items, "max-list-items")
    if L.json_depth(msgspec.to_builtins(req), limits.max_json_depth) > limits.max_json_depth:
        raise too_large("body", f"JSON nested deeper than {limits.max_json_depth} levels", limits.max_json_depth,
                        "max-json-depth")
    chars = sum(len(m.content) if isinstance(m.content, str) else
                sum(len(p.text or "") for p in m.content or ()) for m in req.messages)
    if chars > limits.max_prompt_chars:
        raise too_large("messages", f"messages of {chars} characters", limits.max_prompt_chars, "max-prompt-chars")
    if req.chat_template is not None and len(req.chat_template) > limits.max_chat_template_chars:
        raise too_large("chat_template", f"a template of {len(req.chat_template)} characters",
                        limits.max_chat_template_chars, "max-chat-template-chars")


def tokenize(server: Any, body: bytes) -> TokenizeResponse:
    """On a parser thread. `server`: atomd/api/server.py's Server."""
    req = protocol.decode_request(body, request_type(body))
    server.check_model(req)
    check_limits(req, server.limits)
    tok = server.tokenizer
    if isinstance(req, TokenizeCompletionRequest):
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens) if req.prompt else []
    else:
        if req.continue_final_message:
            raise protocol.APIError(400, "continue_final_message=True is not supported by this server; leave it out",
                                    param="continue_final_message", code="unsupported_field")
        chat = protocol.ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                              chat_template=req.chat_template,
                                              chat_template_kwargs=req.chat_template_kwargs)
        tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
        ids = chat_templates.prompt_ids(tok, chat, validation.chat_messages(chat), tools,
                                        server.args.trust_request_chat_template, server.limits.max_prompt_chars,
                                        req.add_special_tokens)
    strs = [tok.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeResponse(len(ids), server.max_model_len, ids, strs)


def detokenize(server: Any, body: bytes) -> DetokenizeResponse:
    req = protocol.decode_request(body, DetokenizeRequest)
    server.check_model(req)
    if len(req.tokens) > server.limits.max_prompt_chars:
        raise validation.too_large("tokens", f"{len(req.tokens)} token ids", server.limits.max_prompt_chars,
                                   "max-prompt-chars")
    return DetokenizeResponse(server.tokenizer.decode(server.check_token_ids(req.tokens, "tokens")))


def _plain(value: Any) -> Any:
    """tokenizer_config.json's values with AddedToken objects ({"content": ...}) as their text."""
    if isinstance(value, dict):
        return value["content"] if isinstance(value.get("content"), str) else {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's config, special tokens as text, its class and
    the chat template this server renders (--chat-template included). The per-id table of
    added tokens is left out (the vocabulary's business, and large)."""
    info = {k: _plain(v) for k, v in tokenizer.config.items() if k != "added_tokens_decoder"}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name)
    info["chat_template"] = tokenizer.chat_template
    return info


def add_routes(app: web.Application, server: Any) -> None:
    async def run(request: web.Request, fn) -> web.Response:
        body = await server.read_request(request)  # 503 while loading, 413 over the body limit
        answer = await asyncio.get_running_loop().run_in_executor(server.parser, fn, server, body)
        return json_response(answer)

    async def tokenize_route(request: web.Request) -> web.Response:
        return await run(request, tokenize)

    async def detokenize_route(request: web.Request) -> web.Response:
        return await run(request, detokenize)

    async def tokenizer_info_route(request: web.Request) -> web.Response:
        server.require_engine()
        return json_response(tokenizer_info(server.tokenizer))

    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/tokenizer_info", tokenizer_info_route)
