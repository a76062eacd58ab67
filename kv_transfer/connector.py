"""The KV connector protocol between an engine's scheduler and its KV mover.

A connector has two halves that live in the same engine process:

Scheduler side (`KVConnectorScheduler`, called by `scheduler.Scheduler`):
  is_producer                      True on a prefill engine: finished sequences keep their
                                   blocks until the consumer has pulled them.
  get_num_new_matched_tokens(seq)  -> (num_external_tokens, load_async). load_async=True
                                   parks the sequence in WAITING_FOR_REMOTE_KVS after its
                                   blocks are allocated; its KV arrives later.
  update_state_after_alloc(seq)    blocks are allocated (seq.block_table; the first
                                   seq.num_computed_tokens // block_size are local hits, the
                                   first seq.num_released_blocks FREED: before a sliding
                                   window, neither loaded nor read).
                                   Called again if a preempted sequence is re-admitted.
  build_connector_meta()           -> KVConnectorMetadata for this step's worker side.
  request_finished(seq)            -> (delay_free, params). Called exactly once per sequence
                                   that finished (stop, length, failed pull). `params`: the
                                   response's kv_transfer_params (or None). `delay_free`:
                                   the blocks are being served, so the scheduler keeps them
                                   until the worker reports finished_sending for the sequence.
  remote_prefill(seq)              -> RemotePrefill: what came with a pull that landed (P's
                                   first token, its logprobs, drafts, P's prefix hit); the
                                   scheduler asks once, when it promotes the sequence.
  request_aborted(seq)             the client went away (waiting, running, parked or
                                   deferred). Stop any transfer, then report the sequence
                                   in finished_recving/failed_recving (consumer) or
                                   finished_sending (producer) so its blocks are freed.
                                   Never followed by request_finished.
  recv_failure_policy(seq)         "fail" (finish with an error) or "recompute" (prefill
                                   locally) for a consumer whose pull failed.
  request_added(seq)               (optional) before the scheduler sees a new sequence:
                                   raise ValueError (the API's 400) if its kv_transfer_params
                                   do not fit its prompt; a consumer starts heartbeating P.

Worker side (`KVConnectorWorker`, called by the engine around the forward):
  register_kv_caches(buffer)       the paged KV as a numpy uint8 view [num_blocks, block_bytes].
  start_load_kv(meta)              begin the transfers `meta` describes.
  get_finished()                   -> KVConnectorOutput: sequence ids whose transfers ended
                                   since the last call; the engine hands it to
                                   Scheduler.update_from_kv_connector_output.
  close()

Engine utilities (optional, on either half): stats() -> dict of PD counters (atomd.api.metrics
renders them), info() -> role / side channel for GET /kv_transfer_info, revoke(transfer_id)
-> bool for POST /kv_transfer/abort.

Every id is a `Sequence.id`. Reporting an id twice, or an id the scheduler no longer
knows, is harmless: the scheduler ignores it and never frees a block twice.
"""
from __future__ import annotations

import abc
from typing import Any, Protocol

import msgspec

from kv_transfer.params import KVTransferParams


class Sequence(Protocol):
    """What a connector reads of the scheduler's sequence (scheduler.sequence.Sequence): the
    scheduler imports kv_transfer, never the other way round."""

    id: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    block_table: list[int]
    kv_transfer_params: KVTransferParams | None
    logprobs: list[Any]
    prompt_logprobs: list[Any] | None
    spec_token_ids: list[int]

    @property
    def error(self) -> str | None: ...

    @property
    def completion_token_ids(self) -> list[int]: ...


class KVConnectorOutput(msgspec.Struct):
    """Transfers the worker side saw end since its last report (sequence ids)."""

    finished_sending: list[int] = []
    finished_recving: list[int] = []
    failed_recving: list[int] = []


class KVConnectorConfig(msgspec.Struct, kw_only=True):
    """What any connector needs from its engine; atomd builds it from EngineConfig, which
    holds every default (no defaults here, so there is one place per default)."""

    block_size: int
    compat: dict[str, Any]  # this engine's fingerprint (kv_transfer.params.compat_fingerprint)
    side_channel_host: str
    side_channel_port: int  # 0: any free port (advertised in kv_transfer_params)
    lease_s: float
    recv_timeout_s: float
    load_failure_policy: str  # "fail" or "recompute"
    dp_rank: int
    # a consumer's trust in producers (kv_transfer/trust.py): the shared secret of signed
    # params, and the hosts / networks a producer may be at
    params_secret: bytes | None
    trusted_producers: list[str]
    # backend-specific settings, by name (mooncake: mooncake_protocol, mooncake_device)
    extra_config: dict[str, Any] = {}


class RemotePrefill(msgspec.Struct, frozen=True):
    """What a consumer's landed pull brings besides the KV (from P's kv_transfer_params)."""

    first_token_id: int | None = None  # None: D samples T0 itself from the last position
    first_token_logprobs: dict[str, Any] | None = None
    draft_token_ids: list[int] = []
    num_cached_tokens: int = 0  # P's prefix-cache hit: the usage's cached_tokens


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (subclass per connector).

    The scheduler hands an otherwise empty batch to the engine only to carry metadata
    that `is_empty()` says is not empty, so a parked sequence's pull always starts. The
    default answer is the safe one: "not empty" costs one empty engine pass, while a wrong
    "empty" would leave a pull unstarted and its request parked until it times out.
    """

    def is_empty(self) -> bool:
        return False


class KVConnectorScheduler(abc.ABC):
    """Scheduler-side half; see the module docstring for the protocol."""

    @property
    @abc.abstractmethod
    def is_producer(self) -> bool: ...

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]: ...

    @abc.abstractmethod
    def update_state_after_alloc(self, seq: Sequence) -> None: ...

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata: ...

    @abc.abstractmethod
    def request_finished(self, seq: Sequence) -> tuple[bool, KVTransferParams | None]: ...

    @abc.abstractmethod
    def request_aborted(self, seq: Sequence) -> None: ...

    def remote_prefill(self, seq: Sequence) -> RemotePrefill:
        return RemotePrefill()

    def recv_failure_policy(self, seq: Sequence) -> str:
        return "fail"

    def request_added(self, seq: Sequence) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        return {}

    def revoke(self, transfer_id: str) -> bool:
        return False


class KVConnectorWorker(abc.ABC):
    """Worker-side half; see the module docstring for the protocol."""

    @abc.abstractmethod
    def register_kv_caches(self, buffer) -> None: ...

    @abc.abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None: ...

    @abc.abstractmethod
    def get_finished(self) -> KVConnectorOutput: ...

    @abc.abstractmethod
    def close(self) -> None: ...
