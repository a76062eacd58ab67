"""Scheduler, colocated path: admission, chunking, prefix cache, preemption, stop conditions.

Generated tokens are checked against `reference_completion` (greedy decoding computed by
hand from the fake model's rule) and every forward checks its KV through FakeKV.
"""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.scheduler import ScheduledBatchOutput, Scheduler, SchedulerConfig
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence, SequenceStatus
import scheduler.scheduler as scheduler_module
from tests.fake_connector import FakeKV, add_all, scheduler_config, FakeModel, prompt, reference_completion, step

pytestmark = pytest.mark.unit


def make(num_blocks=64, spec=0, detokenize=None, **kw):
    cfg = scheduler_config(num_kvcache_blocks=num_blocks, block_size=kw.pop("block_size", 4),
                          num_speculative_tokens=spec, **kw)
    sched = Scheduler(cfg, detokenize=detokenize)
    return sched, FakeModel(FakeKV(num_blocks, cfg.block_size), spec)


def run(sched, model, max_steps=500):
    """Drive to completion; returns {seq_id: emitted tokens} and the finished updates."""
    emitted, finished = {}, {}
    for _ in range(max_steps):
        if sched.is_finished():
            break
        for seq in sched.take_rejected():
            finished[seq.id] = seq
        _, updates = step(sched, model)
        for u in updates:
            emitted.setdefault(u.seq.id, []).extend(u.new_token_ids)
            if u.finished:
                assert u.seq.id not in finished, "a sequence finished twice"
                finished[u.seq.id] = u.seq
    assert sched.is_finished(), "did not finish"
    return emitted, finished


def test_many_requests_match_the_reference_and_free_every_block():
    sched, model = make(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=5)
    seqs = [Sequence(prompt(i, 5 + 7 * i), SamplingParams(max_tokens=6 + i)) for i in range(8)]
    for seq in seqs:
        sched.add(seq)
    emitted, finished = run(sched, model)
    for i, seq in enumerate(seqs):
        assert emitted[seq.id] == reference_completion(seq.prompt_token_ids, 6 + i)
        assert seq.leave_reason == "max_tokens" and seq.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 64


def test_decode_schedules_exactly_one_token_per_sequence_its_last():
    sched, model = make()
    seqs = [Sequence(prompt(i, 6), SamplingParams(max_tokens=4)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    step(sched, model)  # prefill
    batch = sched.schedule()
    assert not batch.is_prefill
    assert batch.num_scheduled_tokens.tolist() == [1, 1, 1]
    assert batch.token_ids.tolist() == [s.token_ids[-1] for s in seqs]
    assert batch.num_computed_tokens.tolist() == [s.num_tokens - 1 for s in seqs]


@pytest.mark.parametrize("kw, tokens, match", [
    ({"max_model_len": 16}, 17, "max_model_len=16"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8, "max_model_len": 64}, 9,
     "max_num_batched_tokens=8"),
    ({"num_blocks": 2, "max_model_len": 64}, 9, "total pool blocks=2"),
])
def test_unschedulable_requests_are_rejected_with_a_reason_and_surface_as_finished(kw, tokens, match):
    sched, model = make(**kw)
    bad, good = Sequence(list(range(2, 2 + tokens))), Sequence([5, 6, 7], SamplingParams(max_tokens=2))
    add_all(sched, [bad, good])
    batch = sched.schedule()
    assert batch.seqs == [good]  # the rejected one does not block the queue
    assert not sched.is_finished()
    rejected = sched.take_rejected()
    assert rejected == [bad] and match in bad.error
    assert bad.leave_reason == "unschedulable" and bad.error.startswith("unschedulable: ")
    assert bad.status is SequenceStatus.FINISHED and bad.finish_reason == "abort"
    assert sched.take_rejected() == []


def test_budget_truncated_chunks_end_on_the_block_grid_no_slivers():
    sched, _ = make(num_blocks=2048, block_size=16, max_num_batched_tokens=16384, max_model_len=32768)
    a, b = Sequence([3] * 16374), Sequence([4] * 100)
    add_all(sched, [a, b])
    batch = sched.schedule()
    assert batch.seqs == [a] and batch.num_scheduled_tokens.tolist() == [16374]
    # a long prompt is cut at a block boundary, and the next one is not given the 10-token rest
    sched2, _ = make(num_blocks=2048, block_size=16, max_num_batched_tokens=16384, max_model_len=32768)
    c, d = Sequence([5] * 16000), Sequence([6] * 1000)
    add_all(sched2, [c, d])
    batch = sched2.schedule()
    assert batch.num_scheduled_tokens.tolist() == [16000, 384]
    assert batch.needs_sample.tolist() == [True, False]


def test_a_chunk_that_does_not_finish_the_prompt_produces_no_tokens():
    sched, model = make(max_num_batched_tokens=8)
    seq = Sequence(prompt(1, 20), SamplingParams(max_tokens=3))
    sched.add(seq)
    batch, updates = step(sched, model)
    assert batch.needs_sample.tolist() == [False] and updates == []
    assert seq.num_computed_tokens == 8 and seq.num_completion_tokens == 0
    emitted, _ = run(sched, model)
    assert emitted[seq.id] == reference_completion(seq.prompt_token_ids, 3)


def test_long_prefill_token_threshold_caps_each_chunk():
    sched, _ = make(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    add_all(sched, [Sequence(prompt(1, 20)), Sequence(prompt(2, 20))])
    assert sched.schedule().num_scheduled_tokens.tolist() == [8, 8]


def test_second_request_with_the_same_prefix_hits_the_cache_and_gets_the_same_tokens():
    sched, model = make(max_num_batched_tokens=64)
    shared = prompt(7, 12)
    first = Sequence(shared + [11], SamplingParams(max_tokens=3))
    sched.add(first)
    run(sched, model)
    second = Sequence(shared + [11], SamplingParams(max_tokens=3))
    exact = Sequence(shared, SamplingParams(max_tokens=3))
    add_all(sched, [second, exact])
    emitted, _ = run(sched, model)
    assert second.num_cached_tokens == 12  # 3 full blocks
    assert exact.num_cached_tokens == 8  # its last block holds the last prompt token
    assert emitted[second.id] == reference_completion(second.prompt_token_ids, 3)
    assert emitted[exact.id] == reference_completion(shared, 3)
    assert sched.cache_stats.hits == 20 and sched.cache_stats.queries == 13 + 13 + 12
    assert sched.reset_prefix_cache()
    third = Sequence(shared + [11])
    sched.add(third)
    sched.schedule()
    assert third.num_cached_tokens == 0


def test_concurrent_identical_prompts_do_not_share_unpublished_blocks():
    sched, model = make(max_num_batched_tokens=64)
    p = prompt(3, 13)
    a, b = Sequence(p, SamplingParams(max_tokens=2)), Sequence(p, SamplingParams(max_tokens=2))
    add_all(sched, [a, b])
    batch = sched.schedule()
    assert batch.seqs == [a, b] and b.num_cached_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)


def test_preempted_sequences_are_restored_and_complete_with_the_reference_tokens():
    sched, model = make(num_blocks=10, max_num_batched_tokens=64, max_num_seqs=4)
    seqs = [Sequence(prompt(i, 6), SamplingParams(max_tokens=14)) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    emitted, _ = run(sched, model)
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert emitted[seq.id] == reference_completion(seq.prompt_token_ids, 14)
    assert sched.block_manager.num_free_blocks == 10


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back():
    p = prompt(5, 5)
    ref = reference_completion(p, 10)
    eos = ref[2]
    # below min_tokens an EOS is just a token; the first EOS at index >= min_tokens - 1 stops
    later = next((j for j in range(3, 10) if ref[j] == eos), None)
    held = (ref[:later + 1], "eos") if later is not None else (ref, "max_tokens")
    cases = [(SamplingParams(max_tokens=10), (ref[:3], "eos")),
             (SamplingParams(max_tokens=10, ignore_eos=True), (ref, "max_tokens")),
             (SamplingParams(max_tokens=10, min_tokens=4), held)]
    for sp, (want, reason) in cases:
        sched, model = make(eos_token_id=eos)
        seq = Sequence(p, sp)
        sched.add(seq)
        emitted, _ = run(sched, model)
        assert emitted[seq.id] == want and seq.leave_reason == reason
        assert seq.stop_reason is None


def test_stop_token_ids_from_request_and_config():
    p = prompt(6, 5)
    ref = reference_completion(p, 10)
    sched, model = make()
    seq = Sequence(p, SamplingParams(max_tokens=10, stop_token_ids=[ref[3]]))
    sched.add(seq)
    emitted, _ = run(sched, model)
    assert emitted[seq.id] == ref[:4] and seq.leave_reason == "stop_token" and seq.stop_reason == ref[3]
    sched, model = make(stop_token_ids=[ref[1]])  # the model's extra end token acts like EOS
    seq = Sequence(p, SamplingParams(max_tokens=10))
    sched.add(seq)
    emitted, _ = run(sched, model)
    assert emitted[seq.id] == ref[:2] and seq.leave_reason == "eos"


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_are_found_in_the_detokenized_completion():
    p = prompt(8, 5)
    ref = reference_completion(p, 12)
    text = letters(ref)
    stop = text[4:7]  # spans three tokens, ends at token 6
    first = text.find(stop)
    sched, model = make(detokenize=letters)
    seq = Sequence(p, SamplingParams(max_tokens=12, stop=[stop, "zzzzzzzz"]))
    sched.add(seq)
    emitted, _ = run(sched, model)
    assert emitted[seq.id] == ref[:first + len(stop)]
    assert seq.leave_reason == "stop_string" and seq.stop_reason == stop


def test_stop_strings_without_a_detokenizer_are_refused():
    sched, _ = make()
    with pytest.raises(ValueError, match="detokenize"):
        sched.add(Sequence([3, 4], SamplingParams(stop=["x"])))


def test_max_model_len_caps_generation():
    sched, model = make(max_model_len=12)
    seq = Sequence(prompt(9, 9), SamplingParams(max_tokens=10))
    sched.add(seq)
    emitted, _ = run(sched, model)
    assert len(emitted[seq.id]) == 3 and seq.leave_reason == "max_model_len"
    assert seq.num_tokens == 12 and seq.finish_reason == "length"


def test_speculative_tokens_give_the_reference_tokens_and_count_acceptance():
    sched, model = make(spec=2, max_num_batched_tokens=64)
    seqs = [Sequence(prompt(i, 7), SamplingParams(max_tokens=15)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    emitted, _ = run(sched, model)
    for seq in seqs:
        assert emitted[seq.id] == reference_completion(seq.prompt_token_ids, 15)
    st = sched.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.num_draft_tokens == 2 * st.num_steps and sum(st.distribution.values()) == st.num_steps
    assert sched.block_manager.num_free_blocks == 64


def test_a_lone_sequence_drops_its_drafts_rather_than_preempt_itself_forever():
    sched, model = make(num_blocks=3, spec=2, max_num_batched_tokens=64)
    model.bad_draft_every = 10_000
    seq = Sequence(prompt(3, 10), SamplingParams(max_tokens=2))  # 3 blocks; drafts would need a 4th
    sched.add(seq)
    emitted, _ = run(sched, model, max_steps=20)
    assert emitted[seq.id] == reference_completion(seq.prompt_token_ids, 2)
    assert sched.num_preemptions == 0


def test_speculative_tokens_past_a_stop_are_cut():
    p = prompt(2, 6)
    ref = reference_completion(p, 20)
    sched, model = make(spec=3, eos_token_id=ref[5], max_num_batched_tokens=64)
    model.bad_draft_every = 10_000  # drafts always right: EOS arrives inside accepted drafts
    seq = Sequence(p, SamplingParams(max_tokens=20))
    sched.add(seq)
    emitted, _ = run(sched, model)
    assert emitted[seq.id] == ref[:6] and seq.completion_token_ids == ref[:6]


def test_abort_frees_blocks_once_for_waiting_and_running_sequences():
    sched, model = make(num_blocks=16, max_num_seqs=1)
    running, waiting = Sequence(prompt(1, 9)), Sequence(prompt(2, 9))
    add_all(sched, [running, waiting])
    step(sched, model)
    assert sched.block_manager.num_free_blocks == 16 - 3
    assert sched.abort(waiting.id) is waiting and waiting.status is SequenceStatus.ABORTED
    assert sched.abort(running.id) is running and running.finish_reason == "abort"
    assert sched.abort(running.id) is None and sched.abort(10**12) is None
    assert sched.block_manager.num_free_blocks == 16 and sched.is_finished()


def test_a_sequence_aborted_between_schedule_and_postprocess_is_skipped():
    sched, model = make()
    seq = Sequence(prompt(1, 5))
    sched.add(seq)
    batch = sched.schedule()
    out = model.forward(batch)
    sched.abort(seq.id)
    assert sched.postprocess(batch, out) == []
    assert sched.block_manager.num_free_blocks == 64


def test_running_never_exceeds_max_num_seqs():
    sched, model = make(max_num_seqs=3, max_num_batched_tokens=64)
    add_all(sched, [Sequence(prompt(i, 4), SamplingParams(max_tokens=5)) for i in range(7)])
    while not sched.is_finished():
        step(sched, model)
        assert len(sched.running) <= 3


def test_postprocess_rejects_output_for_another_batch():
    sched, model = make()
    sched.add(Sequence([3, 4, 5]))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="seq_ids"):
        sched.postprocess(batch, ScheduledBatchOutput([-1], [[3]]))


def test_numpy_tokens_become_python_ints_and_counters_do_not_wrap():
    sched, _ = make()
    seq = Sequence(np.array([3, 4, 5], dtype=np.int32).tolist())
    sched.add(seq)
    batch = sched.schedule()
    sched.postprocess(batch, ScheduledBatchOutput(batch.seq_ids, [[np.int32(9)]]))
    assert type(seq.token_ids[-1]) is int
    sched.cache_stats.hits = sched.cache_stats.queries = 2**31 - 1
    sched.cache_stats.update(10, 10)
    assert sched.cache_stats.hits == 2**31 + 9 and sched.cache_stats.queries == 2**31 + 9


def test_scheduler_delay_factor_holds_new_prefills_while_decodes_run(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(scheduler_module, "_now", lambda: clock[0])
    sched, model = make(scheduler_delay_factor=1.0)
    sched.add(Sequence(prompt(1, 5), SamplingParams(max_tokens=50), arrive_time=clock[0]))
    step(sched, model)  # prefill at t=1000
    clock[0] += 2.0
    step(sched, model)  # decode: the last prompt step took 2 s
    late = Sequence(prompt(2, 5), arrive_time=clock[0])
    sched.add(late)
    clock[0] += 1.0
    batch, _ = step(sched, model)  # waited 1 s < 1.0 * 2 s: hold
    assert not batch.is_prefill
    clock[0] += 1.5
    batch, _ = step(sched, model)  # waited 2.5 s > 2 s
    assert batch.is_prefill and batch.seqs == [late]


def test_kv_events_are_recorded_when_enabled():
    sched, model = make(enable_kv_events=True)
    seq = Sequence(prompt(1, 9), SamplingParams(max_tokens=1))
    sched.add(seq)
    run(sched, model)
    events = sched.block_manager.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    assert events[0].token_ids == seq.token_ids[:8] and len(events[0].block_hashes) == 2


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_size"):
        scheduler_config(num_kvcache_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="scheduler_delay_factor"):
        scheduler_config(num_kvcache_blocks=4, scheduler_delay_factor=-1)
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        scheduler_config(num_kvcache_blocks=0)
    with pytest.raises(TypeError, match="max_model_len"):  # the engine passes every value
        SchedulerConfig(num_kvcache_blocks=4, max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                        enable_prefix_caching=True, enable_chunked_prefill=True, scheduler_delay_factor=0.0,
                        long_prefill_token_threshold=0)


def test_mixed_steps_carry_every_running_streams_token_in_each_prefill_step():
    """enable_mixed_chunk: a decode-ready sequence gets a token every step, prefill steps included
    (its row first, one token, then the prompt chunks in what is left of the budget), and the
    tokens are the reference's; without it a prefill step carries no decode row (the seed's)."""
    for mixed in (False, True):
        sched, model = make(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=4, enable_mixed_chunk=mixed)
        seqs = [Sequence(prompt(i, 3 + 9 * i), SamplingParams(max_tokens=8)) for i in range(5)]
        sched.add(seqs[0])
        steps_with_both = 0
        for t in range(60):
            if 1 <= t <= 4:
                sched.add(seqs[t])  # arrivals while seqs[0] decodes
            ready = [s for s in sched.running if s.id not in sched._prefilling]
            batch, _ = step(sched, model)
            if batch is None:
                break
            assert batch.num_tokens <= 16
            rows = batch.seqs[:len(ready)]
            if mixed:
                assert rows == ready[:4] and batch.num_scheduled_tokens[:len(rows)].tolist() == [1] * len(rows)
            elif batch.is_prefill:
                assert not set(batch.seqs) & set(ready)
            steps_with_both += batch.is_prefill and bool(ready) and rows == ready
        assert sched.is_finished() and sched.block_manager.num_free_blocks == 64
        assert (steps_with_both > 0) == mixed
        for seq in seqs:
            assert seq.completion_token_ids == reference_completion(seq.prompt_token_ids, 8)


def test_mixed_steps_refuse_speculative_decoding():
    with pytest.raises(ValueError, match="enable_mixed_chunk"):
        make(spec=2, enable_mixed_chunk=True)
