"""OpenAI request types for `atomd serve`, and its errors (responses: atomd/api/responses.py).

Requests are decoded straight from the body bytes with msgspec (types checked on the
way in); atomd/api/validation.py adds the range checks msgspec cannot express. Every failure is an
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
    "documents": (None,), "continue_final_message": (None, False),
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


class UnsupportedFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
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


class SamplingFields(UnsupportedFields, kw_only=True, forbid_unknown_fields=True):
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
    priority: int = 0  # vLLM's: lower runs first, with --scheduling-policy priority (else only 0)
    # structured outputs (atomd/structured.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    # A string, a list of token ids, or a list of strings / token-id lists (several prompts):
    # msgspec cannot express that union, `validation.prompt_inputs` checks it.
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    # OpenAI's other part types: declared so that one is refused by name (text models only)
    image_url: Any = msgspec.UNSET
    input_audio: Any = msgspec.UNSET
    file: Any = msgspec.UNSET


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


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
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
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content (--reasoning-parser) from the answer


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
