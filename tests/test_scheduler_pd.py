"""Scheduler with a KV connector: the prefill (producer) and decode (consumer) sides.

A FakeConnector copies "KV" (token ids per position) from P's FakeKV into D's, so a
decode that reads a wrong or missing block fails FakeKV's check. The reference for D's
output is the colocated greedy completion computed by hand.
"""
from __future__ import annotations

import msgspec
import pytest

from scheduler.scheduler import Scheduler
from contracts.sampling import SamplingParams
from kv_transfer.params import KVTransferParams
from scheduler.sequence import Sequence, SequenceStatus
from tests.fake_connector import FakeConnector, add_all, scheduler_config, FakeKV, FakeModel, prompt, reference_completion, step

pytestmark = pytest.mark.unit
NB, BS = 32, 4


class Engine:
    def __init__(self, role, peer=None, spec=0, policy="fail", **kw):
        cfg = scheduler_config(num_kvcache_blocks=NB, block_size=BS, num_speculative_tokens=spec,
                              max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64), **kw)
        self.kv = FakeKV(NB, BS)
        self.conn = FakeConnector(role, self.kv, peer.conn if peer else None, policy)
        self.sched = Scheduler(cfg, kv_connector=self.conn)
        self.model = FakeModel(self.kv, spec)
        self.out: dict[int, list[int]] = {}

    def step(self):
        batch, updates = step(self.sched, self.model, self.conn)
        for u in updates:
            self.out.setdefault(u.seq.id, []).extend(u.new_token_ids)
        return batch, updates

    def run(self, max_steps=200):
        for _ in range(max_steps):
            if self.sched.is_finished():
                return
            self.step()
        raise AssertionError("engine did not finish")


def prefill_on_p(p: Engine, tokens, transfer_id="t1"):
    seq = Sequence(tokens, SamplingParams(max_tokens=1),
                   kv_transfer_params=KVTransferParams(do_remote_decode=True, transfer_id=transfer_id))
    p.sched.add(seq)
    while seq.status is not SequenceStatus.FINISHED:
        p.step()
    return seq


def test_consumer_parks_is_promoted_on_finished_recving_injects_t0_and_never_prefills():
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    tokens = prompt(1, 10)
    pseq = prefill_on_p(p, tokens)
    params = pseq.kv_transfer_params_output
    assert params.first_token_id == reference_completion(tokens, 1)[0]
    dseq = Sequence(tokens, SamplingParams(max_tokens=8), kv_transfer_params=params)
    d.sched.add(dseq)
    batch = d.sched.schedule()  # admission: blocks allocated, parked, pull described in meta
    assert dseq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert batch.seqs == [] and [load[0] for load in batch.connector_meta.loads] == [dseq.id]
    assert d.sched.get_request_counts() == (0, 1) and len(dseq.block_table) == 3
    d.conn.start_load_kv(batch.connector_meta)
    d.sched.update_from_kv_connector_output(d.conn.get_finished())
    assert dseq.status is SequenceStatus.RUNNING  # promoted as the pull is reported ...
    (first,) = d.sched.take_first_tokens()  # ... and T0 goes out then, before any forward of it
    assert first.seq is dseq and first.new_token_ids == [params.first_token_id] and not first.finished
    assert d.sched.take_first_tokens() == []
    d.out[dseq.id] = list(first.new_token_ids)
    batch, updates = d.step()
    assert not batch.is_prefill and batch.num_computed_tokens.tolist() == [10]
    assert batch.token_ids.tolist() == [params.first_token_id]
    assert updates[0].new_token_ids == reference_completion(tokens, 2)[1:]  # T1 alone
    d.run()
    assert d.out[dseq.id] == reference_completion(tokens, 8)
    assert d.model.prefilled_tokens == 0
    assert d.sched.block_manager.num_free_blocks == NB
    assert d.conn.finished_calls == {dseq.id: 1}


def test_producer_defers_frees_until_finished_sending():
    p = Engine("producer")
    pseq = prefill_on_p(p, prompt(2, 9))
    assert pseq.id in p.sched.deferred_free_blocks and not p.sched.is_finished()
    assert p.sched.block_manager.num_free_blocks == NB - 3
    p.sched.update_from_kv_connector_output(p.conn.get_finished())
    assert p.sched.block_manager.num_free_blocks == NB - 3  # nobody pulled yet
    p.conn.release("t1")  # the consumer's DONE
    p.step()
    assert p.sched.block_manager.num_free_blocks == NB and p.sched.is_finished()
    p.conn.release("t1")  # duplicate DONE: ignored, nothing freed twice
    p.sched.update_from_kv_connector_output(p.conn.get_finished())
    assert p.sched.block_manager.num_free_blocks == NB
    assert p.conn.finished_calls == {pseq.id: 1}


def test_a_plain_request_on_a_producer_frees_at_once():
    p = Engine("producer")
    seq = Sequence(prompt(3, 6), SamplingParams(max_tokens=3))
    p.sched.add(seq)
    p.run()
    assert p.sched.block_manager.num_free_blocks == NB and not p.sched.deferred_free_blocks


def test_full_pd_round_frees_both_sides_and_matches_colocated_output():
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    prompts = [prompt(10 + i, 5 + 3 * i) for i in range(4)]
    dseqs = []
    for i, tokens in enumerate(prompts):
        pseq = prefill_on_p(p, tokens, transfer_id=f"t{i}")
        dseqs.append(Sequence(tokens, SamplingParams(max_tokens=6),
                              kv_transfer_params=pseq.kv_transfer_params_output))
    add_all(d.sched, dseqs)
    d.run()
    p.run()
    for tokens, seq in zip(prompts, dseqs):
        assert d.out[seq.id] == reference_completion(tokens, 6)
    assert p.sched.block_manager.num_free_blocks == NB == d.sched.block_manager.num_free_blocks


def test_consumer_reuses_its_own_prefix_hit_and_pulls_only_the_rest():
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    tokens = prompt(4, 13)
    local = Sequence(tokens[:9], SamplingParams(max_tokens=1))  # warms D's cache with 2 blocks
    d.sched.add(local)
    d.run()
    pseq = prefill_on_p(p, tokens)
    dseq = Sequence(tokens, SamplingParams(max_tokens=4), kv_transfer_params=pseq.kv_transfer_params_output)
    d.sched.add(dseq)
    batch = d.sched.schedule()
    assert batch.connector_meta.loads[0][3] == 2  # first block to pull
    assert dseq.num_computed_tokens == 8
    d.conn.start_load_kv(batch.connector_meta)
    d.sched.update_from_kv_connector_output(d.conn.get_finished())
    d.run()
    assert d.out[dseq.id] == reference_completion(tokens, 4)


def test_received_prompt_blocks_enter_the_consumers_prefix_cache():
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    tokens = prompt(5, 12)
    pseq = prefill_on_p(p, tokens)
    d.sched.add(Sequence(tokens, SamplingParams(max_tokens=2), kv_transfer_params=pseq.kv_transfer_params_output))
    d.run()
    again = Sequence(tokens + [7], SamplingParams(max_tokens=2))
    d.sched.add(again)
    d.run()
    assert again.num_cached_tokens == 12
    assert d.out[again.id] == reference_completion(tokens + [7], 2)


def test_max_tokens_one_on_the_consumer_returns_just_t0():
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    tokens = prompt(6, 7)
    pseq = prefill_on_p(p, tokens)
    dseq = Sequence(tokens, SamplingParams(max_tokens=1), kv_transfer_params=pseq.kv_transfer_params_output)
    d.sched.add(dseq)
    d.run()
    assert d.out[dseq.id] == reference_completion(tokens, 1) and dseq.leave_reason == "max_tokens"


def test_drafts_from_the_producer_are_verified_in_the_first_decode():
    p = Engine("producer")
    d = Engine("consumer", peer=p, spec=2)
    tokens = prompt(7, 9)
    pseq = prefill_on_p(p, tokens)
    ref = reference_completion(tokens, 10)
    params = msgspec.structs.replace(pseq.kv_transfer_params_output, draft_token_ids=ref[1:3])
    dseq = Sequence(tokens, SamplingParams(max_tokens=10), kv_transfer_params=params)
    d.sched.add(dseq)
    _, updates = d.step()  # the pull lands: T0 out
    assert [u.new_token_ids for u in updates] == [ref[:1]]
    batch, updates = d.step()
    assert batch.token_ids.tolist() == ref[:3] and batch.num_scheduled_tokens.tolist() == [3]
    assert updates[0].new_token_ids == ref[1:4]  # two accepted drafts + bonus
    d.run()
    assert d.out[dseq.id] == ref


@pytest.mark.parametrize("pull_ends", ["finished", "failed"])
def test_aborting_a_parked_sequence_frees_blocks_only_after_the_pull_stops(pull_ends):
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    tokens = prompt(8, 10)
    pseq = prefill_on_p(p, tokens)
    dseq = Sequence(tokens, SamplingParams(max_tokens=4), kv_transfer_params=pseq.kv_transfer_params_output)
    d.sched.add(dseq)
    d.conn.hold_pulls = True
    d.step()
    assert d.sched.abort(dseq.id) is dseq and dseq.status is SequenceStatus.ABORTED
    assert d.sched.block_manager.num_free_blocks == NB - 3  # the pull may still write
    assert not d.sched.is_finished()
    d.conn.stop_pull(dseq.id, failed=(pull_ends == "failed"))
    d.step()
    assert d.sched.block_manager.num_free_blocks == NB and d.sched.is_finished()
    d.sched.update_from_kv_connector_output(
        type(d.conn.get_finished())(finished_recving=[dseq.id], failed_recving=[dseq.id]))
    assert d.sched.block_manager.num_free_blocks == NB  # late reports never free twice
    assert d.conn.aborted_calls == {dseq.id: 1} and d.conn.finished_calls == {}


def test_abort_after_the_pull_finished_but_before_promotion_frees_at_once():
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    tokens = prompt(9, 10)
    pseq = prefill_on_p(p, tokens)
    dseq = Sequence(tokens, SamplingParams(max_tokens=4), kv_transfer_params=pseq.kv_transfer_params_output)
    d.sched.add(dseq)
    d.step()  # parked, pull done at this step's get_finished
    assert d.sched.abort(dseq.id) is dseq
    assert d.sched.block_manager.num_free_blocks == NB and d.sched.is_finished()


def test_failed_pull_with_policy_fail_finishes_with_an_error():
    p = Engine("producer")
    d = Engine("consumer", peer=p)
    tokens = prompt(11, 10)
    pseq = prefill_on_p(p, tokens)
    dseq = Sequence(tokens, SamplingParams(max_tokens=4), kv_transfer_params=pseq.kv_transfer_params_output)
    d.conn.fail_ids.add(dseq.id)
    d.sched.add(dseq)
    d.step()
    assert d.sched.take_rejected() == [dseq]
    assert dseq.leave_reason == "kv_transfer_failed" and dseq.error.startswith("kv_transfer_failed: ")
    assert d.sched.block_manager.num_free_blocks == NB and d.sched.num_recv_failures == 1
    assert d.conn.finished_calls == {dseq.id: 1}


def test_failed_pull_with_policy_recompute_prefills_locally():
    p = Engine("producer")
    d = Engine("consumer", peer=p, policy="recompute")
    tokens = prompt(12, 10)
    pseq = prefill_on_p(p, tokens)
    dseq = Sequence(tokens, SamplingParams(max_tokens=5), kv_transfer_params=pseq.kv_transfer_params_output)
    d.conn.fail_ids.add(dseq.id)
    d.sched.add(dseq)
    d.run()
    assert d.out[dseq.id] == reference_completion(tokens, 5)
    assert d.sched.num_recv_recomputes == 1 and d.model.prefilled_tokens == 10
    assert d.sched.block_manager.num_free_blocks == NB


def test_running_plus_parked_never_exceeds_max_num_seqs_and_promotion_goes_first():
    p = Engine("producer")
    d = Engine("consumer", peer=p, max_num_seqs=2)
    remote = []
    for i in range(2):
        tokens = prompt(20 + i, 6)
        pseq = prefill_on_p(p, tokens, transfer_id=f"r{i}")
        remote.append(Sequence(tokens, SamplingParams(max_tokens=3),
                               kv_transfer_params=pseq.kv_transfer_params_output))
    fresh = Sequence(prompt(30, 6), SamplingParams(max_tokens=3))
    d.conn.hold_pulls = True
    add_all(d.sched, remote + [fresh])
    d.step()
    assert len(d.sched.parked) == 2 and fresh.status is SequenceStatus.WAITING
    for seq in remote:
        d.conn.stop_pull(seq.id, failed=False)
    d.sched.update_from_kv_connector_output(d.conn.get_finished())
    batch, _ = d.step()
    assert batch.seqs == remote and fresh.status is SequenceStatus.WAITING
    while not d.sched.is_finished():
        d.step()
        assert len(d.sched.running) + len(d.sched.parked) <= 2
    assert d.out[fresh.id] == reference_completion(fresh.prompt_token_ids, 3)


def test_aborting_a_deferred_sequence_tells_the_connector_and_frees_on_finished_sending():
    p = Engine("producer")
    pseq = prefill_on_p(p, prompt(13, 9))
    assert p.sched.abort(pseq.id) is None  # already finished: no second output
    assert p.conn.aborted_calls == {pseq.id: 1}
    p.step()
    assert p.sched.block_manager.num_free_blocks == NB and p.sched.is_finished()


def test_unknown_ids_from_the_connector_are_ignored():
    p = Engine("producer")
    p.sched.update_from_kv_connector_output(
        type(p.conn.get_finished())(finished_sending=[123456], finished_recving=[1], failed_recving=[2]))
    assert p.sched.is_finished() and p.sched.block_manager.num_free_blocks == NB


def test_a_remote_prompt_filling_max_model_len_is_rejected_on_the_consumer():
    p = Engine("producer")
    d = Engine("consumer", peer=p, max_model_len=12)
    tokens = prompt(14, 12)
    pseq = prefill_on_p(p, tokens)
    dseq = Sequence(tokens, SamplingParams(max_tokens=4), kv_transfer_params=pseq.kv_transfer_params_output)
    d.sched.add(dseq)
    d.step()
    assert d.sched.take_rejected() == [dseq] and "max_model_len=12" in dseq.error
    assert d.sched.block_manager.num_free_blocks == NB and d.conn.finished_calls == {dseq.id: 1}


def test_connector_factory_builds_registered_backends_and_names_bad_input():
    from kv_transfer.factory import create_connector, register_connector

    register_connector("fake-test", lambda role, config: (role, config))
    assert create_connector("fake-test", "consumer", {"x": 1}) == ("consumer", {"x": 1})
    with pytest.raises(ValueError, match="kv_role"):
        create_connector("fake-test", "sideways", None)
    with pytest.raises(ValueError, match="kv_transfer_backend"):
        create_connector("no-such-backend", "producer", None)
