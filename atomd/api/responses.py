"""OpenAI response and stream chunk structs of `atomd serve`.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec

from kv_transfer.params import KVTransferParams


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
    kv_transfer_params: KVTransferParams | None | msgspec.UnsetType = msgspec.UNSET


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
    kv_transfer_params: KVTransferParams | None | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobs | None | msgspec.UnsetType = msgspec.UNSET  # vLLM: top level for chat


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET
    kv_transfer_params: KVTransferParams | None | msgspec.UnsetType = msgspec.UNSET
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
