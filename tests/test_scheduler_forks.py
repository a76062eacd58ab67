"""Forks (n / best_of) in the scheduler, step by step: the prompt prefilled once, its blocks
shared by reference count, the partly filled last block copied on write (the last holder
writes in place), a seat per pending fork, single choices aborted, the pool at baseline.
The random interleavings are in test_scheduler_properties.py."""
from __future__ import annotations

import pytest

from scheduler.scheduler import Scheduler
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence, SequenceStatus
from tests.fake_connector import FakeKV, FakeModel, reference_choice, scheduler_config, step

pytestmark = pytest.mark.unit
BS = 4


def setup(num_blocks: int = 32, max_num_seqs: int = 8):
    sched = Scheduler(scheduler_config(num_kvcache_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=64, max_model_len=64))
    return sched, FakeModel(FakeKV(num_blocks, BS))


def run(sched, model, emitted: dict, steps: int = 100) -> None:
    for _ in range(steps):
        if sched.is_finished():
            return
        _, updates = step(sched, model)
        for u in updates:
            emitted.setdefault(u.seq, []).extend(u.new_token_ids)


def test_partial_last_block_is_copied_on_write_and_the_last_holder_writes_in_place():
    sched, model = setup()
    bm = sched.block_manager
    prompt = [11, 12, 13, 14, 15, 16]  # 1.5 blocks
    parent = Sequence(prompt, SamplingParams(max_tokens=5, n=3))
    sched.add(parent)
    batch, updates = step(sched, model)
    assert batch.is_prefill and int(batch.num_scheduled_tokens.sum()) == len(prompt)  # prefilled once
    group = parent.group
    assert [s.index for s in group] == [0, 1, 2] and parent.num_forks == 0
    assert all(s.block_table == parent.block_table for s in group)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [3, 3]
    assert bm.num_used_blocks == 2
    assert [u.new_token_ids for u in updates] == [reference_choice(prompt, i, 1) for i in range(3)]

    batch, _ = step(sched, model)  # each choice writes position 6, in the shared second block
    assert len(batch.block_copies) == 2  # two copy it, the last holder keeps it
    shared_first = {s.block_table[0] for s in group}
    assert len(shared_first) == 1 and bm.blocks[parent.block_table[0]].ref_count == 3
    assert len({s.block_table[1] for s in group}) == 3
    emitted: dict = {}
    run(sched, model, emitted)
    for s in group:
        assert s.completion_token_ids == reference_choice(prompt, s.index, 5)
    assert bm.num_free_blocks == 32


def test_a_block_aligned_prompt_copies_nothing():
    sched, model = setup()
    prompt = list(range(20, 28))  # two full blocks
    parent = Sequence(prompt, SamplingParams(max_tokens=6, n=2, best_of=4))
    sched.add(parent)
    copies = 0
    for _ in range(20):
        batch, _ = step(sched, model)
        copies += len(batch.block_copies) if batch is not None else 0
        if sched.is_finished():
            break
    assert copies == 0 and len(parent.group) == 4
    assert all(s.completion_token_ids == reference_choice(prompt, s.index, 6) for s in parent.group)
    assert sched.block_manager.num_free_blocks == 32


def test_aborting_one_choice_frees_only_its_references():
    sched, model = setup()
    bm = sched.block_manager
    parent = Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=20, n=3, ignore_eos=True))
    sched.add(parent)
    for _ in range(3):
        step(sched, model)
    child = parent.group[1]
    own = [b for b in child.block_table if bm.blocks[b].ref_count == 1]
    shared = [b for b in child.block_table if bm.blocks[b].ref_count > 1]
    used = bm.num_used_blocks
    assert sched.abort(child.id) is child and child.status is SequenceStatus.ABORTED
    assert bm.num_used_blocks == used - len(own) and all(bm.blocks[b].ref_count == 2 for b in shared)
    run(sched, model, {})
    assert [s.status for s in parent.group] == [SequenceStatus.FINISHED, SequenceStatus.ABORTED,
                                                  SequenceStatus.FINISHED]
    assert bm.num_free_blocks == 32


def test_pending_forks_hold_seats_and_too_many_choices_are_unschedulable():
    sched, model = setup(max_num_seqs=4)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=3, n=3))
    b = Sequence([4, 5, 6], SamplingParams(max_tokens=3, n=2))
    too_many = Sequence([7, 8], SamplingParams(max_tokens=3, best_of=5))
    for s in (a, b, too_many):
        sched.add(s)
    batch, _ = step(sched, model)
    assert batch.seqs == [a]  # b's two seats do not fit next to a's three
    assert len(sched.running) == 3
    run(sched, model, {}, steps=30)
    (rejected,) = sched.take_rejected()  # reached the head once b was admitted
    assert rejected is too_many and "max_num_seqs=4" in too_many.error
    assert all(s.status is SequenceStatus.FINISHED for s in a.group + b.group) and len(b.group) == 2
    assert sched.block_manager.num_free_blocks == 32
