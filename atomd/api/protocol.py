"""OpenAI wire types for `atomd serve`: requests, responses, stream chunks, errors.

Requests are decoded straight from the body bytes with msgspec (types checked on the
way in); `check_*` adds the range checks msgspec cannot express. Every failure is an
`APIError`, which the server renders as `{"error": {"message", "type", "param", "code"}}`
with the right status, so a bad field never reaches the engine.

No field is silently ignored: the request structs forbid unknown fields (msgspec
`forbid_unknown_fields`), so a field this server does not know is a 400 naming it, and a
known OpenAI / vLLM field it does not implement (`UNSUPPORTED_FIELDS`) is a 400 saying so.
A supported field with a value this server cannot honour is a 400 naming it as well.
"""
from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from atomd.api import limits as L
from kv_transfer.params import KVTransferParams
from scheduler.sequence import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_MESSAGE_CHARS = 1024  # an error message quotes at most this much (client input included)
MAX_N = 128  # n and best_of (OpenAI's limit for n)
# Fields of OpenAI's or vLLM's request schemas this server does not implement, with the
# values that ask for nothing more than what it does (a client sending a default is not
# refused). Any other value is a 400 naming the field (`check_unsupported`).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "service_tier": (None, "auto", "default"),
    "store": (None, False), "metadata": (None, {}), "web_search_options": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1.0), "early_stopping": (None, False),
    "truncate_prompt_tokens": (None,), "prompt_embeds": (None,),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "logits_processors": (None, []), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "documents": (None,), "continue_final_message": (None, False), "priority": (None, 0),
    "cache_salt": (None,), "vllm_xargs": (None, {}),
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# implemented on chat (atomd/api/tools.py, atomd/api/chat_templates.py), unsupported on completions
CHAT_ONLY_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs")
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


class APIError(Exception):
    """An OpenAI-style error: HTTP status plus the body's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        if len(message) > MAX_MESSAGE_CHARS:  # never echo a huge client value back
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> bytes:
        return msgspec.json.encode({"error": {"message": self.message, "type": self.type,
                                              "param": self.param, "code": self.code}})


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# ---------------------------------------------------------------- requests

class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _UnsupportedFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Declared so that a default value passes and any other is refused by name."""

    suffix: Any = msgspec.UNSET
    tools: Any = msgspec.UNSET
    tool_choice: Any = msgspec.UNSET
    functions: Any = msgspec.UNSET
    function_call: Any = msgspec.UNSET
    parallel_tool_calls: Any = msgspec.UNSET
    audio: Any = msgspec.UNSET
    modalities: Any = msgspec.UNSET
    prediction: Any = msgspec.UNSET
    reasoning_effort: Any = msgspec.UNSET
    service_tier: Any = msgspec.UNSET
    store: Any = msgspec.UNSET
    metadata: Any = msgspec.UNSET
    web_search_options: Any = msgspec.UNSET
    use_beam_search: Any = msgspec.UNSET
    length_penalty: Any = msgspec.UNSET
    early_stopping: Any = msgspec.UNSET
    truncate_prompt_tokens: Any = msgspec.UNSET
    prompt_embeds: Any = msgspec.UNSET
    skip_special_tokens: Any = msgspec.UNSET
    spaces_between_special_tokens: Any = msgspec.UNSET
    return_tokens_as_token_ids: Any = msgspec.UNSET
    return_token_ids: Any = msgspec.UNSET
    logits_processors: Any = msgspec.UNSET
    chat_template: Any = msgspec.UNSET
    chat_template_kwargs: Any = msgspec.UNSET
    documents: Any = msgspec.UNSET
    continue_final_message: Any = msgspec.UNSET
    priority: Any = msgspec.UNSET
    cache_salt: Any = msgspec.UNSET
    vllm_xargs: Any = msgspec.UNSET


class JSONSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format.json_schema`. The schema is enforced whatever `strict` says."""

    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's `response_format`: text (nothing asked), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one of these."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_UnsupportedFields, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by both endpoints; vLLM's extensions (top_k, min_p, repetition_penalty,
    ignore_eos, bad_words, allowed_token_ids, prompt_logprobs, ...) included."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a JSON key) -> bias
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # parsed by validate_*_request
    user: str | None = None
    data_parallel_rank: int | None = None  # vLLM's: pin the request to one DP rank
    # structured outputs (atomd/structured.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True, forbid_unknown_fields=True):
    # A string, a list of token ids, or a list of one string / one token list:
    # msgspec cannot express that union, `prompt_input` checks it.
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tool call of an earlier assistant turn."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    echo: Any = msgspec.UNSET  # vLLM's chat echo (prepend the last message): not implemented
    tools: list[ToolDefinition] | None = None  # atomd/api/tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None  # atomd/api/chat_templates.py (with --trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template


_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]):
    """Body bytes -> request struct, or a 400 naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        at, missing, unknown = _AT.search(text), _MISSING.search(text), _UNKNOWN.search(text)
        path = [m.group(1) for m in (at, missing, unknown) if m and m.group(1)]
        param = ".".join(path) or None
        if unknown:
            raise APIError(400, f"unknown field `{param}` (this server does not know it; a typo?)",
                           param=param, code="unknown_field") from None
        raise invalid(param, text) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:  # msgspec's nesting limit
        raise APIError(400, "invalid JSON body: nested too deeply", code="invalid_json") from None


def prompt_input(prompt: str | list[Any]) -> str | list[int]:
    """The single prompt of a completion request: text or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt must not be empty")
        return prompt
    if not prompt:
        raise invalid("prompt", "prompt must not be empty")
    if all(type(t) is int for t in prompt):
        return prompt
    if all(isinstance(t, (str, list)) for t in prompt):
        raise invalid("prompt", "a batch of several prompts is not supported; send one prompt per request")
    raise invalid("prompt", "prompt must be a string, a list of token ids, or a list of one string")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and plain-text content."""
    if not req.messages:
        raise invalid("messages", "messages must not be empty")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role",
                          f"unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}")
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise invalid(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:  # the template gets arguments as objects (vLLM does the same)
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text


class Checked(msgspec.Struct):
    """What validation derived from a request: the logprobs count (None: no logprobs), the
    parsed kv_transfer_params (parsed here once; the engine keeps this struct), the
    prompt logprobs count (asked, or echo with logprobs) and logit_bias by token id."""

    logprobs: int | None
    kv_transfer_params: KVTransferParams | None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # the grammar the output must follow
    tools: list[dict[str, Any]] | None = None  # chat: for the template (None: no tools in the prompt)
    parse_tool_calls: bool = False  # chat: the output's tool calls become `tool_calls`
    forced_tool_call: bool = False  # chat: a grammar forces the output to be tool calls


def check_unsupported(req: _UnsupportedFields) -> None:
    """A 400 naming the first unsupported field sent with a value that asks for something."""
    for name, noops in UNSUPPORTED.items():
        if name in CHAT_ONLY_FIELDS and isinstance(req, ChatCompletionRequest):
            continue  # implemented there
        value = getattr(req, name)
        if value is not msgspec.UNSET and not any(_same(value, v) for v in noops):
            raise APIError(400, f"{name}={value!r} is not supported by this server; leave it out",
                           param=name, code="unsupported_field")


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    return (isinstance(a, bool) == isinstance(b, bool)) and a == b


INT_MIN, INT_MAX = -2**63, 2**64 - 1  # what the engine's IPC (msgpack) can carry


def _first_huge_int(value: Any, path: str) -> str | None:
    """The path of the first integer in `value` no 64-bit field can hold, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return path if not INT_MIN <= value <= INT_MAX else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, int) and not INT_MIN <= key <= INT_MAX:
            return f"{path}.{key}"
        found = _first_huge_int(item, f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}")
        if found is not None:
            return found
    return None


def check_int_ranges(req: msgspec.Struct) -> None:
    """JSON integers are unbounded; every integer the engine takes is 64-bit: a 400 naming
    the field, instead of an overflow deep in the IPC."""
    for name in req.__struct_fields__:
        found = _first_huge_int(getattr(req, name), name)
        if found is not None:
            raise invalid(found.split(".")[0].split("[")[0], f"{found}: integer out of the 64-bit range")


def too_large(param: str, what: str, limit: int, flag: str | None) -> APIError:
    named = f" (--{flag})" if flag else ""
    return APIError(400, f"{param}: {what}; the limit is {limit}{named}", param=param, code="limit_exceeded")


def check_limits(req: _SamplingFields, limits: L.RequestLimits) -> None:
    """A 400 naming the field and the limit (atomd/api/limits.py) for a request whose lists,
    strings, grammars, JSON nesting or prompt exceed them: checked before anything is
    parsed further, tokenized or compiled."""
    if limits.max_prompt_chars:
        prompt = getattr(req, "prompt", None)
        if prompt is not None:
            size, name = (len(prompt) if isinstance(prompt, str) else
                          sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)), "prompt"
        else:
            size, name = sum(_content_chars(m.content) for m in req.messages), "messages"
            if req.chat_template_kwargs:  # rendered into the prompt too
                size += len(msgspec.json.encode(req.chat_template_kwargs))
        if size > limits.max_prompt_chars:
            raise too_large(name, f"a prompt of {size} characters (or token ids)", limits.max_prompt_chars,
                            "max-prompt-chars")
    template = req.chat_template
    if isinstance(template, str) and len(template) > limits.max_chat_template_chars:
        raise too_large("chat_template", f"a template of {len(template)} characters", limits.max_chat_template_chars,
                        "max-chat-template-chars")
    so = req.structured_outputs
    lists = [(name, getattr(req, name, None)) for name in L.LIST_FIELDS]
    lists.append(("structured_outputs.choice", so.choice if so is not None else None))
    for name, value in lists:
        if isinstance(value, (list, dict)) and len(value) > limits.max_list_items:
            raise too_large(name, f"{len(value)} items", limits.max_list_items, "max-list-items")
    deepest = L.json_depth(msgspec.to_builtins(req), limits.max_json_depth)
    if deepest > limits.max_json_depth:
        raise too_large("body", f"JSON nested deeper than {limits.max_json_depth} levels", limits.max_json_depth,
                        "max-json-depth")
    for name, value in lists:
        if name not in ("stop", "bad_words", "guided_choice", "structured_outputs.choice"):
            continue
        for item in ([value] if isinstance(value, str) else value or ()):
            if len(item) > limits.max_item_chars:
                raise too_large(name, f"an item of {len(item)} characters", limits.max_item_chars,
                                "max-item-chars")
    grammars = [("guided_regex", req.guided_regex), ("guided_grammar", req.guided_grammar),
                ("guided_json", req.guided_json), ("guided_choice", req.guided_choice)]
    if so is not None:
        grammars += [(f"structured_outputs.{k}", getattr(so, k)) for k in ("json", "regex", "choice", "grammar")]
    rf = req.response_format
    if rf is not None and rf.json_schema is not None:
        grammars.append(("response_format.json_schema.schema", rf.json_schema.schema))
    for name, value in grammars:
        if value is None:
            continue
        size = (len(value.encode()) if isinstance(value, str) else
                sum(len(c.encode()) for c in value) if isinstance(value, list) else len(msgspec.json.encode(value)))
        if size > limits.max_grammar_bytes:
            raise too_large(name, f"{size} bytes", limits.max_grammar_bytes, "max-grammar-bytes")
        if isinstance(value, str) and name.endswith("json") and \
                L.text_json_depth(value, limits.max_json_depth) > limits.max_json_depth:
            raise too_large(name, f"JSON nested deeper than {limits.max_json_depth} levels",
                            limits.max_json_depth, "max-json-depth")


def _content_chars(content: str | list[ContentPart] | None) -> int:
    if isinstance(content, list):
        return sum(len(p.text or "") for p in content)
    return len(content or "")


def _check_common(req: _SamplingFields, limits: L.RequestLimits) -> tuple[KVTransferParams | None,
                                                                           dict[int, float] | None]:
    """Checks of the fields SamplingParams does not own (it checks the sampling ranges)."""
    check_limits(req, limits)  # first: the checks below walk the request recursively
    check_unsupported(req)
    check_int_ranges(req)
    kv_params = None
    if req.kv_transfer_params is not None:
        try:  # a malformed one never reaches the engine
            kv_params = KVTransferParams.from_json_obj(req.kv_transfer_params)
        except ValueError as e:
            raise invalid("kv_transfer_params", str(e)) from None
    if not 1 <= req.n <= MAX_N:
        raise invalid("n", f"n must be in [1, {MAX_N}], got {req.n}")
    if req.best_of is not None:
        if not req.n <= req.best_of <= MAX_N:
            raise invalid("best_of", f"best_of must be in [n={req.n}, {MAX_N}], got {req.best_of}")
        if req.stream and req.best_of > req.n:
            raise invalid("best_of", "best_of > n cannot be streamed (the best choices are known only at the end)")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise invalid("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}")
    logit_bias = None
    if req.logit_bias is not None:
        logit_bias = {}
        for key, bias in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise invalid("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
            if token < 0:
                raise invalid("logit_bias", f"logit_bias keys must be token ids >= 0, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise invalid("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
            logit_bias[token] = bias
    return kv_params, logit_bias


def structured_request(req: _SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The grammar a request's structured-output fields ask for, and the field that asked
    (None, None: none). A 400 for two forms at once, an empty or ill-formed one, or a
    combination the grammar cannot honour; the grammar is compiled by `check_structured`."""
    forms: list[tuple[str, StructuredOutputsParams]] = []

    def make(param: str, **kw: Any) -> None:
        try:
            forms.append((param, StructuredOutputsParams(**kw)))
        except ValueError as e:
            raise invalid(param, str(e).replace("structured_outputs ", "", 1)) from None

    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            if rf.json_schema is not None:
                raise invalid("response_format.json_schema", "json_schema goes with type json_schema")
            make("response_format", json_object=True)
        elif rf.json_schema is None or rf.json_schema.schema is None:
            raise invalid("response_format.json_schema.schema", "type json_schema needs json_schema.schema")
        else:
            make("response_format.json_schema.schema", json=rf.json_schema.schema)
    so = req.structured_outputs
    if so is not None:
        given = {k: getattr(so, k) for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None}
        if so.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise invalid("structured_outputs", "structured_outputs must set exactly one of json, regex, choice, "
                                                f"grammar, json_object; got {sorted(given) or 'none'}")
        (key, value), = given.items()
        make(f"structured_outputs.{key}", **{key: value})
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name)
        if value is not None:
            make(name, **{name[len("guided_"):]: value})
    if not forms:
        return None, None
    if len(forms) > 1:
        raise invalid(forms[1][0].split(".")[0], f"only one structured-output form per request: "
                                                 f"{forms[0][0].split('.')[0]} and {forms[1][0].split('.')[0]} given")
    param, params = forms[0]
    if req.ignore_eos:
        raise invalid("ignore_eos", "ignore_eos cannot be combined with structured outputs (the grammar ends the "
                                    "output with the end token)")
    if req.min_tokens:
        raise invalid("min_tokens", "min_tokens cannot be combined with structured outputs (it could ban the only "
                                    "token the grammar allows)")
    return params, param


def check_structured(params: StructuredOutputsParams | None, param: str | None) -> None:
    """A 400 naming `param` when the grammar does not compile (llguidance's message)."""
    if params is None:
        return
    from atomd import structured

    try:
        structured.check(params)
    except ValueError as e:
        raise invalid(param, f"{param}: {e}") from None


def tool_plan(req: ChatCompletionRequest, tool_call_parser: str = "hermes") -> tuple[list[dict[str, Any]] | None, bool,
                                                   StructuredOutputsParams | None, str | None]:
    """(tools for the template, parse the output, grammar of a forced call, its field)."""
    from atomd.api import tools as T

    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise invalid("tool_choice", "tool_choice needs tools")
        return None, False, None, None
    for i, t in enumerate(req.tools):
        if not t.function.name:
            raise invalid(f"tools[{i}].function.name", "a function needs a name")
    if choice == "none":
        return None, False, None, None
    listed = [msgspec.to_builtins(t) for t in req.tools]
    if choice is None or choice == "auto":
        return listed, True, None, None
    if choice == "required":
        used = list(enumerate(req.tools))
    else:
        used = [(i, t) for i, t in enumerate(req.tools) if t.function.name == choice.function.name]
        if not used:
            raise invalid("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not in tools")
        used = used[:1]
    for i, t in used:  # each schema on its own first: a bad one is named
        if t.function.parameters:
            check_structured(StructuredOutputsParams(json=t.function.parameters), f"tools[{i}].function.parameters")
    several = choice == "required" and req.parallel_tool_calls is not False
    grammar = T.forced_grammar([(t.function.name, t.function.parameters) for _, t in used], several,
                               tool_call_parser)
    return listed, True, StructuredOutputsParams(grammar=grammar), "tool_choice"


def validate_completion_request(req: CompletionRequest, limits: L.RequestLimits = L.DEFAULT) -> Checked:
    """Every check of a /v1/completions body but the sampling ranges (`sampling_params`)
    and the length policy (the server's, which needs the tokenized prompt)."""
    kv_params, logit_bias = _check_common(req, limits)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise invalid("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
    check_max_tokens("max_tokens", req.max_tokens)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:  # vLLM: echo's logprobs
        prompt_logprobs = req.logprobs
    structured, param = structured_request(req)
    check_structured(structured, param)
    return Checked(req.logprobs, kv_params, prompt_logprobs, logit_bias, structured)


def validate_chat_request(req: ChatCompletionRequest, limits: L.RequestLimits = L.DEFAULT,
                          tool_call_parser: str = "hermes") -> Checked:
    """As validate_completion_request, for /v1/chat/completions."""
    kv_params, logit_bias = _check_common(req, limits)
    if req.echo is not msgspec.UNSET and not _same(req.echo, False) and req.echo is not None:
        raise APIError(400, f"echo={req.echo!r} is not supported on chat completions; leave it out",
                       param="echo", code="unsupported_field")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs=true")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise invalid("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
    check_max_tokens("max_tokens", req.max_tokens)
    check_max_tokens("max_completion_tokens", req.max_completion_tokens)
    structured, param = structured_request(req)
    tools, parse, forced, forced_param = tool_plan(req, tool_call_parser)
    if forced is not None:
        if structured is not None:
            raise invalid(param.split(".")[0], f"{param.split('.')[0]} cannot be combined with tool_choice "
                                               f"{'required' if req.tool_choice == 'required' else 'naming a function'}")
        structured, param = forced, forced_param
        if req.ignore_eos or req.min_tokens:
            raise invalid("ignore_eos" if req.ignore_eos else "min_tokens",
                          "cannot be combined with a forced tool call (a grammar ends the output)")
    check_structured(structured, param)
    return Checked((req.top_logprobs or 0) if req.logprobs else None, kv_params, req.prompt_logprobs, logit_bias,
                   structured, tools, parse, forced is not None)


def check_max_tokens(param: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise invalid(param, f"{param} must be at least 1, got {value}")


def sampling_params(req: _SamplingFields, max_tokens: int, checked: Checked) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, logprobs=checked.logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output, n=req.n, best_of=req.best_of,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=checked.logit_bias or None, bad_words=list(req.bad_words or []),
            allowed_token_ids=req.allowed_token_ids, prompt_logprobs=checked.prompt_logprobs,
            structured_outputs=checked.structured_outputs)
    except ValueError as e:  # SamplingParams starts its message with the field's name
        field = str(e).split(" ", 1)[0]
        raise invalid(field if field in SamplingParams.__struct_fields__ else None, str(e)) from None


# ---------------------------------------------------------------- responses

class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token of an echo
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob: one token of a prompt position (`prompt_logprobs`)."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: PromptLogprob}
# holding the prompt's own token and the top-k
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET
    kv_transfer_params: dict | None | msgspec.UnsetType = msgspec.UNSET


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str | None  # None: only tool calls
    tool_calls: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET  # OpenAI's, when the model called tools
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET  # with --reasoning-parser (vLLM's)


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser (vLLM's)
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's deltas: {index, id, type, function}


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    kv_transfer_params: dict | None | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | None | msgspec.UnsetType = msgspec.UNSET  # vLLM: top level for chat


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET
    kv_transfer_params: dict | None | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | None | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "atomd"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
