"""`POST /v1/responses`: OpenAI's Responses API over the chat pipeline.

A Responses request becomes a chat request (`to_chat`): `instructions` a system message
first, `input` (a string: one user message; or items: messages with text content parts,
`function_call` items as an assistant turn's tool calls, `function_call_output` items as
tool messages; `reasoning` items are not fed back, as vLLM does), `max_output_tokens`,
`temperature`, `top_p`, `text.format` (text, json_object, json_schema: the structured
outputs of chat), function `tools` and `tool_choice` (the tool-call parser of
--tool-call-parser). That chat request is checked, rendered and sampled exactly as on
/v1/chat/completions; the renderer (`ResponsesRenderer`, a ChatRenderer) turns the parsed
output into output items: a `reasoning` item (with --reasoning-parser), a `message` item with
one `output_text` part, `function_call` items. Streamed, as OpenAI's events
(`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` / `.done`,
`response.reasoning_text.delta` / `.done`, `response.function_call_arguments.delta` / `.done`,
`response.content_part.done`, `response.output_item.done`, `response.completed`), each with
its `sequence_number`, then `data: [DONE]` (which the openai client and the router expect).

`previous_response_id`: a stored response's conversation (its input after expansion, without
its instructions, and its output) goes before this request's input. The store is in memory,
per engine, bounded (`--max-stored-responses`, oldest evicted first); `store: false` keeps
a response out of it. An unknown or evicted id is a 404 `previous_response_not_found`.
`include`: `message.output_text.logprobs` (with `top_logprobs`); `reasoning.effort`: the chat
template's `reasoning_effort` (vLLM's mapping); built-in tools: a 400 naming the type; stored
responses, GET / DELETE / cancel and background mode: atomd/api/responses_store.py. Fields of
OpenAI's schema this server does not implement are accepted only at the value that asks for
nothing (`truncation` "disabled", `service_tier` "auto", ...), else a 400 `unsupported_field`,
as on the other routes.
"""
from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any, Literal

import msgspec
from aiohttp import web

from atomd.api import protocol, responses_store, validation
from atomd.api import limits as L
from atomd.api.renderers import Choice, ChatRenderer
from atomd.api.responses_store import ResponseStore

# Responses fields not implemented, with the values that ask for nothing more
UNSUPPORTED = {"truncation": (None, "disabled"), "service_tier": (None, "auto", "default"), "max_tool_calls": (None,),
               "prompt": (None,), "prompt_cache_key": (None,), "safety_identifier": (None,), "conversation": (None,),
               "stream_options": (None,)}
# a chat field's name in a Responses request (errors name what the client sent); a message's
# index is not the input item's (instructions and a previous response come first), so
# `messages[i]...` becomes plain `input`
PARAM_NAMES = {"max_completion_tokens": "max_output_tokens",
               "response_format.json_schema.schema": "text.format.schema", "response_format": "text.format"}


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]  # OpenAI's built-in tools (web_search, ...) are not served: a 400 naming them
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class Reasoning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # a summary is not written here: refused
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (FunctionTool); a built-in one is a 400 naming it
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # PD: written by the router only
    # vLLM's extensions: the response's id (the router mints it, to find the engine that
    # stored it), a seed, and structured outputs as on chat (regex, choice, grammar, json)
    request_id: str | None = None
    seed: int | None = None
    priority: int = 0  # with --scheduling-policy priority: lower runs first (as on chat)
    structured_outputs: protocol.StructuredOutputsRequest | None = None
    reasoning: Reasoning | None = None  # effort: the chat template's `reasoning_effort`, as vLLM
    include: list[str] | None = None  # INCLUDABLE only
    top_logprobs: int | None = None  # with include message.output_text.logprobs
    background: bool = False  # atomd/api/responses_store.py
    truncation: Any = msgspec.UNSET
    service_tier: Any = msgspec.UNSET
    max_tool_calls: Any = msgspec.UNSET
    prompt: Any = msgspec.UNSET
    prompt_cache_key: Any = msgspec.UNSET
    safety_identifier: Any = msgspec.UNSET
    conversation: Any = msgspec.UNSET
    stream_options: Any = msgspec.UNSET


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise protocol.invalid(f"{where}.content[{j}]", "only text content parts (input_text, output_text) "
                                                               "are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise protocol.invalid(f"{where}.content", "content must be a string or a list of text parts")


def _str_field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise protocol.invalid(f"{where}.{name}", f"{where}.{name} must be a string")
    return value


def input_messages(items: str | list[dict[str, Any]], limits: L.RequestLimits) -> list[protocol.ChatMessage]:
    """`input` as chat messages (see the module doc)."""
    if isinstance(items, str):
        return [protocol.ChatMessage("user", items)]
    if len(items) > limits.max_list_items:
        raise validation.too_large("input", f"{len(items)} items", limits.max_list_items, "max-list-items")
    if L.json_depth(items, limits.max_json_depth) > limits.max_json_depth:
        raise validation.too_large("input", f"JSON nested deeper than {limits.max_json_depth} levels",
                                   limits.max_json_depth, "max-json-depth")
    out: list[protocol.ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise protocol.invalid(f"{where}.role", "role must be one of user, system, developer, assistant")
            out.append(protocol.ChatMessage(role, _text_of(item.get("content"), where)))
        elif kind == "function_call":
            call = protocol.ToolCallIn(id=_str_field(item, "call_id", where), function=protocol.FunctionCall(
                _str_field(item, "name", where), _str_field(item, "arguments", where)))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)  # parallel calls: one assistant turn
            elif last is not None and last.role == "assistant":
                last.tool_calls = [call]
            else:
                out.append(protocol.ChatMessage("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(protocol.ChatMessage("tool", _text_of(output, where) if not isinstance(output, str) else output,
                                            tool_call_id=_str_field(item, "call_id", where)))
        elif kind == "reasoning":
            continue  # not fed back into the prompt
        else:
            raise protocol.invalid(f"{where}.type", f"input item type {kind!r} is not supported; expected message, "
                                                   "function_call, function_call_output or reasoning")
    return out


def check_unsupported(req: ResponsesRequest) -> None:
    for name, noops in UNSUPPORTED.items():
        value = getattr(req, name)
        if value is not msgspec.UNSET and not any(validation._same(value, v) for v in noops):
            raise protocol.APIError(400, f"{name}={value!r} is not supported by this server; leave it out",
                                    param=name, code="unsupported_field")


# `include` values this server honours; OpenAI's others need what it has not (built-in tools'
# results, images, encrypted reasoning)
INCLUDABLE = ("message.output_text.logprobs",)
# OpenAI's built-in tool types: no tool server runs them here (vLLM without one says the same)
BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use",
                 "computer_use_preview", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")


def wants_logprobs(req: ResponsesRequest) -> bool:
    return bool(req.include) and "message.output_text.logprobs" in req.include


def check_include(req: ResponsesRequest) -> None:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= validation.MAX_LOGPROBS:
        raise protocol.invalid("top_logprobs", f"top_logprobs must be in [0, {validation.MAX_LOGPROBS}], "
                                               f"got {req.top_logprobs}")
    for i, value in enumerate(req.include or ()):
        if value not in INCLUDABLE:
            raise protocol.APIError(400, f"include[{i}]: {value!r} cannot be included by this server (it has no "
                                         f"built-in tools, images or encrypted reasoning); it can include "
                                         f"{', '.join(INCLUDABLE)}", param="include", code="unsupported_field")


def reasoning_kwargs(req: ResponsesRequest, template: str | None) -> dict[str, Any] | None:
    """`reasoning.effort` as the chat template's `reasoning_effort` variable (vLLM's mapping);
    a 400 when the template does not read it (the effort would do nothing) or for a summary."""
    r = req.reasoning
    if r is None:
        return None
    if r.summary is not None or r.generate_summary is not None:
        raise protocol.APIError(400, "reasoning.summary: this server does not summarise reasoning (the reasoning "
                                     "item carries the reasoning text itself); leave it out",
                                param="reasoning.summary", code="unsupported_field")
    if r.effort is None:
        return None
    if template is None or "reasoning_effort" not in template:
        raise protocol.APIError(400, f"reasoning.effort={r.effort!r}: this model's chat template does not read "
                                     "reasoning_effort, so the effort would change nothing; leave it out (or serve "
                                     "a --chat-template that reads it)", param="reasoning.effort",
                                code="unsupported_field")
    return {"reasoning_effort": r.effort}


def function_tools(tools: list[dict[str, Any]]) -> list[protocol.ToolDefinition]:
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind != "function":
            what = f"the built-in tool {kind!r} is not available: this deployment has no tool server" \
                if kind in BUILTIN_TOOLS else f"tool type {kind!r} is not supported"
            raise protocol.APIError(400, f"tools[{i}]: {what}; only function tools are served",
                                    param=f"tools[{i}].type", code="unsupported_field")
        try:
            f = msgspec.convert(t, FunctionTool)
        except msgspec.ValidationError as e:
            raise protocol.invalid(f"tools[{i}]", f"tools[{i}]: {e}") from None
        if not f.name:
            raise protocol.invalid(f"tools[{i}].name", f"tools[{i}]: a function tool needs a name")
        out.append(protocol.ToolDefinition("function", protocol.FunctionDefinition(
            name=f.name, description=f.description, parameters=f.parameters, strict=f.strict)))
    return out


REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")


def to_chat(req: ResponsesRequest, store: ResponseStore, limits: L.RequestLimits, template: str | None = None
            ) -> tuple[protocol.ChatCompletionRequest, list[protocol.ChatMessage]]:
    """(the chat request, the conversation to store: history and input, no instructions)."""
    check_unsupported(req)
    check_include(req)
    if req.request_id is not None and not REQUEST_ID.fullmatch(req.request_id):
        raise protocol.invalid("request_id", "request_id must be 1-200 printable ASCII characters")
    history = list(store.get(req.previous_response_id)) if req.previous_response_id is not None else []
    conversation = history + input_messages(req.input, limits)
    if not conversation:
        raise protocol.invalid("input", "input must not be empty")
    messages = ([protocol.ChatMessage("system", req.instructions)] if req.instructions else []) + conversation
    if len(req.tools or ()) > limits.max_list_items:
        raise validation.too_large("tools", f"{len(req.tools)} tools", limits.max_list_items, "max-list-items")
    tools = function_tools(req.tools) if req.tools is not None else None
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        choice = protocol.NamedToolChoice("function", protocol.ToolChoiceFunction(choice.name))
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None:
        response_format = protocol.ResponseFormat(fmt.type, protocol.JSONSchemaFormat(
            name=fmt.name, schema=fmt.schema, description=fmt.description, strict=fmt.strict)
            if fmt.type == "json_schema" else None)
    chat = protocol.ChatCompletionRequest(
        messages=messages, model=req.model, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, stream=req.stream, tools=tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format, user=req.user, kv_transfer_params=req.kv_transfer_params, seed=req.seed,
        structured_outputs=req.structured_outputs, priority=req.priority,
        chat_template_kwargs=reasoning_kwargs(req, template),
        **({"logprobs": True, "top_logprobs": req.top_logprobs or 0} if wants_logprobs(req) else {}))
    return chat, conversation


def renamed(e: protocol.APIError) -> protocol.APIError:
    """A chat check's error, naming the Responses field."""
    if e.param is None:
        return e
    if e.param.split("[")[0].split(".")[0] == "messages":
        e.param = "input"
    else:
        e.param = PARAM_NAMES.get(e.param, e.param)
    return e


class ResponsesRenderer(ChatRenderer):
    """One choice's parsed output as Responses output items (see the module doc)."""

    def __init__(self, server: Any, request_id: str, req: protocol.ChatCompletionRequest, checked, prompt_ids,
                 rreq: ResponsesRequest, conversation: list[protocol.ChatMessage], store: ResponseStore):
        super().__init__(server, request_id, req, checked, prompt_ids)
        self.rreq, self.conversation, self.store = rreq, conversation, store
        self.input_items = responses_store.input_items(rreq.input)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items, in order (streaming)
        self.open: dict[str, Any] | None = None  # the item being streamed (reasoning or message)
        self.response_stored = False

    # ------------------------------------------------------------ the response object

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        r = self.rreq
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "error": None, "incomplete_details": None, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {}, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort, "summary": None} if r.reasoning is not None else None,
            "background": r.background, "top_logprobs": r.top_logprobs or 0, "store": r.store,
            "temperature": r.temperature, "top_p": r.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "tool_choice": msgspec.to_builtins(r.tool_choice) if r.tool_choice is not None else "auto",
            "tools": [msgspec.to_builtins(t) for t in r.tools or ()], "truncation": "disabled", "user": r.user,
            "usage": None}
        if status != "in_progress":
            c = self.choices[0]
            if c.finish_reason == "length":
                body["status"] = "incomplete"
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            reasoning = "".join(t["text"] for it in output if it["type"] == "reasoning" for t in it["content"])
            u = self.usage()
            body["usage"] = {"input_tokens": u.prompt_tokens,
                             # cache_write_tokens: OpenAI's billed prompt-cache writes; none here
                             "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens,
                                                      "cache_write_tokens": 0},
                             "output_tokens": u.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": len(
                                 self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0},
                             "total_tokens": u.total_tokens}
            if self.kv_transfer_params is not None:  # P's answer in PD (the router reads it)
                body["kv_transfer_params"] = self.kv_transfer_params
            self.remember(body, output)
        return body

    def remember(self, body: dict[str, Any], output: list[dict[str, Any]]) -> None:
        if not self.rreq.store or self.response_stored or self.kv_transfer_params is not None:
            return
        self.response_stored = True
        text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
        calls = [protocol.ToolCallIn(id=it["call_id"], function=protocol.FunctionCall(it["name"], it["arguments"]))
                 for it in output if it["type"] == "function_call"]
        self.store.completed(self.id, body, self.conversation + [protocol.ChatMessage(
            "assistant", text or None, tool_calls=calls or None)], self.input_items)

    def text_logprobs(self, c: Choice, text: str) -> list[dict[str, Any]]:
        """include message.output_text.logprobs: the logprobs of the tokens that make up `text`
        (the output after the reasoning and tool-call parsers took theirs out)."""
        if self.num_logprobs is None or not text:
            return []
        items = c.logprobs
        start = c.text.rfind(text)
        if start > 0:  # reasoning (or a call) came first: the tokens from the text's first character on
            pos, first = 0, len(items)
            for k, (tid, _) in enumerate(items):
                if pos >= start:
                    first = k
                    break
                pos += len(self.token_text(tid))
            items = items[first:]
        return msgspec.to_builtins(self.logprobs_block(items).content)

    @staticmethod
    def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    @staticmethod
    def message_item(text: str, status: str = "completed", logprobs: list | None = None) -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}

    @staticmethod
    def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def full_response(self) -> bytes:
        message, _ = self.message(self.choices[0])
        output = []
        if message.reasoning_content:
            output.append(self.reasoning_item(message.reasoning_content))
        if message.content:
            output.append(self.message_item(message.content,
                                            logprobs=self.text_logprobs(self.choices[0], message.content)))
        output.extend(self.call_item(call) for call in (message.tool_calls or ()))
        return msgspec.json.encode(self.response("completed", output))

    # ------------------------------------------------------------ events

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return msgspec.json.encode({"type": kind, "sequence_number": self.seq - 1, **fields})

    def chunks(self, c: Choice, text: str, items, finish_reason, final: bool) -> list[bytes]:
        out = []
        if not c.started:
            out.append(self.event("response.created", response=self.response("in_progress", [])))
            out.append(self.event("response.in_progress", response=self.response("in_progress", [])))
        deltas, _ = self.parsed_deltas(c, text)
        for d in deltas:
            if d.reasoning_content:
                out += self.open_item("reasoning")
                self.open["content"][0]["text"] += d.reasoning_content
                out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items), content_index=0, delta=d.reasoning_content))
            if d.content:
                out += self.open_item("message")
                self.open["content"][0]["text"] += d.content
                out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items), content_index=0, delta=d.content, logprobs=[]))
            for call in d.tool_calls or ():
                if "id" in call:  # a call's first delta: id and name (its arguments follow in the next)
                    out += self.close_item()
                    item = self.call_item({"id": call["id"], "function": dict(call["function"], arguments="")},
                                          "in_progress")
                    self.open = item
                    out.append(self.event("response.output_item.added", output_index=len(self.items), item=item))
                else:
                    args = call["function"]["arguments"]
                    self.open["arguments"] = args
                    out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                          output_index=len(self.items), delta=args))
                    out.append(self.event("response.function_call_arguments.done", item_id=self.open["id"],
                                          output_index=len(self.items), arguments=args, name=self.open["name"]))
                    out += self.close_item()
        if c.finished:
            out += self.close_item()
        return out

    def open_item(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self.close_item()
        self.open = self.reasoning_item("", "in_progress") if kind == "reasoning" else self.message_item("",
                                                                                                      "in_progress")
        index = len(self.items)
        out.append(self.event("response.output_item.added", output_index=index, item=dict(self.open, content=[])))
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def close_item(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = len(self.items), []
        item["status"] = "completed"
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] = self.text_logprobs(self.choices[0], part["text"])  # whole, at the end
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=part["logprobs"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return out

    def stream_end(self) -> list[bytes]:
        return [self.event("response.completed", response=self.response("completed", self.items))]


def add_routes(app: web.Application, server: Any) -> None:
    """`server`: atomd/api/server.py's Server (not imported: it imports this module)."""
    store = ResponseStore(server.args.max_stored_responses, server.args.max_background_responses)

    def parse(body: bytes):
        rreq = protocol.decode_request(body, ResponsesRequest)
        try:
            chat, conversation = to_chat(rreq, store, server.limits, server.tokenizer.chat_template)
            return (rreq, chat, conversation, *server.prepare_chat(chat))
        except protocol.APIError as e:
            raise renamed(e) from None

    async def create(request: web.Request) -> web.StreamResponse:
        body = await server.read_request(request)
        rreq, chat, conversation, checked, ids, params = await asyncio.get_running_loop().run_in_executor(
            server.parser, parse, body)
        out = ResponsesRenderer(server, rreq.request_id or f"resp_{uuid.uuid4().hex}", chat, checked, ids, rreq,
                                conversation, store)
        try:
            if rreq.background:
                return responses_store.start_background(server, request, store, out, chat, checked, ids, params)
            return await server.generate(request, chat, checked, ids, params, out)
        except protocol.APIError as e:
            raise renamed(e) from None

    app.router.add_post("/v1/responses", create)
    responses_store.add_routes(app, server, store)  # GET / DELETE /v1/responses/{id}, .../cancel, .../input_items
