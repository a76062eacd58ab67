"""OpenAI wire types for `atomd serve`: requests, responses, stream chunks, errors.

Requests are decoded straight from the body bytes with msgspec (types checked on the
way in); `check_*` adds the range checks msgspec cannot express. Every failure is an
`APIError`, which the server renders as `{"error": {"message", "type", "param", "code"}}`
with the right status, so a bad field never reaches the engine.
"""
from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from kv_transfer.params import KVTransferParams
from scheduler.sequence import SamplingParams

MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An OpenAI-style error: HTTP status plus the body's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> bytes:
        return msgspec.json.encode({"error": {"message": self.message, "type": self.type,
                                              "param": self.param, "code": self.code}})


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# ---------------------------------------------------------------- requests

class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints; vLLM's extensions (top_k, ignore_eos, ...) included."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # parsed by validate_*_request
    user: str | None = None
    data_parallel_rank: int | None = None  # vLLM's: pin the request to one DP rank


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of token ids, or a list of one string / one token list:
    # msgspec cannot express that union, `prompt_input` checks it.
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]):
    """Body bytes -> request struct, or a 400 naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        at, missing = _AT.search(text), _MISSING.search(text)
        path = [m.group(1) for m in (at, missing) if m and m.group(1)]
        raise invalid(".".join(path) or None, text) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None


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
        out.append({"role": m.role, "content": content})
    return out


class Checked(msgspec.Struct):
    """What validation derived from a request: the logprobs count (None: no logprobs) and
    the parsed kv_transfer_params (parsed here once; the engine keeps this struct)."""

    logprobs: int | None
    kv_transfer_params: KVTransferParams | None


def _check_common(req: _SamplingFields) -> KVTransferParams | None:
    """Checks of the fields SamplingParams does not own (it checks the sampling ranges)."""
    kv_params = None
    if req.kv_transfer_params is not None:
        try:  # a malformed one never reaches the engine
            kv_params = KVTransferParams.from_json_obj(req.kv_transfer_params)
        except ValueError as e:
            raise invalid("kv_transfer_params", str(e)) from None
    if req.n != 1:
        raise invalid("n", f"n={req.n} is not supported; only n=1")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise invalid(name, f"{name} is not supported; leave it at 0")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    return kv_params


def validate_completion_request(req: CompletionRequest) -> Checked:
    """Every check of a /v1/completions body but the sampling ranges (`sampling_params`)
    and the length policy (the server's, which needs the tokenized prompt)."""
    kv_params = _check_common(req)
    if req.echo:
        raise invalid("echo", "echo is not supported")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise invalid("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
    check_max_tokens("max_tokens", req.max_tokens)
    return Checked(req.logprobs, kv_params)


def validate_chat_request(req: ChatCompletionRequest) -> Checked:
    """As validate_completion_request, for /v1/chat/completions."""
    kv_params = _check_common(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs=true")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise invalid("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
    check_max_tokens("max_tokens", req.max_tokens)
    check_max_tokens("max_completion_tokens", req.max_completion_tokens)
    return Checked((req.top_logprobs or 0) if req.logprobs else None, kv_params)


def check_max_tokens(param: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise invalid(param, f"{param} must be at least 1, got {value}")


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output)
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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


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
    content: str


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


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


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET
    kv_transfer_params: dict | None | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "atomd"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
