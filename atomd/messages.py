"""What crosses the API process <-> engine core boundary (torch-free: the API side imports it).

`RequestOutput` is the one output type: `LLMEngine.step()` returns it, the core sends it
as is, the server renders it. The rest are the IPC messages (atomd/engine/core.py runs the core
side, atomd/api/core_client.py the API side), msgspec msgpack over two ZMQ PUSH/PULL sockets:

  API -> core (input)    AddRequest       prompt token ids + SamplingParams (+ kv_transfer_params)
                         AbortRequests    ids whose client went away: the engine frees their blocks
                         UtilityCall      stats / reset_prefix_cache / ...: one UtilityResult each
  core -> API (output)   Ready            sent once, after the engine is built
                         StepOutputs      one per engine step: the RequestOutputs of that step
                         UtilityResult    the answer to a UtilityCall (result or error)
                         CoreError        a frame the core could not decode (the loop goes on),
                                          or a fatal error just before the core exits
"""
from __future__ import annotations

from typing import Any

import msgspec

from kv_transfer.params import KVTransferParams
from contracts.errors import ErrorCode
from contracts.sampling import SamplingParams
from contracts.logprobs import Logprob


class RequestOutput(msgspec.Struct, array_like=True):
    """What one engine step changed for one choice of a request: new tokens, or the end
    (finished by a stop, aborted, or ended without generating: `error` and `error_code` set).

    `index` is the choice (n > 1: the choices' outputs interleave as they are produced).
    `finish_reason` is set on a choice's last output; `finished` only on the request's last
    output, once every choice is done. With best_of > n nothing comes until every
    candidate is done; then the n best (by cumulative logprob) come in rank order, each
    with all its tokens, `index` = rank. `prompt_logprobs` (asked for) rides on the
    request's first output: one entry per prompt token, None for the first."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob | None] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from a prefix cache (ours or, in PD, P's)
    kv_transfer_params: KVTransferParams | None = None  # P's, for D (a struct on the wire, JSON at the HTTP edge)
    error: str | None = None
    error_code: ErrorCode | None = None  # how the API answers `error` (atomd/api/server.py)
    # engine clock, on the finished output only: (arrival, first_scheduled, first_token, finished)
    timing: tuple[float | None, float | None, float | None, float | None] | None = None
    index: int = 0
    prompt_logprobs: list[Logprob | None] | None = None  # one per prompt token, None for the first
    embedding: list[float] | None = None  # a pooling request's vector, on its finished output


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None  # parsed once, by the API
    lora_name: str | None = None  # the LoRA adapter the request's `model` names; None: the base model


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    call_id: int
    method: str
    args: list[Any] = []


class Ready(msgspec.Struct, tag="ready"):
    model_name: str


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutput]


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreError(msgspec.Struct, tag="error"):
    message: str
    fatal: bool = False


InputMessage = AddRequest | AbortRequests | UtilityCall
OutputMessage = Ready | StepOutputs | UtilityResult | CoreError
UTILITY_METHODS = ("stats", "reset_prefix_cache", "kv_transfer_info", "kv_transfer_abort",
                   "load_lora_adapter", "unload_lora_adapter", "list_lora_adapters")
