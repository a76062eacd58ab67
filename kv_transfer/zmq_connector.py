"""The ZMQ KV connector: both halves of a prefill (producer) or decode (consumer) engine
over `KVSender` / `KVReceiver` (kv_transfer/zmq_transport.py).

Producer (P): a finished `do_remote_decode` sequence keeps its prompt blocks; every one of
them (the partly filled last one too) is granted to a fresh access token under a lease,
and the response `kv_transfer_params` tell D where and how to pull them. The blocks are
freed (`finished_sending`) when the sender reports the transfer released: DONE, ABORT,
revoke (the router's POST /kv_transfer/abort) or lease expiry, exactly one of them.

Consumer (D): a `do_remote_prefill` request is checked against its own prompt (length,
block count: else a 400) and its transfer held from arrival, so heartbeats keep P's lease
alive while it queues. On admission it is parked with all its prompt blocks allocated; its
own prefix hit (the first `num_computed_tokens // block_size` blocks) is kept and only the
rest is pulled, after the compat fingerprint is checked (a mismatch fails the load before
any byte moves and ABORTs at P). The receiver reports every pull exactly once, finished or
failed, and only then are the blocks reused (an abort stops the writes first).

Both halves are one object per engine (the scheduler side and the worker side run on the
same engine thread); `create_zmq_connector` is the factory registered as "zmq". Another data
plane reuses all of this (the ZMQ control plane included) and only builds other endpoints:
kv_transfer/mooncake_transport.py subclasses ZmqProducer / ZmqConsumer and overrides
`make_sender` / `make_receiver`.
"""
from __future__ import annotations

import bisect
from typing import Any

import msgspec

from kv_transfer import faults
from kv_transfer.connector import (KVConnectorConfig, KVConnectorMetadata, KVConnectorOutput,
                                   KVConnectorScheduler, KVConnectorWorker, RemotePrefill, Sequence)
from kv_transfer.params import KVTransferParams, compat_mismatch, new_access_token, new_transfer_id
from kv_transfer.trust import ProducerTrust, UntrustedKVParams
from kv_transfer.side_channel import ABORTED
from kv_transfer.zmq_receiver import KVReceiver
from kv_transfer.zmq_sender import KVSender

# kv_transfer_seconds histogram (loopback moves a few GB/s: most pulls take milliseconds)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COMPAT_REFUSED = "compat_mismatch"
NO_PARAMS = KVTransferParams()


class _Load(msgspec.Struct):
    """One pull for the worker side: P's blocks past D's own prefix hit -> D's blocks."""

    seq_id: int
    transfer_id: str
    host: str
    port: int
    access_token: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    refused: str | None = None  # D refuses it before any byte moves (compat)


class ZmqConnectorMeta(KVConnectorMetadata):
    def __init__(self, loads: list[_Load]):
        self.loads = loads

    def is_empty(self) -> bool:
        return not self.loads


class TransferStats:
    """Counters both roles export as PD metrics (engine `stats()["kv_transfer"]`)."""

    def __init__(self) -> None:
        self.bucket_counts = [0] * (len(TRANSFER_BUCKETS) + 1)
        self.seconds_sum = 0.0
        self.fallbacks: dict[str, int] = {}

    def observe(self, seconds: float) -> None:
        self.bucket_counts[bisect.bisect_left(TRANSFER_BUCKETS, seconds)] += 1
        self.seconds_sum += seconds

    def histogram(self) -> dict[str, Any]:
        return {"buckets": list(TRANSFER_BUCKETS), "counts": list(self.bucket_counts), "sum": self.seconds_sum}


class _ZmqConnector(KVConnectorScheduler, KVConnectorWorker):
    def __init__(self, config: KVConnectorConfig):
        self.config = config
        self.block_size = config.block_size
        self.transfer_stats = TransferStats()

    def num_prompt_blocks(self, seq) -> int:
        return -(-seq.num_prompt_tokens // self.block_size)

    def params_of(self, seq: Sequence) -> KVTransferParams:
        return seq.kv_transfer_params or NO_PARAMS

    # defaults of the half a role does not use
    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, seq: Sequence) -> None:
        pass

    def build_connector_meta(self) -> KVConnectorMetadata:
        return ZmqConnectorMeta([])

    def request_finished(self, seq: Sequence) -> tuple[bool, KVTransferParams | None]:
        return False, None

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        pass

    def info(self) -> dict[str, Any]:
        return {"role": self.role, "side_channel": None, "engine_id": None,
                "compat": self.config.compat, "dp_rank": self.config.dp_rank}


class ZmqProducer(_ZmqConnector):
    """P: pins finished prompts' blocks and serves them from a KVSender."""

    role = "producer"

    def __init__(self, config: KVConnectorConfig):
        super().__init__(config)
        self.sender: KVSender | None = None
        self.seq_of_transfer: dict[str, int] = {}

    @property
    def is_producer(self) -> bool:
        return True

    def make_sender(self, buffer) -> KVSender:
        """The endpoint serving `buffer` (the data plane's; registered once, at start-up)."""
        return KVSender(buffer, self.config.compat, self.config.side_channel_host, self.config.side_channel_port)

    def register_kv_caches(self, buffer) -> None:
        self.sender = self.make_sender(buffer)

    def request_finished(self, seq: Sequence) -> tuple[bool, KVTransferParams | None]:
        """(True, params D pulls with) for a finished remote-decode prompt, whose blocks then
        stay pinned until the transfer is released; else (False, None)."""
        params = self.params_of(seq)
        if not params.do_remote_decode or not seq.block_table or seq.error or not seq.completion_token_ids:
            return False, None
        transfer_id = params.transfer_id or new_transfer_id()
        block_ids = list(seq.block_table[:self.num_prompt_blocks(seq)])
        token, lease_s = new_access_token(), self.config.lease_s
        try:
            self.sender.grant(transfer_id, block_ids, token, lease_s)
        except ValueError:  # a transfer_id seen before: serve nothing rather than the wrong blocks
            return False, None
        self.seq_of_transfer[transfer_id] = seq.id
        host, port = self.sender.address
        return True, KVTransferParams(
            do_remote_prefill=True, transfer_id=transfer_id, remote_engine_id=self.sender.engine_id,
            remote_host=host, remote_port=port, remote_block_ids=block_ids,
            num_prompt_tokens=seq.num_prompt_tokens, first_token_id=seq.completion_token_ids[0],
            first_token_logprobs=seq.logprobs[0] if seq.logprobs else None, prompt_logprobs=seq.prompt_logprobs,
            draft_token_ids=list(seq.spec_token_ids),  # P's drafts after T0 (speculative decoding), for D to verify
            prefix_cache_hit_tokens=seq.num_cached_tokens, access_token=token, lease_s=lease_s,
            compat=self.config.compat, dp_rank=self.config.dp_rank)

    def request_aborted(self, seq: Sequence) -> None:
        transfer_id = self.params_of(seq).transfer_id
        if transfer_id in self.seq_of_transfer:
            self.sender.revoke(transfer_id)  # reported by take_released(), then freed

    def revoke(self, transfer_id: str) -> bool:
        return self.sender.revoke(transfer_id)

    def get_finished(self) -> KVConnectorOutput:
        done = [self.seq_of_transfer.pop(tid) for tid, _ in self.sender.take_released()
                if tid in self.seq_of_transfer]
        return KVConnectorOutput(finished_sending=done)

    def stats(self) -> dict[str, Any]:
        s = self.sender.stats()
        return {"role": self.role, "bytes": s.bytes_sent, "failures": dict(s.failures),
                "leases_expired": s.leases_expired, "blocks_pinned": s.blocks_pinned,
                "transfers_pending": len(self.seq_of_transfer), "fallbacks": {},
                "seconds": self.transfer_stats.histogram()}

    def info(self) -> dict[str, Any]:
        host, port = self.sender.address
        return dict(super().info(), side_channel={"host": host, "port": port}, engine_id=self.sender.engine_id)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class ZmqConsumer(_ZmqConnector):
    """D: pulls a remote prefill's blocks with a KVReceiver before the sequence decodes."""

    role = "consumer"

    def __init__(self, config: KVConnectorConfig):
        super().__init__(config)
        self.receiver: KVReceiver | None = None
        self._to_load: list[_Load] = []
        self._refused: list[tuple[int, str]] = []  # (seq id, reason) failed before any pull
        self.seq_of_transfer: dict[str, int] = {}
        self._aborted: set[int] = set()
        self.local_failures: dict[str, int] = {}
        self.trust = ProducerTrust(config.params_secret, config.trusted_producers)
        self.params_refused: dict[str, int] = {}  # untrusted kv_transfer_params, by reason

    @property
    def is_producer(self) -> bool:
        return False

    def make_receiver(self, buffer) -> KVReceiver:
        """The endpoint pulling into `buffer` (the data plane's; registered once, at start-up)."""
        return KVReceiver(buffer, self.config.compat)

    def register_kv_caches(self, buffer) -> None:
        self.receiver = self.make_receiver(buffer)

    def is_remote(self, seq: Sequence) -> bool:
        return self.params_of(seq).do_remote_prefill

    def request_added(self, seq: Sequence) -> None:
        """Check the params (trusted, fit this prompt), then heartbeat P while `seq` queues
        here; UntrustedKVParams / ValueError before any connection is made."""
        if not self.is_remote(seq):
            return
        p = seq.kv_transfer_params
        try:
            self.trust.check(p)
        except UntrustedKVParams as e:
            self.params_refused[e.reason] = self.params_refused.get(e.reason, 0) + 1
            raise
        if p.num_prompt_tokens != seq.num_prompt_tokens:
            raise ValueError(f"kv_transfer_params.num_prompt_tokens={p.num_prompt_tokens} but this engine's "
                             f"prompt has {seq.num_prompt_tokens} tokens (different tokenizer or template?)")
        if len(p.remote_block_ids) != self.num_prompt_blocks(seq):
            raise ValueError(f"kv_transfer_params.remote_block_ids has {len(p.remote_block_ids)} blocks, "
                             f"the prompt needs {self.num_prompt_blocks(seq)} of {self.block_size} tokens")
        for name in ("transfer_id", "remote_host", "remote_port", "access_token"):
            if getattr(p, name) is None:
                raise ValueError(f"kv_transfer_params.{name} is required with do_remote_prefill")
        if faults.ACTIVE:
            faults.point("between_legs")
        try:
            self.receiver.hold(p.transfer_id, p.remote_host, p.remote_port, lease_s=p.lease_s,
                                 access_token=p.access_token)
        except ValueError:
            raise ValueError(f"kv_transfer_params.transfer_id {p.transfer_id!r} is already in use here") from None
        self.seq_of_transfer[p.transfer_id] = seq.id

    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]:
        if not self.is_remote(seq):
            return 0, False
        return seq.num_prompt_tokens, True

    def update_state_after_alloc(self, seq: Sequence) -> None:
        if not self.is_remote(seq):
            return
        p = self.params_of(seq)
        # D's own prefix hit stays; blocks released as before a sliding window are not pulled
        first = max(seq.num_computed_tokens // self.block_size, seq.num_released_blocks)
        last = self.num_prompt_blocks(seq)
        self._to_load.append(_Load(
            seq.id, p.transfer_id, p.remote_host, p.remote_port, p.access_token,
            list(p.remote_block_ids[first:last]), list(seq.block_table[first:last]),
            compat_mismatch(self.config.compat, p.compat)))

    def remote_prefill(self, seq: Sequence) -> RemotePrefill:
        p = self.params_of(seq)
        return RemotePrefill(first_token_id=p.first_token_id, first_token_logprobs=p.first_token_logprobs,
                             draft_token_ids=list(p.draft_token_ids), num_cached_tokens=p.prefix_cache_hit_tokens)

    def build_connector_meta(self) -> KVConnectorMetadata:
        loads, self._to_load = self._to_load, []
        return ZmqConnectorMeta(loads)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for load in getattr(meta, "loads", ()):
            if load.refused is None:
                try:
                    self.receiver.start_pull(load.transfer_id, load.host, load.port, load.access_token,
                                             load.remote_block_ids, load.local_block_ids,
                                             self.config.recv_timeout_s, lease_s=self.config.lease_s)
                    continue
                except ValueError as e:
                    load.refused = f"start_pull: {e}"
            reason = COMPAT_REFUSED if load.refused.startswith("compat") else "refused"
            self.local_failures[reason] = self.local_failures.get(reason, 0) + 1
            self._refused.append((load.seq_id, reason))
            self._release_hold(load.transfer_id)

    def _release_hold(self, transfer_id: str) -> None:
        """Stop heartbeating and let P free now (ABORT); the receiver's "aborted" report of
        it is dropped, since this connector reports the sequence itself."""
        if self.seq_of_transfer.pop(transfer_id, None) is not None:
            self.receiver.abort(transfer_id)

    def request_finished(self, seq: Sequence) -> tuple[bool, KVTransferParams | None]:
        """Rejected while still holding P's blocks (e.g. unschedulable): free them on P."""
        self._release_hold(self.params_of(seq).transfer_id)
        return False, None

    def request_aborted(self, seq: Sequence) -> None:
        transfer_id = self.params_of(seq).transfer_id
        if self.seq_of_transfer.get(transfer_id) == seq.id:
            self._aborted.add(seq.id)
            self.receiver.abort(transfer_id)  # reported failed ("aborted") by take_finished()

    def get_finished(self) -> KVConnectorOutput:
        done, failed = self.receiver.take_finished()
        for seconds in self.receiver.take_transfer_seconds():
            self.transfer_stats.observe(seconds)
        finished = [self.seq_of_transfer.pop(tid) for tid in done if tid in self.seq_of_transfer]
        self._aborted.difference_update(finished)
        failed_ids = []
        for tid, reason in failed:
            seq_id = self.seq_of_transfer.pop(tid, None)
            if seq_id is not None:
                failed_ids.append(seq_id)
                self._count_fallback(seq_id, reason)
        for seq_id, reason in self._refused:
            failed_ids.append(seq_id)
            self._count_fallback(seq_id, reason)
        self._refused = []
        return KVConnectorOutput(finished_recving=finished, failed_recving=failed_ids)

    def _count_fallback(self, seq_id: int, reason: str) -> None:
        if seq_id in self._aborted or reason == ABORTED:
            self._aborted.discard(seq_id)
            return
        if self.config.load_failure_policy == "recompute":
            fb = self.transfer_stats.fallbacks
            fb[reason] = fb.get(reason, 0) + 1

    def recv_failure_policy(self, seq: Sequence) -> str:
        return self.config.load_failure_policy

    def stats(self) -> dict[str, Any]:
        s = self.receiver.stats()
        failures = dict(s.failures)
        failures.pop(ABORTED, None)  # a client going away is not a transfer failure
        for reason, n in self.local_failures.items():
            failures[reason] = failures.get(reason, 0) + n
        return {"role": self.role, "bytes": s.bytes_received, "failures": failures, "leases_expired": 0,
                "blocks_pinned": 0, "transfers_pending": len(self.seq_of_transfer),
                "fallbacks": dict(self.transfer_stats.fallbacks), "seconds": self.transfer_stats.histogram(),
                "params_refused": dict(self.params_refused)}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


def build_connector(role: str, config: KVConnectorConfig, producer: type[ZmqProducer] = ZmqProducer,
                    consumer: type[ZmqConsumer] = ZmqConsumer, backend: str = "zmq"):
    if role not in ("producer", "consumer"):
        raise ValueError(f"the {backend} connector serves kv_role producer or consumer, got {role!r}")
    connector = (producer if role == "producer" else consumer)(config)
    return connector, connector


def create_zmq_connector(role: str, config: KVConnectorConfig):
    return build_connector(role, config)

