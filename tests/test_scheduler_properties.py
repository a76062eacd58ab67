"""Property-based tests: random interleavings of add / step / abort / preempt / connector
completions keep the scheduler's invariants, and every sequence ends exactly once with
tokens equal to the hand-computed greedy reference.

With speculative decoding (spec=2) the fake model proposes drafts, every third one wrong:
rejected drafts' blocks go back (no sequence holds blocks past its tokens) and published
blocks name accepted tokens only. Requests with n / best_of > 1 fork at their first sample into choices that share blocks
(copy-on-write of the partial last block); the fake KV checks every read, so a shared
block written by two choices shows up as stale KV. Aborts pick any sequence, single
choices included, and the pool is back at its baseline once everything ended. Mixed steps
(decode rows in prefill batches, without drafts) keep all of it, and so does a PrefillDelayer
stand-in that holds or allows at random with a random aligned share (chunked prefill): a step
under a share carries at most that many prompt tokens, and a held step resumes only the
aligned leftover."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler.block_manager import NO_HASH
from scheduler.scheduler import Scheduler
from contracts.sampling import SamplingParams
from kv_transfer.params import KVTransferParams
from scheduler.sequence import Sequence, SequenceStatus, SequenceType
from tests.fake_connector import (FakeConnector, scheduler_config, FakeKV, FakeModel, next_token, prompt,
                                  reference_choice, step)

pytestmark = pytest.mark.unit
BS = 4
MAX_MODEL_LEN = 40
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


class StubProducer:
    """The prefill side as a consumer sees it: blocks that already hold correct KV."""

    def __init__(self):
        self.kv = FakeKV(2048, BS)
        self._next = 0

    def params_for(self, prompt: list[int], tid: str) -> KVTransferParams:
        n = (len(prompt) + BS - 1) // BS
        blocks = list(range(self._next, self._next + n))
        self._next += n
        self.kv.write(blocks, 0, prompt)
        return KVTransferParams(do_remote_prefill=True, transfer_id=tid, remote_block_ids=blocks,
                                first_token_id=next_token(prompt))

    def release(self, transfer_id):
        pass


class RandomDelayer:
    """The delayer as the scheduler sees it, deciding what the test's rules say."""
    allow, share = True, 0

    def should_allow_prefill(self, **kw) -> bool:
        return self.allow

    def aligned_share(self) -> int:
        return self.share if self.allow else 0


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(role=st.sampled_from(["none", "consumer", "producer"]),
                policy=st.sampled_from(["fail", "recompute"]), spec=st.sampled_from([0, 2]),
                num_blocks=st.integers(4, 40), budget=st.sampled_from([8, 16, 64]),
                max_seqs=st.integers(1, 4), chunked=st.booleans(), prefix=st.booleans(), mixed=st.booleans(),
                delayer=st.booleans())
    def setup(self, role, policy, spec, num_blocks, budget, max_seqs, chunked, prefix, mixed, delayer):
        self.cfg = scheduler_config(num_kvcache_blocks=num_blocks, block_size=BS, max_num_seqs=max_seqs,
                                   max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                                   enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                                   num_speculative_tokens=spec, enable_mixed_chunk=mixed and not spec)
        self.kv = FakeKV(num_blocks, BS)
        self.stub = StubProducer() if role == "consumer" else None
        self.conn = None
        if role != "none":
            self.conn = FakeConnector(role, self.kv, self.stub, policy)
            self.conn.hold_pulls = True
        self.delayer = RandomDelayer() if delayer else None
        self.sched = Scheduler(self.cfg, kv_connector=self.conn, prefill_delayer=self.delayer)
        self.model = FakeModel(self.kv, spec)
        self.seqs: dict[int, Sequence] = {}
        self.emitted: dict[int, list[int]] = {}
        self.ended: dict[int, int] = {}
        self.ids = itertools.count()

    # -------------------------------------------------------------- rules

    @rule(length=st.integers(1, 44), max_tokens=st.integers(1, 10), shared=st.booleans(),
          pd=st.booleans(), choices=st.sampled_from([1, 1, 2, 3]), extra=st.sampled_from([0, 0, 1]))
    def add(self, length, max_tokens, shared, pd, choices, extra):
        n = next(self.ids)
        tail = prompt(n, length)
        tokens = (SHARED + tail)[:length] if shared else tail
        params = None
        tid = f"t{n}"
        if pd and self.stub is not None and length <= MAX_MODEL_LEN:
            params = self.stub.params_for(tokens, tid)
        elif pd and self.conn is not None and self.conn.role == "producer":
            params, max_tokens = KVTransferParams(do_remote_decode=True, transfer_id=tid), 1
            choices, extra = 1, 0  # the engine runs a prefill leg as one sequence
        sp = SamplingParams(max_tokens=max_tokens, n=choices, best_of=choices + extra if extra else None)
        seq = Sequence(tokens, sp, kv_transfer_params=params)
        self.seqs[seq.id] = seq
        self.sched.add(seq)

    @rule(allow=st.sampled_from([True, False, False]), share=st.sampled_from([0, 1, 4, 9]))
    def delayer_decides(self, allow, share):
        """The next steps' decision: held, or allowed with an aligned share (chunked prefill only,
        as EngineConfig refuses it without)."""
        if self.delayer is not None:
            self.delayer.allow, self.delayer.share = allow, share if self.cfg.enable_chunked_prefill else 0

    @rule()
    def step(self):
        s = self.sched
        leftover = set(s._prefilling) if s._leftover_share else set()  # what a held step may resume
        share = max(BS, self.delayer.share // BS * BS) if self.delayer and self.delayer.allow and self.delayer.share \
            else s._leftover_share if leftover else 0
        batch, updates = step(self.sched, self.model, self.conn)
        if batch is not None:
            assert len(batch.seqs) <= self.cfg.max_num_seqs
            assert batch.num_tokens <= self.cfg.max_num_batched_tokens
            assert len(batch.seqs) == len({s.id for s in batch.seqs})
        if batch is not None and batch.is_prefill:
            prompt_rows = [(q, n) for q, n in zip(batch.seqs, batch.num_scheduled_tokens)
                           if q.type is SequenceType.PREFILL]
            if share:
                assert sum(n for _, n in prompt_rows) <= share
            if self.delayer is not None and not self.delayer.allow:
                assert {q.id for q, _ in prompt_rows} <= leftover, "a held step prefilled more than the leftover"
        for u in updates:
            self.seqs.setdefault(u.seq.id, u.seq)  # a choice forked this step
            self.emitted.setdefault(u.seq.id, []).extend(u.new_token_ids)
            if u.finished:
                self._ended(u.seq)
        for seq in self.sched.take_rejected():
            self._ended(seq)

    @rule(data=st.data())
    def abort(self, data):
        if not self.seqs:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.sched.abort(seq_id)
        if seq is not None:
            assert seq.status is SequenceStatus.ABORTED
            self._ended(seq)

    @rule(data=st.data())
    def preempt(self, data):
        if self.sched.running:
            self.sched.preempt(data.draw(st.sampled_from(self.sched.running)))

    @rule(data=st.data(), failed=st.booleans())
    def end_a_pull(self, data, failed):
        if self.conn is not None and self.conn.in_flight:
            self.conn.stop_pull(data.draw(st.sampled_from(sorted(self.conn.in_flight))), failed)

    @rule(data=st.data())
    def consumer_done(self, data):
        if self.conn is not None and self.conn.serving:
            self.conn.release(data.draw(st.sampled_from(sorted(self.conn.serving))))

    def _ended(self, seq):
        self.ended[seq.id] = self.ended.get(seq.id, 0) + 1
        assert self.ended[seq.id] == 1, f"sequence {seq.id} ended twice"

    # -------------------------------------------------------------- invariants

    @invariant()
    def blocks_and_queues_are_consistent(self):
        s, bm = self.sched, self.sched.block_manager
        queues = [[q.id for q in s.waiting], [q.id for q in s.running], list(s.parked),
                  list(s._aborting), list(s.deferred_free_blocks)]
        flat = [i for q in queues for i in q]
        assert len(flat) == len(set(flat)), "a sequence is in two queues"
        assert set(s._live) == set(queues[0]) | set(queues[1]) | set(queues[2])
        assert len(s.running) + len(s.parked) <= self.cfg.max_num_seqs
        holders = list(s.running) + list(s.parked.values()) + list(s._aborting.values()) \
            + list(s.deferred_free_blocks.values())
        refs = [0] * bm.num_total_blocks
        for seq in holders:
            assert len(seq.block_table) == len(set(seq.block_table))
            for b in seq.block_table:
                refs[b] += 1
            # speculative decoding's rollback: no block is held for a rejected draft, and the
            # prefix index names accepted tokens only
            assert len(seq.block_table) <= bm.num_blocks_for(seq.num_tokens), f"{seq} holds blocks past its tokens"
            for i in range(seq.num_published_blocks):
                block = bm.blocks[seq.block_table[i]]
                if block.hash != NO_HASH:
                    assert block.token_ids == seq.token_ids[i * BS:(i + 1) * BS]
        for seq in self.seqs.values():
            if seq not in holders:
                assert seq.block_table == [], f"{seq} holds blocks outside any queue"
        assert [b.ref_count for b in bm.blocks] == refs
        free = set(bm.pool.vacant) | set(bm.pool.cached_free)
        assert len(bm.pool.vacant) + len(bm.pool.cached_free) == len(free) == bm.num_free_blocks
        assert free == {b.block_id for b in bm.blocks if b.ref_count == 0}
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
        assert all(bm.blocks[b].hash != NO_HASH for b in bm.pool.cached_free)
        assert all(bm.blocks[b].hash == NO_HASH for b in bm.pool.vacant)
        assert all(bm.blocks[b].hash == h for h, b in bm.pool.index.items())

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        if self.conn is not None:
            self.conn.hold_pulls = False
        if self.delayer is not None:
            self.delayer.allow = True
        for _ in range(2000):
            if self.sched.is_finished():
                break
            if self.conn is not None:
                for tid in list(self.conn.serving):
                    self.conn.release(tid)
            self.step()
        assert self.sched.is_finished()
        assert self.sched.block_manager.num_free_blocks == self.cfg.num_kvcache_blocks
        assert set(self.ended) == set(self.seqs), "a sequence never ended"
        for seq_id, seq in self.seqs.items():
            got = self.emitted.get(seq_id, [])
            assert got == reference_choice(seq.prompt_token_ids, seq.index, len(got))
            if seq.index:
                assert seq.group[0].num_forks == 0 and seq in seq.group
            if seq.leave_reason in ("max_tokens", "max_model_len"):
                assert len(got) == seq.sampling_params.max_tokens or seq.num_tokens >= MAX_MODEL_LEN
        if self.conn is not None:
            assert all(v == 1 for v in self.conn.finished_calls.values())
            assert all(v == 1 for v in self.conn.aborted_calls.values())
            ended_normally = {i for i, s in self.seqs.items() if s.leave_reason != "aborted"}
            assert set(self.conn.finished_calls) == ended_normally


SchedulerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_scheduler_state_machine = SchedulerMachine.TestCase
