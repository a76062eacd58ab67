"""A decode engine prefilling a prompt locally protects its running streams
(`max_local_prefill_tokens_per_step`, docs/design.md "Adaptive disaggregation"): between two
tokens of a running stream, the prefill steps in between carry at most the cap's worth of
prompt tokens. Measured in tokens per step with the fake model, not in time."""
from __future__ import annotations

import pytest

from scheduler.scheduler import Scheduler
from scheduler.sequence import SamplingParams, Sequence
from tests.fake_connector import FakeKV, FakeModel, prompt, reference_completion, scheduler_config, step

pytestmark = pytest.mark.unit

CAP = 16
LONG = 300


def drive(cap: int):
    """3 streams decoding, then a LONG-token prompt arrives. Returns, per running stream, the
    prompt tokens prefilled between each two of its tokens after the long prompt arrived,
    the emitted tokens, and the sequences."""
    cfg = scheduler_config(num_kvcache_blocks=256, block_size=4, max_num_batched_tokens=512, max_num_seqs=8,
                           max_model_len=1024, max_local_prefill_tokens_per_step=cap)
    sched = Scheduler(cfg)
    model = FakeModel(FakeKV(256, 4), 0)
    streams = [Sequence(prompt(i, 9), SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(3)]
    for s in streams:
        sched.add(s)
    emitted: dict[int, list[int]] = {}

    def one():
        batch, updates = step(sched, model)
        for u in updates:
            emitted.setdefault(u.seq.id, []).extend(u.new_token_ids)
        return batch, updates

    for _ in range(3):  # streams admitted and decoding
        one()
    long = Sequence(prompt(7, LONG), SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add(long)
    gaps = {s.id: [] for s in streams}
    pending = {s.id: 0 for s in streams}
    for _ in range(1000):
        if sched.is_finished():
            break
        batch, updates = one()
        prefilled = sum(int(n) for n in batch.num_scheduled_tokens) if batch is not None and batch.is_prefill else 0
        for sid in pending:
            pending[sid] += prefilled
        for u in updates:
            if u.seq.id in pending and u.new_token_ids:
                gaps[u.seq.id].append(pending[u.seq.id])
                pending[u.seq.id] = 0
    assert sched.is_finished()
    return gaps, emitted, streams, long


def test_a_local_prefill_never_stalls_running_streams_for_more_than_the_cap():
    gaps, emitted, streams, long = drive(CAP)
    for s in streams:
        assert gaps[s.id], "the stream produced tokens while the long prompt prefilled"
        assert max(gaps[s.id]) <= CAP, gaps[s.id]
        assert emitted[s.id] == reference_completion(s.prompt_token_ids, 60)
    assert emitted[long.id] == reference_completion(long.prompt_token_ids, 5)
    assert sum(1 for s in streams for g in gaps[s.id] if g > 0) > 0  # the long prompt ran alongside


def test_without_the_cap_a_local_prefill_stalls_running_streams_for_the_whole_prompt():
    gaps, emitted, streams, long = drive(0)
    assert max(max(gaps[s.id]) for s in streams) >= LONG - 4  # (the control: the test can see a stall)
    assert emitted[long.id] == reference_completion(long.prompt_token_ids, 5)


def test_the_cap_does_not_hold_back_a_prefill_when_nothing_decodes():
    cfg = scheduler_config(num_kvcache_blocks=256, block_size=4, max_num_batched_tokens=512,
                           max_local_prefill_tokens_per_step=CAP)
    sched = Scheduler(cfg)
    sched.add(Sequence(prompt(1, LONG), SamplingParams(max_tokens=2)))
    batch = sched.schedule()
    assert batch.is_prefill and batch.num_scheduled_tokens.tolist() == [LONG]
