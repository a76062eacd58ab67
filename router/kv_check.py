"""A prefill worker's kv_transfer_params, checked before the router signs them for D.

The router's signature tells D "these came from a prefill worker through me": D trusts
them. So what D will index or subscript is checked here first, types and ranges: token
ids non-negative and below the vocabulary when the worker's /kv_transfer_info reports it
(`vocab_size`; else below 2^24, far above any model's vocabulary),
the first token's logprob entry in the sampler's shape (`{"logprob": float, "top":
[[id, logprob], ...], "rank"?: int}`, at most MAX_TOP alternatives), prompt logprobs one
such entry (or null) per prompt token, lists bounded. A prefill worker that answers
anything else is broken or hostile: a worker fault (502 or a retry on another P), never
forwarded to D. KVTransferParams (kv_transfer/params.py) has already checked the rest.
"""
from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kv_transfer.params import KVTransferParams

MAX_TOKEN_ID = (1 << 24) - 1  # the largest vocabularies are ~2^18
MAX_TOP = 20  # as the engines' MAX_LOGPROBS
MAX_DRAFTS = 64
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class LogprobEntry(msgspec.Struct):
    logprob: float
    top: Annotated[list[tuple[TokenId, float]], msgspec.Meta(max_length=MAX_TOP)] = []
    rank: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ProducerParams(msgspec.Struct):
    first_token_id: TokenId | None = None
    first_token_logprobs: LogprobEntry | None = None
    draft_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_DRAFTS)] = []
    prompt_logprobs: list[LogprobEntry | None] | None = None


def check_producer_params(kv: dict[str, Any], params: KVTransferParams, vocab_size: int | None) -> None:
    """ValueError naming the first bad field of a prefill worker's `kv` (`params`: as parsed)."""
    try:
        checked = msgspec.convert(kv, ProducerParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid kv_transfer_params: {e}") from None
    if vocab_size is not None:
        ids = [checked.first_token_id] if checked.first_token_id is not None else []
        ids += checked.draft_token_ids
        if checked.first_token_logprobs is not None:
            ids += [t for t, _ in checked.first_token_logprobs.top]
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"invalid kv_transfer_params: token id {bad} is outside the vocabulary "
                             f"({vocab_size} tokens)")
    if checked.prompt_logprobs is not None and len(checked.prompt_logprobs) > params.num_prompt_tokens + 1:
        raise ValueError(f"invalid kv_transfer_params: {len(checked.prompt_logprobs)} prompt_logprobs entries "
                         f"for {params.num_prompt_tokens} prompt tokens")
