"""The KV connector protocol between an engine's scheduler and its KV mover.

A connector has two halves that live in the same engine process:

Scheduler side (`KVConnectorScheduler`, called by `scheduler.Scheduler`):
  is_producer                      True on a prefill engine: finished sequences keep their
                                   blocks until the consumer has pulled them.
  get_num_new_matched_tokens(seq)  -> (num_external_tokens, load_async). load_async=True
                                   parks the sequence in WAITING_FOR_REMOTE_KVS after its
                                   blocks are allocated; its KV arrives later.
  update_state_after_alloc(seq)    blocks are allocated (seq.block_table; the first
                                   seq.num_cached_tokens // block_size are local hits).
                                   Called again if a preempted sequence is re-admitted.
  build_connector_meta()           -> KVConnectorMetadata for this step's worker side.
  request_finished(seq)            -> response kv_transfer_params or None. Called exactly
                                   once per sequence that finished (stop, length, failed
                                   pull). On a producer, a dict means "the blocks are being
                                   served": the scheduler defers their free until the
                                   worker reports finished_sending for the sequence.
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

Engine utilities (optional, on either half): stats() -> dict of PD counters (atomd.metrics
renders them), info() -> role / side channel for GET /kv_transfer_info, revoke(transfer_id)
-> bool for POST /kv_transfer/abort.

Every id is a `Sequence.id`. Reporting an id twice, or an id the scheduler no longer
knows, is harmless: the scheduler ignores it and never frees a block twice.
"""
from __future__ import annotations

import abc
from typing import Any

import msgspec


class KVConnectorOutput(msgspec.Struct):
    """Transfers the worker side saw end since its last report (sequence ids)."""

    finished_sending: list[int] = []
    finished_recving: list[int] = []
    failed_recving: list[int] = []


class KVConnectorConfig(msgspec.Struct, kw_only=True):
    """What any connector needs from its engine (built by atomd from EngineConfig)."""

    block_size: int
    compat: dict[str, Any]  # this engine's fingerprint (kv_transfer.params.compat_fingerprint)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: any free port (advertised in kv_transfer_params)
    lease_s: float = 30.0
    recv_timeout_s: float = 10.0
    load_failure_policy: str = "fail"  # or "recompute"
    dp_rank: int = 0


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (subclass per connector).

    The scheduler hands an otherwise empty batch to the engine only to carry metadata
    that `is_empty()` says is not empty, so a parked sequence's pull always starts.
    """

    def is_empty(self) -> bool:
        return False


class KVConnectorScheduler(abc.ABC):
    """Scheduler-side half; see the module docstring for the protocol."""

    @property
    @abc.abstractmethod
    def is_producer(self) -> bool: ...

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, seq) -> tuple[int, bool]: ...

    @abc.abstractmethod
    def update_state_after_alloc(self, seq) -> None: ...

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata: ...

    @abc.abstractmethod
    def request_finished(self, seq) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def request_aborted(self, seq) -> None: ...

    def recv_failure_policy(self, seq) -> str:
        return "fail"

    def request_added(self, seq) -> None:
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


_REGISTRY: dict[str, Any] = {}
_BUILTIN = {"zmq": "kv_transfer.zmq_connector:create_zmq_connector"}  # imported on first use


def register_connector(name: str, factory) -> None:
    """`factory(role, config) -> (KVConnectorScheduler, KVConnectorWorker)`."""
    _REGISTRY[name] = factory


def create_connector(name: str, role: str, config) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """Both halves of the connector registered as `name` (e.g. "zmq", "mooncake")."""
    if role not in ("producer", "consumer", "both"):
        raise ValueError(f"kv_role must be producer, consumer or both, got {role!r}")
    if name not in _REGISTRY and name in _BUILTIN:
        import importlib

        module, factory = _BUILTIN[name].split(":")
        register_connector(name, getattr(importlib.import_module(module), factory))
    if name not in _REGISTRY:
        raise ValueError(f"kv_transfer_backend {name!r} is not registered; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](role, config)
