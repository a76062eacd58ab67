"""Test doubles for the scheduler: a model whose tokens are a known function of the prefix,
a KV cache that checks every read, and an in-memory KV connector between two engines.

`FakeModel` is the reference: `reference_completion` computes by hand what greedy decoding
must produce, independently of the scheduler. `FakeKV` stores each position's token id as
its "KV" and asserts that every forward reads exactly the tokens of its own prefix, so a
wrong prefix-cache hit, a block freed too early or a bad transfer shows up as a failure.
"""
from __future__ import annotations

import numpy as np

from atomd.config import EngineConfig
from kv_transfer.connector import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                   KVConnectorWorker, RemotePrefill)
from kv_transfer.params import KVTransferParams
from scheduler.prefill_delayer import DELAYER_KNOBS, PrefillDelayer
from scheduler.scheduler import ScheduledBatch, ScheduledBatchOutput, Scheduler, SchedulerConfig

VOCAB = 1000
NO_PARAMS = KVTransferParams()
_ENGINE_DEFAULTS = EngineConfig()


def scheduler_config(**kw) -> SchedulerConfig:
    """A SchedulerConfig with the engine's defaults (atomd.config), overridden by `kw`."""
    fields = {f: getattr(_ENGINE_DEFAULTS, f) for f in SchedulerConfig.__struct_fields__
              if hasattr(_ENGINE_DEFAULTS, f)}
    return SchedulerConfig(**(fields | kw))


def delayer_knobs(**kw) -> dict:
    """The PrefillDelayer's knobs at the engine's defaults (atomd.config), overridden by `kw`."""
    knobs = {k: getattr(_ENGINE_DEFAULTS, f"prefill_delayer_{k}") for k in DELAYER_KNOBS}
    return knobs | {"max_num_batched_tokens": _ENGINE_DEFAULTS.max_num_batched_tokens} | kw


def make_delayer(collective, policy: str = "align", cls=PrefillDelayer, **kw) -> PrefillDelayer:
    return cls(collective, policy, **delayer_knobs(**kw))


def next_token(prefix: list[int]) -> int:
    """The greedy token after `prefix` (never 0 or 1, so tests choose EOS explicitly)."""
    return (prefix[-1] * 7 + len(prefix) * 13 + prefix[0] * 3) % (VOCAB - 2) + 2


def fork_token(prefix: list[int], index: int) -> int:
    """The first token of choice `index` of a forked request (choice 0: next_token)."""
    return (next_token(prefix) - 2 + 17 * index) % (VOCAB - 2) + 2


def reference_choice(prompt: list[int], index: int, max_tokens: int) -> list[int]:
    """What choice `index` of a request must produce: its own first token, then greedy."""
    if max_tokens == 0:
        return []
    first = fork_token(prompt, index)
    return [first] + reference_completion(prompt + [first], max_tokens - 1)


def prompt(seed: int, n: int) -> list[int]:
    """A reproducible random prompt of `n` token ids."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 900, n)]


def reference_completion(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == eos:
            break
    return out


class FakeKV:
    """KV cache where the KV of a position is its token id; -1 means never written."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.data = np.full((num_blocks, block_size), -1, dtype=np.int64)

    def _slot(self, table: list[int], pos: int) -> tuple[int, int]:
        return table[pos // self.block_size], pos % self.block_size

    def check_context(self, table: list[int], token_ids: list[int], upto: int) -> None:
        for pos in range(upto):
            b, o = self._slot(table, pos)
            assert self.data[b, o] == token_ids[pos], f"KV at position {pos} is stale"

    def write(self, table: list[int], start: int, tokens) -> None:
        for j, t in enumerate(tokens):
            b, o = self._slot(table, start + j)
            self.data[b, o] = int(t)


class FakeModel:
    """Runs a ScheduledBatch against a FakeKV; drafts are right except every `bad_draft_every`-th."""

    def __init__(self, kv: FakeKV, num_speculative_tokens: int = 0, bad_draft_every: int = 3):
        self.kv = kv
        self.k = num_speculative_tokens
        self.bad_draft_every = bad_draft_every
        self.num_forwards = 0
        self.prefilled_tokens = 0

    def forward(self, batch: ScheduledBatch) -> ScheduledBatchOutput:
        self.num_forwards += 1
        for src, dst in batch.block_copies:  # copy-on-write before anything is written
            self.kv.data[dst] = self.kv.data[src]
        tokens_out, drafts_out, forks_out = [], [], []
        offset = 0
        for i, seq in enumerate(batch.seqs):
            n = int(batch.num_scheduled_tokens[i])
            start = int(batch.num_computed_tokens[i])
            chunk = [int(t) for t in batch.token_ids[offset:offset + n]]
            offset += n
            table = batch.block_tables[i]
            assert chunk[0] == seq.token_ids[start], "first scheduled token is not the next one"
            self.kv.check_context(table, seq.token_ids, start)
            self.kv.write(table, start, chunk)
            if batch.is_prefill:
                self.prefilled_tokens += n
            forks_out.append([])
            if not batch.needs_sample[i]:
                tokens_out.append([])
                drafts_out.append([])
                continue
            if batch.is_prefill:
                prefix = seq.token_ids[:start + n]
                accepted = [next_token(prefix)]
            else:
                prefix = seq.token_ids[:start + 1]
                accepted = []
                for d in chunk[1:]:  # verify the drafts in order
                    t = next_token(prefix)
                    accepted.append(t)
                    if t != d:
                        break
                    prefix = prefix + [d]
                else:
                    accepted.append(next_token(prefix))
            if seq.num_forks:  # the first token of every other choice, from the same position
                forks_out[-1] = [fork_token(prefix, j) for j in range(1, seq.num_forks + 1)]
            tokens_out.append(accepted)
            drafts_out.append(self._propose(prefix + accepted[-1:]))
        return ScheduledBatchOutput([s.id for s in batch.seqs], tokens_out,
                                    draft_token_ids=drafts_out if self.k else None,
                                    fork_token_ids=forks_out if any(forks_out) else None)

    def _propose(self, prefix: list[int]) -> list[int]:
        drafts, p = [], list(prefix)
        for _ in range(self.k):
            t = next_token(p)
            if (len(p) % self.bad_draft_every) == 0:
                t = 2 + (t - 1) % (VOCAB - 2)  # a wrong guess
            drafts.append(t)
            p.append(t)
        return drafts


def step(scheduler: Scheduler, model: FakeModel, worker=None):
    """One engine step: schedule, start loads, forward, postprocess, report transfers (a
    received sequence is promoted then and its T0 is part of the step's updates, as
    LLMEngine.step emits it)."""
    updates = scheduler.take_first_tokens()  # promoted by a test's own update_from_kv_connector_output
    batch = scheduler.schedule()
    if batch is not None:
        if worker is not None:
            worker.start_load_kv(batch.connector_meta)
        if batch.seqs:
            updates += scheduler.postprocess(batch, model.forward(batch))
    if worker is not None:
        scheduler.update_from_kv_connector_output(worker.get_finished())
        updates += scheduler.take_first_tokens()
    return batch, updates


class FakeMeta(KVConnectorMetadata):
    def __init__(self, loads: list):
        self.loads = loads

    def is_empty(self) -> bool:
        return not self.loads


class FakeConnector(KVConnectorScheduler, KVConnectorWorker):
    """Both halves of an in-memory connector. A producer serves blocks from its KV; a
    consumer pulls from the producer it was given. Pulls complete at the consumer's next
    get_finished() unless `hold_pulls` is set; ids in `fail_ids` fail instead."""

    def __init__(self, role: str, kv: FakeKV, peer: "FakeConnector | None" = None,
                 policy: str = "fail"):
        self.role, self.kv, self.peer, self.policy = role, kv, peer, policy
        self.serving: dict[str, list[int]] = {}  # producer: transfer_id -> block ids
        self.seq_of_transfer: dict[str, int] = {}
        self._to_load: list = []  # scheduler side: (seq, transfer_id, first block to pull)
        self.in_flight: dict[int, tuple] = {}  # worker side: seq id -> load
        self.hold_pulls = False
        self.fail_ids: set[int] = set()
        self.finished_calls: dict[int, int] = {}
        self.aborted_calls: dict[int, int] = {}
        self._done_sending: list[int] = []
        self._done_recving: list[int] = []
        self._failed: list[int] = []

    # scheduler side
    @property
    def is_producer(self) -> bool:
        return self.role == "producer"

    def get_num_new_matched_tokens(self, seq):
        params = seq.kv_transfer_params or NO_PARAMS
        if self.role == "consumer" and params.do_remote_prefill:
            return seq.num_prompt_tokens, True
        return 0, False

    def update_state_after_alloc(self, seq):
        params = seq.kv_transfer_params or NO_PARAMS
        if self.role == "consumer" and params.do_remote_prefill:
            first = seq.num_computed_tokens // self.kv.block_size
            self._to_load.append((seq.id, list(seq.block_table), params, first))

    def build_connector_meta(self):
        loads, self._to_load = self._to_load, []
        return FakeMeta(loads)

    def request_finished(self, seq):
        self.finished_calls[seq.id] = self.finished_calls.get(seq.id, 0) + 1
        params = seq.kv_transfer_params or NO_PARAMS
        if self.role != "producer" or not params.do_remote_decode or not seq.block_table:
            return False, None
        tid = params.transfer_id
        self.serving[tid] = list(seq.block_table)
        self.seq_of_transfer[tid] = seq.id
        return True, KVTransferParams(do_remote_prefill=True, transfer_id=tid,
                                      remote_block_ids=list(seq.block_table),
                                      num_prompt_tokens=seq.num_prompt_tokens,
                                      first_token_id=seq.completion_token_ids[0],
                                      prefix_cache_hit_tokens=seq.num_cached_tokens)

    def request_aborted(self, seq):
        self.aborted_calls[seq.id] = self.aborted_calls.get(seq.id, 0) + 1
        if self.role == "producer":
            tid = (seq.kv_transfer_params or NO_PARAMS).transfer_id
            self.release(tid)
        elif seq.id in self.in_flight and not self.hold_pulls:
            self.in_flight.pop(seq.id)
            self._failed.append(seq.id)

    def recv_failure_policy(self, seq):
        return self.policy

    def remote_prefill(self, seq):
        p = seq.kv_transfer_params
        return RemotePrefill(first_token_id=p.first_token_id, first_token_logprobs=p.first_token_logprobs,
                             draft_token_ids=list(p.draft_token_ids), num_cached_tokens=p.prefix_cache_hit_tokens)

    # producer: D said DONE
    def release(self, transfer_id) -> None:
        if transfer_id in self.serving:
            del self.serving[transfer_id]
            self._done_sending.append(self.seq_of_transfer.pop(transfer_id))

    # worker side
    def register_kv_caches(self, buffer):
        pass

    def start_load_kv(self, meta):
        for seq_id, table, params, first in getattr(meta, "loads", []):
            self.in_flight[seq_id] = (table, params, first)

    def get_finished(self):
        if not self.hold_pulls:
            for seq_id in list(self.in_flight):
                self.stop_pull(seq_id, failed=seq_id in self.fail_ids)
        out = KVConnectorOutput(finished_sending=self._done_sending,
                                finished_recving=self._done_recving, failed_recving=self._failed)
        self._done_sending, self._done_recving, self._failed = [], [], []
        return out

    def stop_pull(self, seq_id: int, failed: bool) -> None:
        """End a pull (copying the blocks unless it failed); reported at the next get_finished()."""
        load = self.in_flight.pop(seq_id, None)
        if load is None:
            return
        if failed:
            self._failed.append(seq_id)
            return
        table, params, first = load
        remote = params.remote_block_ids
        for i in range(first, len(table)):
            self.kv.data[table[i]] = self.peer.kv.data[remote[i]]
        self.peer.release(params.transfer_id)
        self._done_recving.append(seq_id)

    def close(self):
        pass


def add_all(scheduler: Scheduler, seqs: list) -> None:
    for seq in seqs:
        scheduler.add(seq)
