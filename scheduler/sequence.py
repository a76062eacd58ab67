"""One request as the scheduler sees it: its tokens, its sampling rules and its state.

A `Sequence` only grows: tokens are appended after they are accepted (stop cuts happen
before the append), so every hash of a full block stays valid for the sequence's life,
also across preemption.

A request with `n > 1` or `best_of > 1` is one sequence until its first sampled token:
the prompt is prefilled once, then the sampler draws `best_of` first tokens from that
one row and the scheduler forks the sequence into `best_of` choices (`Sequence.fork`)
that share the prompt's KV blocks by reference count (docs/design.md "n and best_of").
Choice i samples with seed `seed + i` (vLLM's rule).
"""
from __future__ import annotations

import copy
import enum
import itertools
import time
from typing import Any

from contracts.errors import ErrorCode
from contracts.sampling import SamplingParams
from kv_transfer.params import KVTransferParams
from contracts.logprobs import Logprob


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # parked on a consumer while its prompt KV is pulled
    FINISHED = enum.auto()
    ABORTED = enum.auto()


class SequenceType(enum.Enum):
    PREFILL = enum.auto()
    DECODE = enum.auto()


# leave_reason (a code, never a message: the message is `error`) -> OpenAI finish_reason
_FINISH_REASONS = {"eos": "stop", "stop_token": "stop", "stop_string": "stop",
                   "max_tokens": "length", "max_model_len": "length", "aborted": "abort",
                   "unschedulable": "abort", "refused": "abort", "kv_transfer_failed": "abort"}


_ids = itertools.count()


class Sequence:
    """A request's tokens (prompt then completion) and the scheduler's view of its KV."""

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None, *,
                 request_id: str | None = None, arrive_time: float | None = None,
                 kv_transfer_params: KVTransferParams | None = None,
                 lora_name: str | None = None, lora_id: int | None = None):
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.id: int = next(_ids)
        self.request_id: str = request_id if request_id is not None else str(self.id)
        self.token_ids: list[int] = [int(t) for t in token_ids]
        self.num_prompt_tokens: int = len(self.token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.type = SequenceType.PREFILL
        self.num_computed_tokens = 0  # tokens whose KV is computed (position of the next one)
        self.block_table: list[int] = []
        # the LoRA adapter it runs under (None: the base model): by name (block hashes, PD) and the
        # engine's int id (KV events)
        self.lora_name, self.lora_id = lora_name, lora_id
        self.block_hashes: list[int] = []  # chained hash of each full block, a pure function of tokens and adapter
        self.num_published_blocks = 0  # blocks of block_table already in the prefix index
        self.num_released_blocks = 0  # leading blocks released as outside the sliding window (FREED in the table)
        self.spec_token_ids: list[int] = []  # drafts to verify in the next decode step
        self.leave_reason: str | None = None  # why it left: a key of _FINISH_REASONS
        self.error: str | None = None  # the message when it ended without generating (error_code set)
        self.error_code: ErrorCode | None = None  # set when it ended without generating
        self.stop_reason: int | str | None = None
        self.logprobs: list[Logprob | None] = []
        self.num_cached_tokens = 0  # prompt tokens served from a prefix cache (ours or, in PD, P's)
        self.kv_transfer_params = kv_transfer_params  # parsed once, at the API's edge
        self.kv_transfer_params_output: KVTransferParams | None = None  # P's, for D (the connector's)
        self.arrive_time = arrive_time if arrive_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # n / best_of: this sequence's choice index, the forks still to make at its first
        # sample, and every sequence of the request (shared by the group)
        self.index = 0
        self.num_forks = self.sampling_params.num_samples - 1
        self.group: list[Sequence] = [self]
        self.cumulative_logprob = 0.0  # sum of the sampled tokens' logprobs (ranks best_of)
        # prompt_logprobs: entry i for prompt token i ({"logprob", "rank", "top"}; None for token 0)
        self.prompt_logprobs: list[Logprob | None] | None = [None] if self.sampling_params.prompt_logprobs is not None else None

    def fork(self, index: int) -> "Sequence":
        """Choice `index` of this request: the same tokens and computed KV (the caller shares
        the blocks), its own id, seed and output state. Joins this sequence's group."""
        child = copy.copy(self)
        child.id = next(_ids)
        child.index = index
        child.sampling_params = self.sampling_params.for_choice(index)
        child.token_ids = list(self.token_ids)
        child.block_table = []
        child.block_hashes = list(self.block_hashes)
        child.spec_token_ids = []
        child.logprobs = list(self.logprobs)
        child.num_forks = 0
        child.kv_transfer_params = None  # the transfer belongs to the parent
        child.kv_transfer_params_output = None
        self.group.append(child)
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.id}, status={self.status.name}, tokens={self.num_tokens}, "
                f"prompt={self.num_prompt_tokens}, cached={self.num_computed_tokens})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop" | "length" | "abort" | None (running)."""
        if self.leave_reason is None:
            return None
        return _FINISH_REASONS[self.leave_reason]
